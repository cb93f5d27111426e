"""Session functions the benchmark runs on every worker (threads or worker processes).

A ``ProcessSession`` worker keeps its latest load's shards until the next load replaces them,
and a ``ThreadedSession`` keeps them in its worker contexts; between two measured loads the
benchmark frees them with ``session.call("shardload_bench.drop_shards")``, so one method's
shards never count in the next method's memory. This module is importable (it lives next to
``bench_load.py``, whose folder is on ``sys.path`` and is handed to the workers), which is what
lets worker processes register the function too.
"""

from __future__ import annotations

import ctypes
import gc

from shardload import register_session_func

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


@register_session_func("shardload_bench.drop_shards")
def drop_shards(ctx) -> int:
    """Free this worker's shards (the dict is shared with the worker's load table)."""
    count = len(ctx.shards)
    ctx.shards.clear()
    gc.collect()
    malloc_trim()
    return count
