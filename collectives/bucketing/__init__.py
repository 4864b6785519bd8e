"""Lesson 6: DDP-style gradient bucketing, after PyTorch's ``c10d::Reducer``.

:mod:`collectives.bucketing.reducer` is the lesson (buckets, hooks, in-order launch,
rebuild, unused parameters); :mod:`collectives.bucketing.models` holds the small models
the tests, the lab and the benchmark train.
"""

from .models import (BranchNet, DeepMLP, SmallMLP, TiedNet, TinyTransformer,  # noqa: F401
                     TwoBranchNet, make_model, plot_timeline)
from .reducer import BackwardStats, Bucket, BucketedReducer, assign_buckets  # noqa: F401

__all__ = ["BucketedReducer", "assign_buckets", "Bucket", "BackwardStats", "make_model",
           "SmallMLP", "DeepMLP", "TinyTransformer", "TiedNet", "BranchNet", "TwoBranchNet",
           "plot_timeline"]
