"""The session function the load benchmark runs on every worker (threads or worker processes).

A ``ProcessSession`` worker keeps its latest load's shards until the next load replaces them,
and a ``ThreadedSession`` keeps them in its worker contexts; between two measured loads the
benchmark frees them with ``session.call(DROP_SHARDS)``, so one method's shards never count in
the next method's memory. Worker processes import this module as the plugin
``shardbench.worker`` (they take the controller's ``sys.path``), which registers it there too.
"""

from __future__ import annotations

import ctypes
import gc

from shardload import register_session_func

DROP_SHARDS = "shardload_bench.drop_shards"

_libc = None


def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so RSS reflects what is alive."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


@register_session_func(DROP_SHARDS)
def drop_shards(ctx) -> int:
    """Free this worker's shards (the dict is shared with the worker's load table)."""
    count = len(ctx.shards)
    ctx.shards.clear()
    gc.collect()
    malloc_trim()
    return count
