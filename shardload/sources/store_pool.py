"""Long-lived threads for object storage requests: a ``WorkPool`` runs a batch of items on a
bounded number of threads, the calling thread one of them, and stops the batch at its first
failure. One pool per ``ObjectClient`` runs its GETs; one per process runs ``each``."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["WorkPool"]

T = TypeVar("T")

#: every pool, so that a forked child and the exiting process drop their threads
_POOLS: weakref.WeakSet[WorkPool] = weakref.WeakSet()


class WorkPool:
    """Up to ``threads`` threads, started on first need and kept for later batches.

    >>> pool = WorkPool(4, "example")
    >>> seen = []
    >>> pool.run([1, 2, 3], lambda item, stop: seen.append(item), width=2)
    {}
    >>> sorted(seen)
    [1, 2, 3]
    >>> pool.close()
    """

    def __init__(self, threads: int, name: str):
        self.threads, self.name = threads, name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        _POOLS.add(self)

    def _after_fork(self) -> None:
        # the parent's threads are not in the child, and its lock may have been held
        self._lock = threading.Lock()
        self._executor = None

    def _submit(self, fn: Callable[[], None]) -> Future[None]:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            return self._executor.submit(fn)

    def close(self) -> None:
        """End the pool's threads once they are idle; a later batch starts new ones."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    def run(
        self,
        items: Sequence[T],
        work: Callable[[T, threading.Event], None],
        width: int,
    ) -> dict[int, BaseException]:
        """``work(item, stop)`` for every item, started in their order, at most ``width`` at
        once: on this thread and up to ``width - 1`` of the pool's. Returns the failures by
        the index of their item, in the order they happened. After the first failure ``stop``
        is set and no further item starts; this returns once every item started has ended, so
        nothing is left running. Ctrl-C stops the batch the same way, then is raised.

        The calling thread works too, so a batch always progresses, even one started from
        a pool thread while every other is busy."""
        stop = threading.Event()
        failed: dict[int, BaseException] = {}
        queue: Iterator[tuple[int, T]] = iter(enumerate(items))
        lock = threading.Lock()

        def loop(catch: type[BaseException]) -> None:
            while True:
                with lock:
                    nxt = None if stop.is_set() else next(queue, None)
                if nxt is None:
                    return
                k, item = nxt
                try:
                    work(item, stop)
                except catch as exc:  # handed to the caller
                    with lock:
                        failed[k] = exc
                    stop.set()

        helpers = [
            self._submit(lambda: loop(BaseException))
            for _ in range(min(width, len(items), self.threads + 1) - 1)
        ]
        try:
            loop(Exception)  # Ctrl-C here, on the calling thread, is raised
            _end(helpers)
        except BaseException:  # Ctrl-C: no further item, wait for those running, and go
            stop.set()
            _end(helpers)
            raise
        return failed


def _end(helpers: list[Future[None]]) -> None:
    """Wait for the helpers running; one not started yet (the pool busy with other batches)
    has nothing left to do, and is dropped."""
    for helper in helpers:
        helper.cancel()
    wait(helpers)


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _after_fork_in_child() -> None:
    for pool in list(_POOLS):
        pool._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
