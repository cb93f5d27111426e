"""A ProcessSession worker: forked by the fork server (``forkserver.py``, the default), or a
fresh interpreter, ``python -m shardload.sessions.worker FD``.

It serves requests from its controller over the connection on file descriptor FD, one at a
time, until ``shutdown`` or until the controller goes away: the connection closing, or this
process being re-parented (its parent, the controller or the fork server, gone), ends it within
a second.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import WorkerContext

# The controller decides what a Ctrl-C means; a terminal's SIGINT reaches the whole process
# group, and N workers must not each print a KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

#: seconds between progress messages (bytes done, what the worker is on), while any changed
PROGRESS_S = 0.2


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)  # the controller is gone; nobody will ever ask for our shards


class Worker:
    """The worker's state and request handlers (``op`` -> ``_op_<op>``)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._ctx: WorkerContext | None = None
        self.dist = False
        self.exit_requested = False

    @property
    def ctx(self) -> WorkerContext:
        """The worker's context, from the controller's ``init`` (its first request)."""
        if self._ctx is None:
            raise ValueError("a request before the worker was initialised (no 'init' yet)")
        return self._ctx

    def serve(self) -> None:
        from . import protocol

        while not self.exit_requested:
            try:
                message, tensor = protocol.recv(self.conn)
            except (EOFError, OSError):
                return  # the controller closed the connection
            except protocol.ProtocolError as exc:
                protocol.send(
                    self.conn,
                    {
                        "ok": False,
                        "exc_type": "ProtocolError",
                        "message": str(exc),
                        "traceback": "",
                    },
                )
                continue
            op = message.get("op")
            if op == "abort":
                continue  # arrived after the run it meant to stop had finished
            try:
                handler = getattr(self, f"_op_{op}", None)
                if handler is None:
                    raise ValueError(f"unknown request {op!r}")
                reply, out = handler(message, tensor)
                protocol.send(self.conn, {"ok": True, **reply}, out)
            except _Aborted:
                protocol.send(self.conn, {"ok": False, "aborted": True})
            except BaseException as exc:  # noqa: BLE001 - the controller reports it
                from ..errors import describe

                protocol.send(
                    self.conn,
                    {
                        "ok": False,
                        "exc_type": type(exc).__name__,
                        "message": describe(exc),
                        "traceback": traceback.format_exc(),
                    },
                )
            if op == "shutdown":
                return
        # a shutdown that arrived during a run ends the worker once the run has stopped

    # ---- requests -------------------------------------------------------------------------------

    def _op_init(self, message: dict, _) -> tuple[dict, None]:
        # The controller's import path, so its plugins import here as they did there.
        sys.path[:0] = [p for p in message["sys_path"] if p not in sys.path]
        import torch

        from ..modules import import_modules
        from .base import WorkerContext
        from .groups import DistGroup, NoGroup

        device = torch.device(message["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ctx = self._ctx = WorkerContext(message["rank"], message["world_size"], device)
        import_modules(message["plugins"])
        dist = message.get("dist")
        if dist:
            import datetime

            import torch.distributed as td

            timeout = datetime.timedelta(seconds=float(dist["timeout_s"]))
            store = td.TCPStore(dist["host"], int(dist["port"]), None, False, timeout=timeout)
            td.init_process_group(
                dist["backend"],
                store=store,
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=timeout,
            )
            self.dist = True
            ctx.group = DistGroup(ctx.rank, ctx.world_size)
        else:
            ctx.group = NoGroup(
                ctx.rank,
                ctx.world_size,
                "its ProcessSession was opened with distributed=False",
            )
        return {"pid": os.getpid()}, None

    def _op_ensure(self, message: dict, _) -> tuple[dict, None]:
        """Register the session function ``name`` by importing the module the controller
        registered it from (code it already ran), unless it is known here already."""
        import importlib

        from .functions import get_session_func

        name, module = message["name"], message.get("module")
        try:
            get_session_func(name)
            return {"missing": False}, None
        except KeyError:
            pass
        if module:
            importlib.import_module(module)
        try:
            get_session_func(name)
        except KeyError:
            return {"missing": True}, None
        return {"missing": False}, None

    def _op_run(self, message: dict, _) -> tuple[dict, Any]:
        """Run a session function with this worker's args, reporting its progress and passing
        on the controller's request to stop."""
        from .base import Stopped
        from .functions import get_session_func

        func = get_session_func(message["func"]).func
        poll = _AbortPoll(self.conn)
        with _Progress(self.conn) as progress:
            with self.ctx.hooks(progress.report, poll.is_set):
                try:
                    result = func(self.ctx, *message.get("args", []))
                except Stopped:
                    if not poll.set:
                        raise
                    self.exit_requested = poll.shutdown
                    raise _Aborted() from None
        return _as_reply(result)

    def _op_get(self, message: dict, _) -> tuple[dict, Any]:
        return _as_reply(self.ctx.values[message["name"]])

    def _op_set(self, message: dict, tensor) -> tuple[dict, None]:
        if tensor is not None:
            tensor = tensor.to(self.ctx.device)
        self.ctx.values[message["name"]] = tensor if tensor is not None else message.get("value")
        return {}, None

    def _op_shutdown(self, message: dict, _) -> tuple[dict, None]:
        if self.dist:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()
        return {}, None


class _Aborted(Exception):
    """The controller asked this worker to stop (another worker failed)."""


class _AbortPoll:
    """``is_set()`` is True once the controller has sent ``abort`` or ``shutdown``; what a
    running function's ``ctx.should_stop()`` asks. Nothing else can arrive during a run: the
    controller waits for it."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.set = False
        self.shutdown = False

    def is_set(self) -> bool:
        from . import protocol

        while not self.set and self.conn.poll(0):
            message, _ = protocol.recv(self.conn)
            self.shutdown = message.get("op") == "shutdown"
            self.set = message.get("op") in ("abort", "shutdown")
        return self.set


class _Progress:
    """What the controller's progress bar and watchdog see of a run: bytes done and what the
    worker is on (``ctx.progress``), sent as ``{"progress": nbytes, "param": where}``.

    A ticker thread sends them every PROGRESS_S, and only when they changed: a worker stuck
    inside one parameter has still said which one (the ticker runs while the main thread is
    stuck), and then falls silent, which is what the watchdog waits for. The last message is
    sent before the reply, from the main thread, once the ticker has stopped.
    """

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()
        self.pending = 0
        self.current: str | None = None
        self.changed = False
        self.stopped = threading.Event()
        self.ticker = threading.Thread(target=self._tick, name="shardload-progress", daemon=True)

    def __enter__(self) -> _Progress:
        self.ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.ticker.join()
        if exc[0] is None:
            self.flush()

    def report(self, nbytes: int = 0, where: str | None = None) -> None:
        """``ctx.progress``: ``nbytes`` more done, now on ``where``; the next tick tells the
        controller's watchdog this worker is alive."""
        with self.lock:
            self.pending += nbytes
            if where is not None:
                self.current = where
            self.changed = True

    def _tick(self) -> None:
        while not self.stopped.wait(PROGRESS_S):
            try:
                self.flush()
            except OSError:
                return  # the controller is gone; the main thread finds out on its own

    def flush(self) -> None:
        from . import protocol

        with self.lock:
            if not self.changed:
                return
            message = {"progress": self.pending, "param": self.current}
            self.pending, self.changed = 0, False
        protocol.send(self.conn, message)


def _as_reply(value: Any) -> tuple[dict, Any | None]:
    import torch

    if isinstance(value, torch.Tensor):
        return {}, value
    from . import protocol

    return {"value": protocol.to_jsonable(value)}, None


def serve_fd(fd: int) -> None:
    """Serve the controller on the connection at ``fd`` until it is done with this worker:
    a fresh interpreter's ``main``, and a worker forked by the fork server (``forkserver.py``),
    whose parent is the server."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    Worker(Connection(fd)).serve()


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m shardload.sessions.worker FD  (started by ProcessSession)")
    serve_fd(int(argv[1]))


if __name__ == "__main__":
    main(sys.argv)
