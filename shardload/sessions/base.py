"""What every session offers the loader: N workers, each with a device, that run functions."""

from __future__ import annotations

import abc
from typing import Any, Callable, Sequence, Union

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


class Session(abc.ABC):
    """N workers, worker i owning ``devices[i]``.

    The loader calls ``run_all(fn)``: ``fn(i)`` runs on every worker concurrently; the call
    returns the N results in worker order, or raises ``WorkerError`` naming every worker that
    failed (the earliest failure first) once all workers have stopped.
    """

    num_workers: int
    devices: list[torch.device]

    @abc.abstractmethod
    def run_all(self, fn: Callable[[int], Any], *, context: str = "") -> list[Any]:
        """Run ``fn(i)`` on every worker i; the results in worker order."""

    def close(self) -> None:
        """Stop the workers. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
