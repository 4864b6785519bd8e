"""Collectives from Scratch: collective communication built by hand on torch.distributed.

Shared infrastructure: :mod:`~collectives.launch` (run a function on N local ranks),
:mod:`~collectives.verify` (the equivalence harness against ``dist.all_reduce``),
:mod:`~collectives.trace` (who sent what), :mod:`~collectives.cost` (the α–β model),
:mod:`~collectives.streams` (streams and events that are no-ops on CPU),
:mod:`~collectives.timing`, :mod:`~collectives.ops`. One module per lesson beside them.
"""

__version__ = "0.1.0"
