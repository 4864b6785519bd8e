"""The infrastructure every lesson stands on.

:mod:`~collectives.core.launch` (run a function on N local ranks), :mod:`~collectives.core.ops`
(argument checks, reduction operators, views, ``sendrecv``), :mod:`~collectives.core.trace`
(who sent what), :mod:`~collectives.core.streams` (streams and events that are no-ops on CPU),
:mod:`~collectives.core.timing`, :mod:`~collectives.core.cost` (the α–β model),
:mod:`~collectives.core.nccl_memory` (registered memory on GPUs) and
:mod:`~collectives.core.cluster` (several machines on one host: network namespaces joined
by a shaped link). Nothing here imports a lesson or the course's tooling.
"""
