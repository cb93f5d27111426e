"""``SharedOutputs``: a value the workers of one process each need, computed by the first of
them and shared with the rest.

The loader shares the full output of a chain this way (``pieces.sharing``), and transformers'
model shares the dequantized tensors every worker holds whole (``hf.weights``): one copy in
memory, one worker's time, however many workers the process hosts.

>>> shared = SharedOutputs(num_workers=2)
>>> value, computed = shared.take("w", lambda: torch.ones(3), waiting=lambda: None)
>>> computed
True
>>> shared.release("w")   # each worker, once it holds its own reference
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import Stopped

__all__ = ["SharedOutputs"]


@dataclass
class _Cell:
    value: torch.Tensor | None = None
    failed: bool = False
    ready: bool = False
    taken: int = 0


class SharedOutputs:
    """Values computed once and shared by the ``num_workers`` workers of a process.

    The first worker to reach a name computes it; the others wait for it. A cell is dropped
    when all its workers have taken it (``release``), and a new one is opened only while fewer
    than ``most_alive`` are alive, which bounds the memory held for workers still behind. Every
    worker must take and release the same names in the same order. No deadlock then: a worker
    holds no cell while it waits for a slot, and only the worker furthest ahead ever opens one,
    so the workers behind it, who free the slots, never wait on it.

    ``stop()`` true, or ``waiting()`` raising, ends a wait (``Stopped``); a worker that waited
    on a computation that failed raises ``Stopped`` too: the worker that computed it reports the
    failure.
    """

    def __init__(
        self, num_workers: int, stop: Callable[[], bool] = lambda: False, *, most_alive: int = 2
    ):
        self._n = num_workers
        self._stop = stop
        self._most_alive = most_alive
        self._cond = threading.Condition()
        self._cells: dict[str, _Cell] = {}

    def take(
        self, name: str, compute: Callable[[], torch.Tensor], waiting: Callable[[], None]
    ) -> tuple[torch.Tensor, bool]:
        """The value for ``name`` and whether this call computed it. ``waiting()`` is called
        while this worker waits on another (a worker waiting on a stuck one is alive)."""
        with self._cond:
            while True:
                self._check_stop()
                cell = self._cells.get(name)
                if cell is not None or len(self._cells) < self._most_alive:
                    break
                waiting()
                self._cond.wait(0.1)
            owner = cell is None
            if cell is None:
                cell = self._cells[name] = _Cell()
        if owner:
            try:
                value = cell.value = compute()
            except BaseException:
                cell.failed = True
                raise
            finally:
                with self._cond:
                    cell.ready = True
                    self._cond.notify_all()
            return value, True
        with self._cond:
            while not cell.ready:
                self._check_stop()
                waiting()
                self._cond.wait(0.1)
        if cell.failed or cell.value is None:  # (no value: it failed)
            raise Stopped()  # the owner reports the failure; this worker stops quietly
        return cell.value, False

    def release(self, name: str) -> None:
        """This worker is done with ``name``: once all have taken it, its cell is dropped."""
        with self._cond:
            cell = self._cells.get(name)
            if cell is None:
                return
            cell.taken += 1
            if cell.taken == self._n:
                del self._cells[name]
                self._cond.notify_all()

    def _check_stop(self) -> None:
        if self._stop():
            raise Stopped()
