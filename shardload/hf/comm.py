"""The collectives a tensor-parallel forward needs, for each kind of session.

A row-parallel layer (o_proj, down_proj, the experts) leaves each worker with a partial sum;
``all_reduce`` adds them up on every worker. ``broadcast`` hands worker 0's choice (the next
token) to all. Three backends, chosen by the controller from the session:

* ``ThreadGroup``: the workers are threads of one process (``ThreadedSession``): each puts its
  tensor in a shared slot, waits at a barrier, and every worker adds the slots up in rank order
  (so every worker gets the very same bits);
* ``torch.distributed`` (``DistGroup``): worker processes (``ProcessSession``, joined into a
  gloo group on first use) and the ranks of a torchrun job (its own group).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

#: thread groups by token: the workers of one ThreadedSession model find theirs here
_thread_groups: dict[str, "ThreadGroup"] = {}
_lock = threading.Lock()


class ThreadGroup:
    """All-reduce and broadcast among the ``size`` threads of one session."""

    def __init__(self, size: int, timeout: Optional[float] = None):
        self.size = size
        self.timeout = timeout
        self._slots: list[Optional[torch.Tensor]] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout)

    def all_reduce(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The sum of every worker's ``tensor``, on every worker (in place)."""
        self._slots[rank] = tensor.clone()
        self._barrier.wait()
        total = self._slots[0].clone()
        for other in self._slots[1:]:
            total += other
        self._barrier.wait()          # nobody overwrites a slot another is still adding
        tensor.copy_(total)
        return tensor

    def broadcast(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Worker 0's ``tensor``, on every worker (in place)."""
        if rank == 0:
            self._slots[0] = tensor.clone()
        self._barrier.wait()
        tensor.copy_(self._slots[0])
        self._barrier.wait()
        return tensor

    def abort(self) -> None:
        """Release every waiting worker (another worker failed)."""
        self._barrier.abort()


def thread_group(token: str, size: int) -> ThreadGroup:
    """The thread group of model ``token`` (made by the first worker to ask)."""
    with _lock:
        group = _thread_groups.get(token)
        if group is None:
            group = _thread_groups[token] = ThreadGroup(size)
        return group


def drop_thread_group(token: str) -> None:
    with _lock:
        group = _thread_groups.pop(token, None)
    if group is not None:
        group.abort()


class DistGroup:
    """All-reduce and broadcast over torch.distributed's default group (gloo on CPU)."""

    def all_reduce(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(tensor, src=0)
        return tensor

    def abort(self) -> None:
        pass


def join_process_group(address: str, rank: int, size: int) -> DistGroup:
    """This worker process's membership of the session's gloo group (joined once: a worker
    process serves one session)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
    elif dist.get_world_size() != size or dist.get_rank() != rank:
        raise RuntimeError(f"this worker process is already rank {dist.get_rank()} of a "
                           f"{dist.get_world_size()}-process group, not rank {rank} of {size}")
    return DistGroup()


__all__ = ["ThreadGroup", "DistGroup", "thread_group", "drop_thread_group",
           "join_process_group"]
