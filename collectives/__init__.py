"""Collectives from Scratch: collective communication built by hand on torch.distributed.

Three layers, one folder each, imports going one way (tooling -> lessons -> infrastructure)::

    collectives/
      core/      the infrastructure: launch, ops, trace, streams, timing, cost, nccl_memory, cluster
      p2p.py basics.py naive_ring.py ring.py topologies.py fused/ bucketing/
                 the lessons' reference code, each importing only earlier lessons and core
      course/    the tooling: lesson map, verify, tour; site/, benchmarks/, grading/, cli/

``from collectives import launch, ops, trace, verify`` (and ``streams``, ``timing``,
``cost``, ``nccl_memory``, ``cluster``) is the short form: the infrastructure is imported with the
package, ``verify`` (tooling) only when asked for.
"""

import importlib

from .core import cluster, cost, launch, nccl_memory, ops, streams, timing, trace  # noqa: F401

__version__ = "0.1.0"

_LAZY = {"verify": "collectives.course.verify", "plots": "collectives.course.site.plots"}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'collectives' has no attribute {name!r}")
