"""The lesson map: one entry per lesson, naming its five surfaces.

Everything that walks the course -- the tour, the grader, the tests' ``--impl`` option,
the site's checks -- reads this table, so a lesson is added in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository: collectives/course/catalog.py

# How long a world of the exercise runner, the torchrun path or the grader may run before
# it is stopped as hung: the same everywhere, set with --timeout (or COLLECTIVES_TIMEOUT).
DEFAULT_TIMEOUT = 30.0


def world_timeout(default: float = DEFAULT_TIMEOUT) -> float:
    """Seconds a graded or checked world may take: ``COLLECTIVES_TIMEOUT`` (what ``--timeout``
    of the grader and the runner sets), else ``default``."""
    value = os.environ.get("COLLECTIVES_TIMEOUT", "")
    return float(value) if value else default


@dataclass(frozen=True)
class Lesson:
    number: int
    slug: str        # lessons/NN_slug/, notebooks/NN_slug.ipynb, tests/test_NN_slug.py
    title: str
    module: str      # the reference implementation (a module, or a lesson's folder)
    also: tuple[str, ...] = ()   # further modules of the lesson that live beside it

    @property
    def nn(self) -> str:
        return f"{self.number:02d}"

    @property
    def exercise(self) -> Path:
        return ROOT / "lessons" / f"{self.nn}_{self.slug}" / "exercise.py"

    @property
    def notebook(self) -> Path:
        return ROOT / "notebooks" / f"{self.nn}_{self.slug}.ipynb"

    @property
    def test_file(self) -> Path:
        return ROOT / "tests" / f"test_{self.nn}_{self.slug}.py"

    @property
    def page(self) -> Path:
        return ROOT / "docs" / "lessons" / f"{self.nn}-{self.slug.replace('_', '-')}.md"


LESSONS = [
    Lesson(1, "p2p", "Point-to-point: send, recv, isend, irecv", "collectives.p2p"),
    Lesson(2, "collectives", "The collectives, and building them from send/recv", "collectives.basics"),
    Lesson(3, "naive_ring", "The naive ring", "collectives.naive_ring"),
    Lesson(4, "ring", "The bandwidth-optimal ring and its rivals", "collectives.ring",
           also=("collectives.topologies",)),
    Lesson(5, "fused", "Fused buffers, after SINGA", "collectives.fused"),
    Lesson(6, "bucketing", "DDP gradient bucketing", "collectives.bucketing"),
    Lesson(7, "hierarchical", "Hierarchical all-reduce, after Fairring", "collectives.hierarchical"),
    Lesson(8, "sparse", "Sparse all-reduce with error feedback, after SINGA", "collectives.sparse"),
    Lesson(9, "debugging", "When collectives go wrong: a flight recorder and an analyzer", "collectives.debugging"),
    Lesson(10, "sharded", "Sharded data parallel: ZeRO-1/2/3 and FSDP", "collectives.sharded"),
    Lesson(11, "alltoall", "All-to-all and mixture-of-experts dispatch", "collectives.alltoall"),
    Lesson(12, "symmetric", "Collectives without messages: shared and symmetric memory", "collectives.symmetric"),
    Lesson(13, "tensor_parallel", "Tensor and sequence parallelism, ending in async TP", "collectives.tensor_parallel"),
    Lesson(14, "pipeline", "Pipeline parallelism: GPipe, 1F1B, interleaved and zero-bubble", "collectives.pipeline"),
]


def lesson(number: int | str) -> Lesson:
    n = int(number)
    for item in LESSONS:
        if item.number == n:
            return item
    raise KeyError(f"no lesson {number}; lessons are " + ", ".join(item.nn for item in LESSONS))
