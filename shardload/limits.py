"""Limits that more than one layer applies, defined once (each module states its own others).

Every limit is far beyond what a real model needs and exists so that hostile input is refused
with a message that states it, before it sizes an allocation or a loop. This module imports
nothing, so readers, plans and sessions can all use it without depending on one another.
"""

#: workers in one session, and the largest ``num_shards`` a plan binds to: beyond any
#: tensor-parallel group, and each worker is a thread or a process (``--shards 100000`` is a typo)
MAX_NUM_SHARDS = 4096
#: the largest dimension any shape may have: 2**53, the largest integer every JSON reader
#: (including float64-only ones) holds exactly, and far beyond any real tensor
MAX_DIM = 2**53
#: the most dimensions a shape may have (numpy's and torch's limit)
MAX_NDIM = 64
#: elements, strides and byte sizes are int64 in torch
INT64_MAX = 2**63 - 1
