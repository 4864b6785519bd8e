"""The benchmarks: each ``.venv/bin/python -m collectives bench-...`` command and the record it writes.

One module per lesson or topic: :mod:`~collectives.course.benchmarks.allreduce` (``bench``,
lessons 3-4), :mod:`~collectives.course.benchmarks.fused` (``bench-fused``, lesson 5),
:mod:`~collectives.course.benchmarks.bucketing` (``bench-ddp``, lesson 6),
:mod:`~collectives.course.benchmarks.hierarchical` with its ``_inflight``, ``_train`` and
``_record`` modules (``bench-hier``, lesson 7), :mod:`~collectives.course.benchmarks.sparse`
with ``sparse_train``, ``sparse_report`` and ``sparse_record`` (``bench-sparse``,
``bench-sparse-train``, lesson 8), :mod:`~collectives.course.benchmarks.debugging`
(``bench-recorder``, lesson 9) and :mod:`~collectives.course.benchmarks.cluster`
(``bench-cluster``, the simulated cluster's two tiers). A benchmark may draw with
:mod:`collectives.course.site`; nothing here imports the grading.
"""
