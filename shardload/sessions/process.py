"""Workers as separate processes: the TVM Disco model.

The controller starts N workers from ``sys.executable`` (``python -m shardload.sessions.worker``),
each with one end of a socket pair, and drives them with JSON messages (tensors travel as raw
bytes; see ``protocol.py``). Shards stay in the workers: the controller holds handles and
fetches copies on request.

Lifecycle of a ``ProcessSession``:

1. **Start**: spawn N workers; send each ``init`` (rank, device, the controller's ``sys.path``,
   plugins, and the address of a ``TCPStore`` the controller hosts, the rendezvous of a
   torch.distributed group the workers join: gloo on CPU, NCCL on CUDA); wait for every
   ``ready``. A worker that dies while starting stops the others.
2. **Work**: ``load_sharded``, ``call``, ``set_value``, ``get_value``, ``fetch``. Every request
   is answered by every worker it went to; a failure becomes ``WorkerError`` once all answered
   (the others told to stop loading), a worker that dies becomes ``WorkerCrashedError`` and
   stops the rest. With ``timeout=`` a watchdog watches each worker's progress messages (sent
   while loading: bytes kept and the parameter it is on); a worker silent for that long, hung
   or stopped (SIGSTOP), becomes ``WorkerError`` naming it and its parameter, and the session
   is closed.
3. **Close** (``close()``, leaving ``with``, Ctrl-C, a crash or a timeout, interpreter exit via
   ``weakref.finalize``): ask each worker to exit, then SIGTERM (and SIGCONT, so a stopped
   worker acts on it), then SIGKILL. Workers ignore SIGINT (the controller decides) and exit on
   their own within a second of the controller dying.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Iterable, Optional, Sequence

import torch

from ..errors import (PlanError, ShardloadError, WorkerCrashedError, WorkerError,
                      WorkerFailure)
from . import protocol
from .base import DeviceSpec, Heartbeats, Session, check_timeout, resolve_devices

#: seconds a worker gets to exit after ``shutdown`` before it is terminated, then killed
GRACE_S = 3.0
#: seconds between the controller's checks for dead and stalled workers while it waits
POLL_S = 0.1

_DEFAULT: Any = object()


def _signal_name(returncode: Optional[int]) -> Optional[str]:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _stop(procs: Sequence[subprocess.Popen], conns: Sequence[Connection],
          grace: Sequence[float] = (GRACE_S,)) -> None:
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


class ProcessSession(Session):
    """N worker processes, worker i on ``devices[i]``, controlled over pipes.

    ``plugins`` are modules every worker imports (their ``@register_shard_func`` calls run
    there too). With ``distributed=True`` the workers form a torch.distributed process group
    (gloo on CPU, NCCL on CUDA) that session functions can use for collectives.
    ``timeout``: seconds a worker may go without progress (a parameter loaded, a request
    answered) before the session gives up on it: ``WorkerError`` naming it and its parameter,
    and the session closed (its workers asked to exit, then terminated, then killed).
    ``start_timeout`` bounds starting the workers.

    >>> with ProcessSession(num_workers=2) as sess:                             # doctest: +SKIP
    ...     sharded = load_sharded("ckpt/", "ckpt/shard_info.json", sess)
    ...     sharded.shard("w", 1)          # a copy fetched from worker 1
    """

    def __init__(self, num_workers: int, device: DeviceSpec = "cpu",
                 plugins: Iterable[str] = (), *, distributed: bool = True,
                 start_timeout: float = 300.0, timeout: Optional[float] = None):
        self.devices = resolve_devices(device, num_workers)
        self.num_workers = num_workers
        self.timeout = check_timeout(timeout)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._store = None
        self._next_load = 0
        self._released: list[int] = []  # loads whose results were garbage-collected
        self._grace = [GRACE_S]
        # The backstop: runs at garbage collection or interpreter exit if close() never did.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._grace)
        try:
            self._start(list(plugins), distributed, start_timeout)
        except BaseException:
            self.close()
            raise

    # ---- 1. start --------------------------------------------------------------------------------

    def _start(self, plugins: list[str], distributed: bool, timeout: float) -> None:
        from ..registry import load_plugins

        load_plugins(plugins)  # fail here, clearly, rather than in N workers
        dist = None
        if distributed:
            from torch.distributed import TCPStore

            backend = "nccl" if all(d.type == "cuda" for d in self.devices) else "gloo"
            self._store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            dist = {"host": "127.0.0.1", "port": self._store.port, "backend": backend,
                    "timeout_s": timeout}
        # N workers share this machine's cores: each gets its share of OpenMP threads, or their
        # spinning teams starve one another (the profile showed ~45% of worker time in libgomp
        # busy-waits at N=4 on 2 cores). A value the user set is left alone.
        threads = str(max(1, (os.cpu_count() or 1) // self.num_workers))
        for i in range(self.num_workers):
            parent, child = socket.socketpair()
            env = {"OMP_NUM_THREADS": threads, **os.environ, "SHARDLOAD_RANK": str(i),
                   "SHARDLOAD_WORLD_SIZE": str(self.num_workers)}
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "shardload.sessions.worker", str(child.fileno())],
                    pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
            finally:
                child.close()
            self._procs.append(proc)
            self._conns.append(Connection(parent.detach()))
        for i, conn in enumerate(self._conns):
            protocol.send(conn, {"op": "init", "rank": i, "world_size": self.num_workers,
                                 "device": str(self.devices[i]), "plugins": plugins,
                                 "sys_path": list(sys.path), "dist": dist})
        self._gather(range(self.num_workers), "while starting", timeout=timeout,
                     watchdog=None)

    # ---- 2. requests -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this session is closed")

    def _gather(self, workers: Iterable[int], context: str, *, timeout: Optional[float] = None,
                on_progress=None, watchdog: Optional[float] = _DEFAULT
                ) -> dict[int, tuple[dict, Optional[torch.Tensor]]]:
        """Every listed worker's reply. ``WorkerError`` for failures (after all replied),
        ``WorkerCrashedError`` (the session closed) when one dies. ``timeout`` bounds the
        whole request; ``watchdog`` (default: the session's ``timeout``) is how long one
        worker may go without a message before it is given up on (the session closed)."""
        workers = list(workers)
        watchdog = self.timeout if watchdog is _DEFAULT else watchdog
        pending = {self._conns[i]: i for i in workers}
        beats = Heartbeats(self.num_workers, workers)
        replies: dict[int, tuple[dict, Optional[torch.Tensor]]] = {}
        failures: list[WorkerFailure] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while pending:
                ready = wait(list(pending), timeout=POLL_S)
                for conn in ready:
                    i = pending[conn]
                    try:
                        message, tensor = protocol.recv(conn)
                    except (EOFError, OSError):
                        self._crashed(i, context)
                    except protocol.ProtocolError as exc:  # alive, but out of step with us
                        raise ShardloadError(f"worker {i} sent a malformed reply {context}: "
                                             f"{exc}; the session is closed") from None
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
                        failures.append(WorkerFailure(i, str(message.get("exc_type")),
                                                      str(message.get("message")),
                                                      str(message.get("traceback", ""))))
                        self._abort_others(pending.values())
                for i in list(pending.values()):
                    if self._procs[i].poll() is not None:
                        self._crashed(i, context)
                if deadline is not None and time.monotonic() > deadline:
                    raise ShardloadError(f"workers {sorted(pending.values())} did not answer "
                                         f"{context} within {timeout:.0f} s")
                stalled = beats.stalled(watchdog)
                if stalled:  # hung or stopped: nothing but a signal will end it
                    # failures already in come first: a worker that raised is often why
                    # another waits for ever (a collective)
                    raise WorkerError(failures + [WorkerFailure(
                        i, "TimeoutError", f"{beats.describe(i, watchdog)}; the session is "
                        "closed and its workers stopped") for i in stalled], context)
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
        raise WorkerCrashedError(i, exitcode=code, signal_name=_signal_name(code),
                                 context=context)

    def _request(self, workers: Iterable[int], message: dict, context: str,
                 tensor: Optional[torch.Tensor] = None, **kwargs):
        self._check_open()
        workers = list(workers)
        try:
            if self._released:
                # sent here, between requests, never from the finalizer: a message sent during
                # garbage collection could land between the frames of another
                released, self._released[:] = list(self._released), []
                for conn in self._conns:
                    protocol.send(conn, {"op": "release", "loads": released})
            for i in workers:
                protocol.send(self._conns[i], message, tensor)
        except OSError:
            for i in workers:
                if self._procs[i].poll() is not None:
                    self._crashed(i, context)
            raise
        return self._gather(workers, context, **kwargs)

    def _ensure_functions(self, shard_funcs: dict[str, Any], session_funcs: dict[str, Any],
                          where: dict[str, dict]) -> None:
        """Make the functions a request needs exist in the workers, or say why they can't.

        A function registered in the controller from an importable module is registered in the
        workers by importing that same module (code this process already ran); one defined in
        ``__main__`` or inside a function cannot be, and is reported before any work starts.
        """
        from ..registry import importable_module

        specs = {"shard": {n: importable_module(f) for n, f in shard_funcs.items()},
                 "session": {n: importable_module(f) for n, f in session_funcs.items()}}
        replies = self._request(range(self.num_workers), {"op": "ensure", **specs},
                                "while registering functions")
        missing = sorted({name for message, _ in replies.values()
                          for name in message.get("missing", [])})
        if missing:
            name = missing[0]
            func = shard_funcs.get(name) or session_funcs.get(name)
            origin = getattr(func, "__module__", "?") + "." + getattr(func, "__qualname__", "?")
            message = (f"function {name!r} ({origin}) is registered in this process only, so "
                       "worker processes cannot run it: define it at module level in an "
                       "importable module and pass that module as a plugin "
                       "(plugins=[...], --plugin MODULE)")
            raise PlanError(message, **where.get(name, {}))

    # ---- the Session API ------------------------------------------------------------------------

    def _load(self, ckpt, validated, progress, timeout=None):
        from ..loader import ShardedParams, WorkerLoad, progress_callback, stats_of

        # custom shard functions must exist in the workers before they validate the plan
        custom, where = {}, {}
        for param in validated:
            for step, func in zip(param.steps, param.funcs):
                if not func.name.startswith("shardload."):
                    custom[func.name] = func.func
                    where.setdefault(func.name, {"source": validated.plan.source,
                                                 "param": param.name, "step": step.index})
        if custom:
            self._ensure_functions(custom, {}, where)
        plan = validated.plan.to_dict()
        try:
            protocol.to_jsonable(plan)  # refused here, clearly, rather than deep in a send
        except (TypeError, ValueError) as exc:
            raise PlanError(f"the plan cannot be sent to worker processes: {exc}",
                            source=validated.plan.source) from None
        watchdog = self.timeout if timeout is None else check_timeout(timeout)
        load_id, self._next_load = self._next_load, self._next_load + 1
        with _checkpoint_path(ckpt) as path:
            advance, close_bar = progress_callback(progress,
                                                   validated.bytes_per_worker() * self.num_workers)
            start = time.perf_counter()
            try:
                replies = self._request(
                    range(self.num_workers),
                    {"op": "load", "load": load_id, "checkpoint": path,
                     "plan": plan, "num_shards": self.num_workers},
                    f"while loading {ckpt.source}", on_progress=advance, watchdog=watchdog)
            finally:
                close_bar()
            seconds = time.perf_counter() - start
        loads = []
        for i in range(self.num_workers):
            message = replies[i][0]
            load = WorkerLoad({}, int(message["bytes_read"]), float(message["seconds"]))
            loads.append((load, int(message["bytes"]), int(message["tensors"])))
        stats = stats_of([w for w, _, _ in loads], seconds)
        stats.bytes_per_worker = [b for _, b, _ in loads]
        stats.tensors_per_worker = [t for _, _, t in loads]
        names = [p.name for p in validated]
        result = ShardedParams(names, list(self.devices), stats, validated,
                               lambda name, i: self._fetch_shard(load_id, i, name))
        # the workers keep this load's shards for as long as its result is referenced
        weakref.finalize(result, self._released.append, load_id)
        return result

    def _fetch_shard(self, load_id: int, worker: int, name: str) -> torch.Tensor:
        """A CPU copy of worker ``worker``'s shard ``name`` from load ``load_id``."""
        self._check_worker(worker)
        replies = self._request([worker], {"op": "fetch", "kind": "shard", "load": load_id,
                                           "name": name}, f"while fetching {name!r}")
        return replies[worker][1]

    def call(self, func_name: str, *args: Any) -> list[Any]:
        from ..registry import get_session_func

        func = get_session_func(func_name)
        self._ensure_functions({}, {func_name: func.func}, {})
        replies = self._request(range(self.num_workers),
                                {"op": "call", "func": func_name,
                                 "args": protocol.to_jsonable(list(args))}, f"in {func_name}")
        return [_result(*replies[i]) for i in range(self.num_workers)]

    def set_value(self, worker: int, name: str, value: Any) -> None:
        self._check_worker(worker)
        if isinstance(value, torch.Tensor):
            self._request([worker], {"op": "set", "name": name}, f"while setting {name!r}",
                          tensor=value)
        else:
            self._request([worker], {"op": "set", "name": name,
                                     "value": protocol.to_jsonable(value)},
                          f"while setting {name!r}")

    def get_value(self, worker: int, name: str) -> Any:
        self._check_worker(worker)
        replies = self._request([worker], {"op": "fetch", "kind": "value", "name": name},
                                f"while getting {name!r}")
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


def _result(message: dict, tensor: Optional[torch.Tensor]) -> Any:
    return tensor if tensor is not None else message.get("value")


@contextlib.contextmanager
def _checkpoint_path(ckpt):
    """A path the workers can open: the checkpoint's own, or a temporary safetensors file
    holding an in-memory checkpoint (removed afterwards)."""
    path = getattr(ckpt, "path", None)
    if path is not None:
        yield path
        return
    from safetensors.torch import save_file

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None  # RAM, where there is one
    folder = tempfile.mkdtemp(prefix="shardload-", dir=base)
    try:
        file = os.path.join(folder, "params.safetensors")
        save_file({name: ckpt.read(name) for name in ckpt.names()}, file)
        yield file
    finally:
        shutil.rmtree(folder, ignore_errors=True)
