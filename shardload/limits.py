"""Limits that more than one layer applies, defined once (each module states its own others).

Every limit is far beyond what a real model needs and exists so that hostile input is refused
with a message that states it, before it sizes an allocation or a loop. This module imports
nothing of shardload, so readers, plans and sessions can all use it without depending on one
another.

The number of workers is checked in one place, ``num_shards_problem``; each caller puts the
clause it returns in its own error type:

>>> num_shards_problem(4) is None
True
>>> num_shards_problem(0)
'must be a positive integer, at most 4096, got 0'
>>> num_shards_problem(100_000)[:40]
'is 100000, more than the 4096 workers sh'
"""

from typing import Any

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


def num_shards_problem(value: Any) -> str | None:
    """None when ``value`` is a number of workers shardload runs (an ``int``, not a ``bool``,
    from 1 to ``MAX_NUM_SHARDS``); otherwise one clause saying what is wrong with it and the
    limit, to follow the name of what was given (``f"num_shards {problem}"``)."""
    if type(value) is int and 1 <= value <= MAX_NUM_SHARDS:
        return None
    if type(value) is not int or value < 1:
        return f"must be a positive integer, at most {MAX_NUM_SHARDS}, got {_shown(value)}"
    return (
        f"is {_shown(value)}, more than the {MAX_NUM_SHARDS} workers shardload runs in one "
        "session (each is a thread or a process)"
    )


def _shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to about ``limit`` characters (never built whole for a huge string or
    an integer of more digits than ``str`` converts)."""
    if type(value) is int and value.bit_length() > 128:
        return f"{'a negative' if value < 0 else 'an'} integer of {value.bit_length()} bits"
    text = repr(value[: limit + 1]) if isinstance(value, str) else repr(value)
    return text if len(text) <= limit + 2 else text[:limit] + "..."
