"""Collectives among a session's workers: what a worker's ``ctx.group`` offers (Disco's model).

A tensor-parallel forward leaves each worker with a partial sum after a row-parallel layer;
``all_reduce`` adds them up on every worker, ``broadcast`` hands one worker's tensor (the next
token) to all, ``barrier`` waits for every worker. Each session supplies its own:

* ``ThreadedSession``: ``ThreadGroup``, the workers being threads of one process: each puts its
  tensor in a shared slot, waits at a barrier, and every worker adds the slots up in rank order
  (so every worker gets the very same bits). A worker that fails breaks the barrier, so the
  others stop (``Stopped``) instead of waiting for ever; the next run starts with it mended;
* ``ProcessSession``: ``DistGroup`` over the torch.distributed group its worker processes form
  when they start (NCCL where each worker has a GPU of its own, else gloo: ``group_backend``);
* ``TorchDistributedSession``: ``DistGroup`` over the job's own group.

>>> @register_session_func("example.total")                         # doctest: +SKIP
... def total(ctx, x):
...     return ctx.group.all_reduce(torch.tensor([x + ctx.rank])).item()
>>> with ThreadedSession(2) as sess:
...     sess.call("example.total", 10)
[21, 21]
"""

from __future__ import annotations

import threading
from typing import NoReturn

import torch

__all__ = ["DistGroup", "Group", "NoGroup", "ThreadGroup", "ThreadMember"]


class Group:
    """One worker's view of its session's collectives: ``rank`` of ``size``."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every worker's ``tensor``, on every worker, in place; returns it."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Worker ``src``'s ``tensor``, on every worker, in place; returns it."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Return once every worker has called it."""
        raise NotImplementedError


class ThreadGroup:
    """The shared state of the ``size`` worker threads of one ``ThreadedSession``."""

    def __init__(self, size: int):
        self.size = size
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size)

    def member(self, rank: int) -> ThreadMember:
        return ThreadMember(self, rank)

    def slot(self, rank: int) -> torch.Tensor:
        """What worker ``rank`` put in its slot before the barrier all just passed."""
        tensor = self._slots[rank]
        if tensor is None:  # every worker fills its slot before the barrier
            raise RuntimeError(f"worker {rank} reached the barrier with its slot empty")
        return tensor

    def wait(self) -> None:
        from .base import Stopped

        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise Stopped() from None  # another worker failed: it is the one reported

    def abort(self) -> None:
        """Release every waiting worker (another worker failed, or the run was interrupted)."""
        self._barrier.abort()

    def mend(self) -> None:
        """Make a broken barrier usable again (before the next run)."""
        if self._barrier.broken:
            self._barrier.reset()
            self._slots = [None] * self.size


class ThreadMember(Group):
    def __init__(self, group: ThreadGroup, rank: int):
        self._group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        g = self._group
        g._slots[self.rank] = tensor.clone()
        g.wait()
        total = g.slot(0).to(tensor.device, copy=True)
        for other in range(1, g.size):
            total += g.slot(other).to(tensor.device)
        g.wait()  # nobody overwrites a slot another is still adding
        tensor.copy_(total)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        g = self._group
        if self.rank == src:
            g._slots[src] = tensor.clone()
        g.wait()
        tensor.copy_(g.slot(src).to(tensor.device))
        g.wait()
        return tensor

    def barrier(self) -> None:
        self._group.wait()


class DistGroup(Group):
    """Collectives over a torch.distributed group: the default one, or ``group`` (an engine's
    tensor-parallel group, say); ``rank`` and ``src`` are ranks within it."""

    def __init__(self, rank: int, size: int, group=None):
        self.rank, self.size, self._group = rank, size, group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self._group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(tensor, group=self._group, group_src=src)
        return tensor

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._group)


class NoGroup(Group):
    """The group of workers that have none (a ``ProcessSession`` opened with
    ``distributed=False``): every collective says so."""

    def __init__(self, rank: int, size: int, why: str):
        self.rank, self.size, self._why = rank, size, why

    def _refuse(self) -> NoReturn:
        from ..errors import ShardloadError

        raise ShardloadError(f"worker {self.rank} has no collectives: {self._why}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._refuse()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._refuse()

    def barrier(self) -> None:
        self._refuse()
