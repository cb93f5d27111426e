"""``gc_paused()``: Python's cyclic garbage collector held off while a load runs.

A load of a large checkpoint makes hundreds of thousands of objects that all stay alive: read
plans (a tuple per piece and run), then the pieces themselves. Every few hundred new objects
start a collection, and every so often one of them walks every object alive: measured on a
100,000-tensor file at N = 8, a single such walk took 1.3 s, and they recur as the load goes
on. Loads make no reference cycles worth collecting, so none is missed: cyclic garbage made
meanwhile by other threads is collected once the last pause ends.

>>> with gc_paused():
...     pieces = [(i, i + 1) for i in range(100_000)]
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off for the block; nested and concurrent pauses (loads in several
    threads) end when the last one does, restoring whatever the collector was before the
    first."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
