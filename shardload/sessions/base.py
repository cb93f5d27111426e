"""What every session offers the loader: N workers, each with a device, that run functions."""

from __future__ import annotations

import abc
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Sequence, Union

import torch

from ..errors import quote
from ..limits import MAX_NUM_SHARDS

if TYPE_CHECKING:  # pragma: no cover  (the loader imports sessions, never the reverse)
    from ..loader import ShardedParams

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
    if num_workers > MAX_NUM_SHARDS:
        raise ValueError(f"{num_workers} workers asked for; at most {MAX_NUM_SHARDS} are "
                         "supported (one per tensor-parallel rank)")
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


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    """``timeout`` as a float of seconds, or ``None`` (no watchdog); ``ValueError`` otherwise.

    >>> check_timeout(2)
    2.0
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got "
                         f"{timeout!r}")
    return float(timeout)


class Heartbeats:
    """The watchdog's view of N workers: when each last made progress, and on what.

    Whoever sees a worker progress calls ``beat`` (a worker thread itself, or the controller
    when a worker process's progress message arrives); ``done`` takes a worker out of the
    watch; the session's waiting loop asks ``stalled``. Plain list stores: safe across threads
    under the GIL, and a stale read only delays a verdict by one poll.
    """

    def __init__(self, num_workers: int, watched: Optional[Sequence[int]] = None):
        now = time.monotonic()
        self.last = [now] * num_workers
        self.where: list[Optional[str]] = [None] * num_workers
        watched = range(num_workers) if watched is None else watched
        self.pending = [False] * num_workers
        for i in watched:
            self.pending[i] = True

    def beat(self, worker: int, where: Optional[str] = None) -> None:
        """Worker ``worker`` made progress; ``where`` (a parameter name) is what it is on now."""
        self.last[worker] = time.monotonic()
        if where is not None:
            self.where[worker] = where

    def done(self, worker: int) -> None:
        self.pending[worker] = False

    def stalled(self, timeout: Optional[float]) -> list[int]:
        """The watched workers without progress for over ``timeout`` seconds, the one stalled
        longest first; none when ``timeout`` is None."""
        if timeout is None:
            return []
        now = time.monotonic()
        late = [(self.last[i], i) for i, p in enumerate(self.pending)
                if p and now - self.last[i] > timeout]
        return [i for _, i in sorted(late)]

    def describe(self, worker: int, timeout: float) -> str:
        """``"no progress for 5 s on parameter 'w'"``: what the watchdog saw of ``worker``."""
        where = self.where[worker]
        on = f" on parameter {quote(where)}" if where is not None else ""
        return f"no progress for {timeout:g} s{on} (the watchdog's timeout)"


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
    #: the watchdog: seconds a worker may go without progress before the session gives up on
    #: it (``WorkerError`` naming it and its parameter; the session is then closed), or None
    timeout: Optional[float] = None

    @abc.abstractmethod
    def _load(self, ckpt, validated, progress,
              timeout: Optional[float] = None) -> "ShardedParams":
        """Run the per-worker load on every worker; called by ``load_sharded``. ``timeout``
        (None: the session's own) is the watchdog's for this load."""

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
