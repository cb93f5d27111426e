"""What every session offers: N workers, each with a device, that run session functions.

A session hosts workers and moves messages; it knows nothing of plans, formats or loading. Its
operations (``run``, ``call``, ``set_value``, ``get_value``, ``collective``) are the same for
threads, worker processes and torchrun ranks; the loader drives every load through them.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DEVICE_CPU, SessionClosedError, Stopped, mention, quote  # noqa: F401 (Stopped: here too)
from ..limits import num_shards_problem
from .watchdog import (  # noqa: F401
    DEFAULT,
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    check_timeout,
    default_timeout,
    session_timeout,
)

if TYPE_CHECKING:  # pragma: no cover
    from .groups import Group

DeviceSpec = str | torch.device | Sequence[str | torch.device]


def resolve_devices(device: DeviceSpec, num_workers: int) -> list[torch.device]:
    """One ``torch.device`` per worker.

    ``"cpu"`` gives every worker the CPU; ``"cuda"`` puts worker i on ``cuda:i``; a list gives
    each worker its own entry (several workers may share a device).

    >>> resolve_devices("cpu", 2)
    [device(type='cpu'), device(type='cpu')]
    """
    problem = num_shards_problem(num_workers)
    if problem is not None:
        raise ValueError(f"num_workers {problem}")
    if isinstance(device, (str, torch.device)):
        dev = _device(device)
        if dev.type == "cuda" and dev.index is None:
            devices = [torch.device("cuda", i) for i in range(num_workers)]
        else:
            devices = [dev] * num_workers
    else:
        if len(device) != num_workers:
            raise ValueError(
                f"{len(device)} devices given for {num_workers} workers; give one per worker"
            )
        devices = [_device(d) for d in device]
    for d in devices:
        if d.type == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = d.index if d.index is not None else 0
            if index >= available:
                raise mention(
                    ValueError(
                        f"device {d} asked for, but this machine has {available} CUDA device(s); "
                        f"use {DEVICE_CPU.python}, or fewer workers, or a device list"
                    ),
                    DEVICE_CPU,
                )
        elif d.type not in ("cpu", "meta") and not hasattr(torch, d.type):
            raise ValueError(f"unsupported device {d}")
    return devices


def _device(spec: str | torch.device) -> torch.device:
    try:
        return torch.device(spec)
    except (RuntimeError, TypeError):  # torch's message lists every device type it knows
        raise ValueError(f"{quote(spec)} is not a device: use 'cpu', 'cuda' or 'cuda:N'") from None


class Heartbeats:
    """The watchdog's view of N workers: when each last made progress, and on what.

    Whoever sees a worker progress calls ``beat`` (a worker thread itself, or the controller
    when a worker process's progress message arrives); ``done`` takes a worker out of the
    watch; the session's waiting loop asks ``stalled``. Plain list stores: safe across threads
    under the GIL, and a stale read only delays a verdict by one poll.
    """

    def __init__(self, num_workers: int, watched: Sequence[int] | None = None):
        now = time.monotonic()
        self.last = [now] * num_workers
        self.where: list[str | None] = [None] * num_workers
        watched = range(num_workers) if watched is None else watched
        self.pending = [False] * num_workers
        for i in watched:
            self.pending[i] = True

    def beat(self, worker: int, where: str | None = None) -> None:
        """Worker ``worker`` made progress; ``where`` (a parameter name) is what it is on now."""
        self.last[worker] = time.monotonic()
        if where is not None:
            self.where[worker] = where

    def done(self, worker: int) -> None:
        self.pending[worker] = False

    def stalled(self, timeout: float | None) -> list[int]:
        """The watched workers without progress for over ``timeout`` seconds, the one stalled
        longest first; none when ``timeout`` is None."""
        if timeout is None:
            return []
        now = time.monotonic()
        late = [
            (self.last[i], i)
            for i, p in enumerate(self.pending)
            if p and now - self.last[i] > timeout
        ]
        return [i for _, i in sorted(late)]

    def describe(self, worker: int, timeout: float) -> str:
        """``"no progress for 5 s on parameter 'w'"``: what the watchdog saw of ``worker``."""
        where = self.where[worker]
        on = f" on parameter {quote(where)}" if where is not None else ""
        return f"no progress for {timeout:g} s{on} (the watchdog's timeout)"


def _no_progress(nbytes: int = 0, where: str | None = None) -> None:
    pass


@dataclass
class WorkerContext:
    """What a worker holds: its place in the session, its shards and the values set on it.

    Session functions (``register_session_func``) receive it as their first argument. While
    one runs, ``progress`` tells the session it is alive (for the watchdog and progress bars)
    and ``should_stop`` whether it should give up (another worker failed). ``group`` holds the
    session's collectives among its workers (``all_reduce``, ``broadcast``, ``barrier``:
    ``groups.py``), supplied by each kind of session.
    """

    rank: int
    world_size: int
    device: torch.device
    shards: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    group: Group | None = field(default=None, repr=False)
    _progress: Callable[[int, str | None], None] = field(default=_no_progress, repr=False)
    _stop: Callable[[], bool] = field(default=lambda: False, repr=False)

    def progress(self, nbytes: int = 0, where: str | None = None) -> None:
        """Report progress: ``nbytes`` more done (for a progress bar), now working on ``where``
        (a parameter name, shown if this worker is later found stuck)."""
        self._progress(nbytes, where)

    def should_stop(self) -> bool:
        """True once the session wants this worker to stop (raise ``Stopped``)."""
        return self._stop()

    @contextlib.contextmanager
    def hooks(self, progress: Callable[[int, str | None], None], stop: Callable[[], bool]):
        """For a session: route ``progress``/``should_stop`` while a function runs."""
        self._progress, self._stop = progress, stop
        try:
            yield self
        finally:
            self._progress, self._stop = _no_progress, (lambda: False)


#: per-worker arguments: one sequence of positional args per worker run (in the order of
#: ``workers``), or a function of the worker's index giving them (called only for the workers
#: that run here)
WorkerArgs = Sequence[Sequence[Any]] | Callable[[int], Sequence[Any]]
ProgressCallback = Callable[[int], None]


def args_for(args: WorkerArgs, workers: Sequence[int]) -> dict[int, list]:
    """Each of ``workers``' positional args, by worker."""
    if callable(args):
        return {w: list(args(w)) for w in workers}
    if len(args) != len(workers):
        raise ValueError(
            f"{len(args)} sets of args for {len(workers)} workers; give one per worker run"
        )
    return {w: list(a) for w, a in zip(workers, args)}


class Session(abc.ABC):
    """N workers, worker i owning ``devices[i]``, that run session functions.

    Sessions decide *where* work runs (threads, processes, the ranks of a torch.distributed
    job) and carry its messages; callers (the loader, an engine) decide *what* runs.
    """

    num_workers: int
    devices: list[torch.device]
    #: the watchdog: seconds a worker may go without progress before the session gives up on
    #: it (``WorkerError`` naming it and what it was on; the session is then closed), or None
    timeout: float | None = None

    @property
    def local_workers(self) -> list[int]:
        """The workers that run in this process, sharing its memory (threads: all; worker
        processes: none; a torchrun rank: itself)."""
        return []

    @property
    def spmd(self) -> bool:
        """True when every worker runs the caller's program itself (torchrun): then ``run``
        and ``collective`` are collectives every worker must enter, and a worker's memory is
        reachable only from its own process."""
        return False

    @property
    def workers_in_view(self) -> list[int]:
        """The workers whose work this process sees: all of them, or under torchrun this
        rank's alone (what a progress bar here counts)."""
        return self.local_workers if self.spmd else list(range(self.num_workers))

    @property
    def reports(self) -> bool:
        """Whether this process speaks for the session (bars, summaries): always, or under
        torchrun on rank 0 alone."""
        return not self.spmd or self.local_workers == [0]

    @abc.abstractmethod
    def run(
        self,
        func_name: str,
        args: WorkerArgs,
        *,
        workers: Sequence[int] | None = None,
        context: str = "",
        timeout: float | None = DEFAULT,
        on_progress: ProgressCallback | None = None,
    ) -> list[Any]:
        """Run the session function ``func_name(ctx, *args_i)`` on each worker ``i`` of
        ``workers`` (default: all), with its own ``args_i``; the results in that order.

        Args and results are JSON values or torch tensors. Failures become one
        ``WorkerError`` once every worker stopped, listing each failed worker (index, exception
        type, message, remote traceback), the earliest first; the others are asked to stop
        (``ctx.should_stop()``). ``timeout`` (default: the session's) is the watchdog;
        ``on_progress(nbytes)`` receives what the workers report with ``ctx.progress``.
        """

    def call(self, func_name: str, *args: Any) -> list[Any]:
        """Run the session function ``func_name(ctx, *args)`` on every worker; results in
        worker order. Args and results are JSON values or torch tensors."""
        return self.run(func_name, lambda i: args, context=f"in {func_name}")

    def collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A context in which a failure on any worker is reported on every worker.

        Only a session whose workers run the caller's code themselves (torch.distributed)
        needs it; elsewhere the controller sees every failure already.
        """
        return contextlib.nullcontext()

    @abc.abstractmethod
    def set_value(self, worker: int, name: str, value: Any) -> None:
        """Store ``value`` (a JSON value or tensor) as ``ctx.values[name]`` on one worker."""

    @abc.abstractmethod
    def get_value(self, worker: int, name: str) -> Any:
        """A copy of ``ctx.values[name]`` from one worker."""

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran (or the session closed itself after a crash, Ctrl-C or
        a timeout): it runs nothing more."""
        return bool(getattr(self, "_closed", False))

    def _check_open(self) -> None:
        """``SessionClosedError`` (also a ``RuntimeError``) once the session is closed."""
        if self.closed:
            raise SessionClosedError(type(self).__name__)

    def _check_worker(self, worker: int) -> None:
        if type(worker) is not int or not 0 <= worker < self.num_workers:
            raise IndexError(f"worker {worker!r} out of range for {self.num_workers} workers")

    def _workers(self, workers: Sequence[int] | None) -> list[int]:
        if workers is None:
            return list(range(self.num_workers))
        workers = list(workers)
        for w in workers:
            self._check_worker(w)
        if len(set(workers)) != len(workers):
            raise ValueError(f"workers {workers} name a worker twice")
        return workers

    def close(self) -> None:  # noqa: B027 - a session with nothing to stop keeps this one
        """Stop the workers. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
