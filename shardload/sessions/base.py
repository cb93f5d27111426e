"""What every session offers the loader: N workers, each with a device, that run functions."""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Sequence, Union

import torch

DeviceSpec = Union[str, torch.device, Sequence[Union[str, torch.device]]]


def resolve_devices(device: DeviceSpec, num_workers: int) -> list[torch.device]:
    """One ``torch.device`` per worker.

    ``"cpu"`` gives every worker the CPU; ``"cuda"`` puts worker i on ``cuda:i``; a list gives
    each worker its own entry (several workers may share a device).

    >>> resolve_devices("cpu", 2)
    [device(type='cpu'), device(type='cpu')]
    """
    if type(num_workers) is not int or num_workers < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    if isinstance(device, (list, tuple)):
        if len(device) != num_workers:
            raise ValueError(f"{len(device)} devices given for {num_workers} workers; give one "
                             "per worker")
        devices = [_device(d) for d in device]
    else:
        dev = _device(device)
        if dev.type == "cuda" and dev.index is None:
            devices = [torch.device("cuda", i) for i in range(num_workers)]
        else:
            devices = [dev] * num_workers
    for d in devices:
        if d.type == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = d.index if d.index is not None else 0
            if index >= available:
                raise ValueError(f"device {d} asked for, but this machine has {available} CUDA "
                                 "device(s); use --device cpu, or fewer workers, or a device list")
        elif d.type not in ("cpu", "meta") and not hasattr(torch, d.type):
            raise ValueError(f"unsupported device {d}")
    return devices


def _device(spec: Union[str, torch.device]) -> torch.device:
    try:
        return torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{spec!r} is not a device: use 'cpu', 'cuda' or 'cuda:N' ({exc})") \
            from None


@dataclass
class WorkerContext:
    """What a worker holds: its place in the session, its shards and the values set on it.

    Session functions (``register_session_func``) receive it as their first argument.
    """

    rank: int
    world_size: int
    device: torch.device
    shards: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


class Session(abc.ABC):
    """N workers, worker i owning ``devices[i]``; the loader's way to run code on them.

    Sessions decide *where* the per-worker algorithm runs (threads, processes, the ranks of a
    torch.distributed job); the loader decides *what* it does.
    """

    num_workers: int
    devices: list[torch.device]

    @abc.abstractmethod
    def _load(self, ckpt, validated, progress) -> "ShardedParams":  # noqa: F821
        """Run the per-worker load on every worker; called by ``load_sharded``."""

    def collective(self, what: str) -> ContextManager[None]:
        """A context in which a failure on any worker is reported on every worker.

        Only a session whose workers run the caller's code themselves (torch.distributed)
        needs it; elsewhere the controller sees every failure already.
        """
        return contextlib.nullcontext()

    @abc.abstractmethod
    def call(self, func_name: str, *args: Any) -> list[Any]:
        """Run the session function ``func_name(ctx, *args)`` on every worker; results in
        worker order. Args and results are JSON values or torch tensors."""

    @abc.abstractmethod
    def set_value(self, worker: int, name: str, value: Any) -> None:
        """Store ``value`` (a JSON value or tensor) as ``ctx.values[name]`` on one worker."""

    @abc.abstractmethod
    def get_value(self, worker: int, name: str) -> Any:
        """A copy of ``ctx.values[name]`` from one worker."""

    def _check_worker(self, worker: int) -> None:
        if type(worker) is not int or not 0 <= worker < self.num_workers:
            raise IndexError(f"worker {worker!r} out of range for {self.num_workers} workers")

    def close(self) -> None:
        """Stop the workers. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
