"""Workers as separate processes: the TVM Disco model.

The controller starts N workers, each with one end of a socket pair, and drives them with JSON
messages (tensors travel as raw bytes; see ``protocol.py``). Shards stay in the workers: the
controller holds handles and fetches copies on request.

How workers start (``start_method``, or the environment variable ``SHARDLOAD_WORKER_START``):
``"forkserver"`` (the default on Linux) forks each from this process's fork server, an
interpreter that has imported torch and shardload once (``forkserver.py``): N workers start in
about the time of one, and a second session in the same process in milliseconds.
``"spawn"`` starts each as a fresh interpreter, ``python -m shardload.sessions.worker``, which
imports torch itself: seconds per worker, N of them contending for the cores (the default where
there is no fork, and a way out should a library misbehave in a forked worker).

Lifecycle of a ``ProcessSession``:

1. **Start**: start N workers (above); send each ``init`` (rank, device, the controller's
   ``sys.path``, plugins, and the address of a ``TCPStore`` the controller hosts, the
   rendezvous of a torch.distributed group the workers join: ``group_backend``); wait
   for every ``ready``. A worker that dies while starting stops the others.
2. **Work**: ``run`` (a session function on each worker with its own args; ``load_sharded``
   is one), ``call``, ``set_value``, ``get_value``. A session function a worker lacks is
   registered there by importing the module the controller registered it from. Every request
   is answered by every worker it went to; a failure becomes ``WorkerError`` once all answered
   (the others told to stop), a worker that dies becomes ``WorkerCrashedError`` and stops the
   rest. A watchdog (``timeout=``, by default ``DEFAULT_TIMEOUT_S``) watches each worker's
   progress messages (sent while a function runs and reports ``ctx.progress``: bytes done and
   what it is on); a worker silent
   for that long, hung or stopped (SIGSTOP), becomes ``WorkerError`` naming it and what it was
   on, and the session is closed.
3. **Close** (``close()``, leaving ``with``, Ctrl-C, a crash or a timeout, interpreter exit via
   ``weakref.finalize``): ask each worker to exit, then SIGTERM (and SIGCONT, so a stopped
   worker acts on it), then SIGKILL. Workers ignore SIGINT (the controller decides) and exit on
   their own within a second of the controller dying (a forked worker's fork server kills them
   at once, and exits).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

import torch

from ..envvars import env_choice
from ..errors import ShardloadError, WorkerCrashedError, WorkerError, WorkerFailure
from ..modules import import_modules, importable_module
from . import forkserver, protocol
from .base import (
    DEFAULT,
    DeviceSpec,
    Heartbeats,
    ProgressCallback,
    Session,
    WorkerArgs,
    args_for,
    check_timeout,
    resolve_devices,
    session_timeout,
)
from .functions import get_session_func

if TYPE_CHECKING:
    from torch.distributed import TCPStore

#: seconds a worker gets to exit after ``shutdown`` before it is terminated, then killed
GRACE_S = 3.0
#: seconds between the controller's checks for dead and stalled workers while it waits
POLL_S = 0.1

_DEFAULT: Any = DEFAULT
#: how workers start: ``ProcessSession(start_method=...)``, else this environment variable
START_ENV = "SHARDLOAD_WORKER_START"
START_METHODS = ("forkserver", "spawn")


def default_start_method() -> str:
    """``$SHARDLOAD_WORKER_START`` if set, else ``"forkserver"`` on Linux, else ``"spawn"``."""
    default = "forkserver" if sys.platform.startswith("linux") else "spawn"
    # then checked as an argument is: forkserver is for Linux only
    return _check_start_method(env_choice(START_ENV, default, START_METHODS), START_ENV)


def _check_start_method(method: Any, where: str = "start_method") -> str:
    if method not in START_METHODS:
        raise ValueError(
            f"{where}={method!r}: the ways to start workers are "
            f"{', '.join(map(repr, START_METHODS))}"
        )
    if method == "forkserver" and not sys.platform.startswith("linux"):
        raise ValueError(
            f"{where}='forkserver' is for Linux (fork, file descriptors passed "
            "over unix sockets, /proc); use 'spawn'"
        )
    return method


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _stop(
    procs: Sequence[Any], conns: Sequence[Connection], grace: Sequence[float] = (GRACE_S,)
) -> None:
    """Ask, then terminate, then kill. Safe to call twice, and at interpreter exit.

    ``grace[0]`` is how long workers get to exit when asked (a list, so the session can
    shorten it when a worker has died or the user pressed Ctrl-C: then nobody waits politely).
    """
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            protocol.send(conn, {"op": "shutdown"})
    deadline = time.monotonic() + grace[0]
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None and sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
                    if sig == signal.SIGTERM:  # a stopped worker acts on it only once resumed
                        proc.send_signal(signal.SIGCONT)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            break
        # after SIGTERM: a second, or half of one when nobody waits politely (Ctrl-C, a crash)
        deadline = time.monotonic() + min(1.0, max(0.5, grace[0]))
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.close()


#: open sessions, for the exit hook below
_LIVE: weakref.WeakSet[ProcessSession] = weakref.WeakSet()
_PID = os.getpid()


@atexit.register
def _at_exit() -> None:
    # Whatever order atexit runs hooks in: the sessions' workers first (asked to exit, as
    # close() does), then the fork server, which this process then reaps (an orphaned server
    # would wait on an init that may never reap it). Not in a fork of this process: the
    # sessions and the server are its parent's.
    if os.getpid() != _PID:
        return
    for session in list(_LIVE):
        session._finalizer()
    forkserver.shutdown()


def group_backend(devices: Sequence[torch.device]) -> str:
    """The torch.distributed backend of workers on ``devices``: NCCL where each has a GPU of its
    own; gloo otherwise, on the CPU and where workers share a GPU (more workers than GPUs, as
    on a one-GPU machine): NCCL refuses two ranks on one device at their first collective,
    while gloo's all_reduce, broadcast and barrier take CUDA tensors too.

    >>> group_backend([torch.device("cuda:0"), torch.device("cuda:1")])
    'nccl'
    >>> group_backend([torch.device("cuda:0"), torch.device("cuda:0")])
    'gloo'
    """
    own_gpus = all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)
    return "nccl" if own_gpus else "gloo"


class ProcessSession(Session):
    """N worker processes, worker i on ``devices[i]``, controlled over pipes.

    ``plugins`` are modules every worker imports (their ``@register_shard_func`` calls run
    there too). With ``distributed=True`` the workers form a torch.distributed process group
    (``group_backend``: NCCL where each worker has a GPU of its own, else gloo) that session
    functions can use for collectives.
    ``timeout``: seconds a worker may go without progress (a parameter loaded, a request
    answered) before the session gives up on it: ``WorkerError`` naming it and its parameter,
    and the session closed (its workers asked to exit, then terminated, then killed). Left
    out, the default watchdog (``DEFAULT_TIMEOUT_S``, 10 minutes, or ``$SHARDLOAD_TIMEOUT``);
    ``None``, no watchdog. ``start_timeout`` bounds starting the workers. ``start_method``:
    ``"forkserver"`` (fork each worker from an interpreter that has imported torch once: the
    default on Linux) or
    ``"spawn"`` (a fresh interpreter per worker); default ``$SHARDLOAD_WORKER_START``, see the
    module's docstring.

    >>> with ProcessSession(num_workers=2) as sess:                             # doctest: +SKIP
    ...     sharded = load_sharded("ckpt/", "ckpt/shard_info.json", sess)
    ...     sharded.shard("w", 1)          # a copy fetched from worker 1
    """

    def __init__(
        self,
        num_workers: int,
        device: DeviceSpec = "cpu",
        plugins: Iterable[str] = (),
        *,
        distributed: bool = True,
        start_timeout: float = 300.0,
        timeout: float | None = _DEFAULT,
        start_method: str | None = None,
    ):
        self.devices = resolve_devices(device, num_workers)
        self.num_workers = num_workers
        self.start_method = (
            default_start_method() if start_method is None else _check_start_method(start_method)
        )
        self.timeout = session_timeout(timeout)
        # subprocess.Popen (spawn) or forkserver.ForkedProcess: the same few methods
        self._procs: list[subprocess.Popen[bytes] | forkserver.ForkedProcess] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._store: TCPStore | None = None  # the workers' rendezvous, if distributed
        self._grace = [GRACE_S]
        self._known: set[str] = set()  # session functions the workers are known to have
        # The backstop: runs at garbage collection or interpreter exit if close() never did.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._grace)
        _LIVE.add(self)
        try:
            self._start(list(plugins), distributed, start_timeout)
        except BaseException:
            self.close()
            raise

    # ---- 1. start --------------------------------------------------------------------------------

    def _start(self, plugins: list[str], distributed: bool, timeout: float) -> None:
        # started first: it imports torch while this process does the rest
        server = forkserver.get_server() if self.start_method == "forkserver" else None
        import_modules(plugins)  # fail here, clearly, rather than in N workers
        dist = None
        if distributed:
            from torch.distributed import TCPStore

            backend = group_backend(self.devices)
            store = self._store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            dist = {
                "host": "127.0.0.1",
                "port": store.port,
                "backend": backend,
                "timeout_s": timeout,
            }
        # N workers share this machine's cores: each gets its share of OpenMP threads, or their
        # spinning teams starve one another (the profile showed ~45% of worker time in libgomp
        # busy-waits at N=4 on 2 cores). A value the user set is left alone.
        threads = str(max(1, (os.cpu_count() or 1) // self.num_workers))
        deadline = time.monotonic() + timeout
        for i in range(self.num_workers):
            parent, child = socket.socketpair()
            env = {
                "OMP_NUM_THREADS": threads,
                **os.environ,
                "SHARDLOAD_RANK": str(i),
                "SHARDLOAD_WORLD_SIZE": str(self.num_workers),
            }
            proc: subprocess.Popen[bytes] | forkserver.ForkedProcess
            try:
                if server is not None:
                    proc = server.fork(
                        child.fileno(),
                        env,
                        f"shardload-w{i}",
                        max(1.0, deadline - time.monotonic()),
                    )
                else:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "shardload.sessions.worker", str(child.fileno())],
                        pass_fds=(child.fileno(),),
                        env=env,
                        stdin=subprocess.DEVNULL,
                    )
            except BaseException:
                parent.close()
                raise
            finally:
                child.close()
            self._procs.append(proc)
            self._conns.append(Connection(parent.detach()))
        for i, conn in enumerate(self._conns):
            protocol.send(
                conn,
                {
                    "op": "init",
                    "rank": i,
                    "world_size": self.num_workers,
                    "device": str(self.devices[i]),
                    "plugins": plugins,
                    "sys_path": list(sys.path),
                    "dist": dist,
                },
            )
        self._gather(range(self.num_workers), "while starting", timeout=timeout, watchdog=None)

    # ---- 2. requests -----------------------------------------------------------------------------

    def _gather(
        self,
        workers: Iterable[int],
        context: str,
        *,
        timeout: float | None = None,
        on_progress=None,
        watchdog: float | None = _DEFAULT,
    ) -> dict[int, tuple[dict, torch.Tensor | None]]:
        """Every listed worker's reply. ``WorkerError`` for failures (after all replied),
        ``WorkerCrashedError`` (the session closed) when one dies. ``timeout`` bounds the
        whole request; ``watchdog`` (default: the session's ``timeout``) is how long one
        worker may go without a message before it is given up on (the session closed)."""
        workers = list(workers)
        watchdog = self.timeout if watchdog is _DEFAULT else watchdog
        pending = {self._conns[i]: i for i in workers}
        beats = Heartbeats(self.num_workers, workers)
        replies: dict[int, tuple[dict, torch.Tensor | None]] = {}
        failures: list[WorkerFailure] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while pending:
                # wait() hands back the objects it was given: connections
                ready = cast(list[Connection], wait(list(pending), timeout=POLL_S))
                for conn in ready:
                    i = pending[conn]
                    try:
                        message, tensor = protocol.recv(conn)
                    except (EOFError, OSError):
                        self._crashed(i, context)
                    except protocol.ProtocolError as exc:  # alive, but out of step with us
                        raise ShardloadError(
                            f"worker {i} sent a malformed reply {context}: "
                            f"{exc}; the session is closed"
                        ) from None
                    param = message.get("param")
                    beats.beat(i, param if isinstance(param, str) else None)
                    if "progress" in message:
                        if on_progress is not None:
                            on_progress(int(message["progress"]))
                        continue
                    del pending[conn]
                    beats.done(i)
                    if message.get("ok"):
                        replies[i] = (message, tensor)
                    elif not message.get("aborted"):
                        failures.append(
                            WorkerFailure(
                                i,
                                str(message.get("exc_type")),
                                str(message.get("message")),
                                str(message.get("traceback", "")),
                            )
                        )
                        self._abort_others(pending.values())
                for i in list(pending.values()):
                    if self._procs[i].poll() is not None:
                        self._crashed(i, context)
                if deadline is not None and time.monotonic() > deadline:
                    raise ShardloadError(
                        f"workers {sorted(pending.values())} did not answer "
                        f"{context} within {timeout:.0f} s"
                    )
                stalled = beats.stalled(watchdog)
                # hung or stopped: nothing but a signal will end it
                if stalled and watchdog is not None:
                    # failures already in come first: a worker that raised is often why
                    # another waits for ever (a collective)
                    raise WorkerError(
                        failures
                        + [
                            WorkerFailure(
                                i,
                                "TimeoutError",
                                f"{beats.describe(i, watchdog)}; the session is "
                                "closed and its workers stopped",
                            )
                            for i in stalled
                        ],
                        context,
                    )
        except BaseException:
            # a crash, a timeout or Ctrl-C: the workers' state is unknown, so stop them all now
            self._grace[0] = 0.2
            self.close()
            raise
        if failures:
            raise WorkerError(failures, context)
        return replies

    def _abort_others(self, workers: Iterable[int]) -> None:
        for i in workers:
            with contextlib.suppress(OSError):
                protocol.send(self._conns[i], {"op": "abort"})

    def _crashed(self, i: int, context: str):
        proc = self._procs[i]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        code = proc.poll()
        if not getattr(proc, "status_known", True):  # its fork server died before saying
            code = None
        raise WorkerCrashedError(i, exitcode=code, signal_name=_signal_name(code), context=context)

    def _request(
        self,
        workers: Iterable[int],
        message,
        context: str,
        tensor: torch.Tensor | None = None,
        **kwargs,
    ):
        """Send ``message`` (a dict, or ``message(i)`` giving worker i's) to each worker and
        gather the replies."""
        self._check_open()
        workers = list(workers)
        try:
            for i in workers:
                protocol.send(self._conns[i], message(i) if callable(message) else message, tensor)
        except OSError:
            # a worker that died before it was asked: as in _gather, the session is closed
            self._grace[0] = 0.2
            try:
                for i in workers:
                    if self._procs[i].poll() is not None:
                        self._crashed(i, context)
                raise
            finally:
                self.close()
        return self._gather(workers, context, **kwargs)

    def _ensure_function(self, name: str, func: Any) -> None:
        """Make the session function ``name`` exist in the workers, or say why it can't.

        A function registered in the controller from an importable module is registered in the
        workers by importing that same module (code this process already ran); one defined in
        ``__main__`` or inside a function cannot be, and is reported before any work starts.
        """
        if name in self._known:
            return
        replies = self._request(
            range(self.num_workers),
            {"op": "ensure", "name": name, "module": importable_module(func)},
            "while registering functions",
        )
        if any(message.get("missing") for message, _ in replies.values()):
            origin = getattr(func, "__module__", "?") + "." + getattr(func, "__qualname__", "?")
            raise ShardloadError(
                f"session function {name!r} ({origin}) is registered in this "
                "process only, so worker processes cannot run it: define it "
                "at module level in an importable module"
            )
        self._known.add(name)

    # ---- the Session API ------------------------------------------------------------------------

    def run(
        self,
        func_name: str,
        args: WorkerArgs,
        *,
        workers: Sequence[int] | None = None,
        context: str = "",
        timeout: float | None = _DEFAULT,
        on_progress: ProgressCallback | None = None,
    ) -> list[Any]:
        self._check_open()
        workers = self._workers(workers)
        self._ensure_function(func_name, get_session_func(func_name).func)
        # refused here, clearly, rather than deep in a send
        per = {i: protocol.to_jsonable(a) for i, a in args_for(args, workers).items()}
        watchdog = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        replies = self._request(
            workers,
            lambda i: {"op": "run", "func": func_name, "args": per[i]},
            context or f"in {func_name}",
            on_progress=on_progress,
            watchdog=watchdog,
        )
        return [_result(*replies[i]) for i in workers]

    def set_value(self, worker: int, name: str, value: Any) -> None:
        self._check_worker(worker)
        if isinstance(value, torch.Tensor):
            self._request(
                [worker], {"op": "set", "name": name}, f"while setting {name!r}", tensor=value
            )
        else:
            self._request(
                [worker],
                {"op": "set", "name": name, "value": protocol.to_jsonable(value)},
                f"while setting {name!r}",
            )

    def get_value(self, worker: int, name: str) -> Any:
        self._check_worker(worker)
        replies = self._request([worker], {"op": "get", "name": name}, f"while getting {name!r}")
        return _result(*replies[worker])

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [p.pid for p in self._procs]

    # ---- 3. close --------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()  # runs _stop once; later calls (and the atexit backstop) do nothing
        self._store = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pids={self.pids}"
        return f"ProcessSession(num_workers={self.num_workers}, {state})"


def _result(message: dict, tensor: torch.Tensor | None) -> Any:
    return tensor if tensor is not None else message.get("value")
