"""A fork server for ProcessSession workers: one interpreter that has imported torch and
shardload forks each worker, so N workers start in about the time of one.

Why: a worker started as a fresh interpreter spends nearly all its start-up importing torch
(``python -X importtime``: ~1.3 s of CPU, 2-5 s of wall on a busy machine), and N of them on a
few cores take N times that. Forked from a process that has done it once, a worker is ready in
milliseconds plus its own ``init`` (plugins, the process group).

The server is a child of the controller, started on first use and kept for the controller's
life (later sessions start in the time of a fork); one per controller process. It is never
forked from the controller: it is a fresh ``python -m shardload.sessions.forkserver FD``, so
nothing of the controller's state (threads, CUDA, locks) is inherited.

Wire (a ``SOCK_SEQPACKET`` unix socket pair; each packet one JSON object, file descriptors
passed with ``SCM_RIGHTS``; no pickle):

- controller -> server: ``{"op": "init", "sys_path"}`` (first; the server then preloads and
  says ``{"op": "ready", "pid"}``), ``{"op": "fork", "env", "cwd", "name"}`` with the worker's
  end of its socket pair and the controller's current stdout and stderr;
- server -> controller: ``{"op": "forked", "pid"}`` or ``{"op": "refused", "message"}``, and
  ``{"op": "exited", "pid", "returncode"}`` whenever a worker it forked ends (workers are the
  server's children, so only it can learn their exit status: negative for a signal, as
  ``subprocess`` reports it).

Lifetime, whatever ends first: the controller's socket closing (it exited, crashed, or was
killed) or the server being re-parented makes the server SIGKILL every worker it forked and
exit; the server dying in any other way leaves its workers re-parented, and a worker watches its
parent (``worker.py``), so they exit within a second. Workers and the server ignore SIGINT:
the controller decides what Ctrl-C means.

What is never done in the server before a fork: initialising CUDA (refused if it was), or
starting a thread (torch's thread pools start on first use, in the worker; OpenBLAS, loaded with
numpy, stops its threads at a fork by itself).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from ..errors import ShardloadError

#: the modules every worker needs, imported once in the server before any fork
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "shardload.sessions.worker",
    "shardload.sessions.protocol",
    "shardload.sessions.base",
    "shardload.sessions.groups",
    "shardload.sessions.functions",
)
#: imported too when they import cleanly (the loader's worker side): a module being edited or
#: broken must not stop workers from starting; a worker that needs it imports it and reports
OPTIONAL_PRELOAD = ("shardload.pieces.load",)
#: bytes of the largest packet; a fork request carries the controller's environment
MAX_PACKET = 1 << 20
#: bytes of the largest packet the server sends (a pid, an exit code, an error message)
REPLY_PACKET = 1 << 16
#: seconds between the server's checks that its controller is still its parent
WATCH_S = 0.5
MODULE = "shardload.sessions.forkserver"


class ForkServerError(ShardloadError):
    """The fork server could not start or fork a worker."""

    def __init__(self, message: str):
        super().__init__(
            f"{message}; SHARDLOAD_WORKER_START=spawn (or ProcessSession("
            "start_method='spawn')) starts workers as fresh interpreters instead"
        )


# ---- the wire ------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_PACKET:
        raise ForkServerError(
            f"a {message.get('op')!r} message of {len(data)} bytes is larger "
            f"than the fork server takes ({MAX_PACKET}); is the environment "
            "that large?"
        )
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def _recv(
    sock: socket.socket, *, block: bool = True, size: int = MAX_PACKET
) -> tuple[dict | None, list[int]]:
    """One packet of at most ``size`` bytes: ``(message, fds)``; ``(None, [])`` at EOF;
    ``BlockingIOError`` when not ``block`` and nothing is there."""
    fds = array.array("i")
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0) | (0 if block else socket.MSG_DONTWAIT)
    data, ancillary, msg_flags, _ = sock.recvmsg(size, socket.CMSG_LEN(16 * fds.itemsize), flags)
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    if msg_flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ForkServerError("a truncated packet from the fork server's peer")
    return json.loads(data), list(fds)


# ---- the controller's side -----------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by the server, with the parts of ``subprocess.Popen`` a session uses:
    ``pid``, ``poll()``, ``wait(timeout)``, ``send_signal(sig)``, ``returncode``.

    Its exit status comes from the server (its parent). ``status_known`` is False when the
    server died before telling it: the worker is then gone (re-parented workers exit on their
    own), but how it ended is not known."""

    def __init__(self, server: ForkServer, pid: int):
        self.server = server
        self.pid = pid
        self.returncode: int | None = None
        self.status_known = True

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect()
            code = self.server.exits.pop(self.pid, None)
            if code is not None:
                self.returncode = code
            elif self.server.dead and not _alive(self.pid):
                self.returncode, self.status_known = 1, False
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self.server.wait_readable(0.05 if left is None else min(0.05, left))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid the server has reaped (it may be reused)
            os.kill(self.pid, sig)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


class ForkServer:
    """The controller's handle on its fork server: start it, fork workers, learn their ends."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.lock = threading.RLock()
        self.exits: dict[int, int] = {}
        self.dead = False
        self.ready = False
        self.pid: int | None = None
        self.requests = 0  # fork requests sent; each reply names its request
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        # the server must import this very shardload, wherever the controller found it
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        # the server imports what the controller would: its import path, before any preload
        _send(self.sock, {"op": "init", "sys_path": [p for p in sys.path if isinstance(p, str)]})

    # -- messages

    def _died(self) -> None:
        self.dead = True
        # its socket closed as it exits: reap it (the exit completes within moments)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)

    def _take(self, *, block: bool) -> dict | None:
        """Take in one message (the caller holds the lock): an exit is recorded, the end of the
        socket marks the server dead; returns any other message, a reply for a caller, else
        None. ``BlockingIOError`` when not ``block`` and nothing is waiting."""
        try:
            message, fds = _recv(self.sock, block=block, size=REPLY_PACKET)
        except BlockingIOError:
            raise
        except OSError:
            message, fds = None, []
        for fd in fds:
            os.close(fd)
        if message is None:
            self._died()
            return None
        if message.get("op") == "exited":
            self.exits[int(message["pid"])] = int(message["returncode"])
            return None
        return message

    def collect(self) -> None:
        """Take in every message waiting (exits), without blocking."""
        if self.dead:
            return
        with self.lock:
            while not self.dead:
                try:
                    self._take(block=False)
                except BlockingIOError:
                    return

    def wait_readable(self, timeout: float) -> None:
        if self.dead:
            time.sleep(timeout)
            return
        with self.lock:  # another thread may take the message; the caller polls again
            select.select([self.sock], [], [], timeout)

    def _reply(self, timeout: float, what: str, request: int | None = None) -> dict:
        """The next message that is not an exit (nor the reply to an earlier ``request`` whose
        caller was interrupted: that worker's connection is closed, so it ends itself),
        within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.collect()
                self._died()
                raise ForkServerError(
                    f"the worker fork server exited with code {self.proc.returncode} {what}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ForkServerError(
                    f"the worker fork server did not answer {what} within {timeout:.0f} s"
                )
            ready, _, _ = select.select([self.sock], [], [], min(left, 0.1))
            if not ready:
                continue
            reply = self._take(block=True)  # at the server's end, the next turn reports it
            if reply is not None and reply.get("request") == request:
                return reply

    def wait_ready(self, timeout: float) -> None:
        with self.lock:
            if self.ready:
                return
            reply = self._reply(timeout, "while starting (importing torch and shardload)")
            if reply.get("op") != "ready":
                self.dead = True
                raise ForkServerError(
                    f"the worker fork server failed to start: {reply.get('message', reply)}"
                )
            self.pid = int(reply["pid"])
            self.ready = True

    def fork(self, conn_fd: int, env: dict[str, str], name: str, timeout: float) -> ForkedProcess:
        """A worker serving the connection on ``conn_fd``, with ``env`` and this process's cwd,
        stdout and stderr."""
        self.wait_ready(timeout)
        with self.lock:
            self.requests += 1
            _send(
                self.sock,
                {
                    "op": "fork",
                    "request": self.requests,
                    "env": env,
                    "cwd": os.getcwd(),
                    "name": name,
                },
                (conn_fd, *_stdio()),
            )
            reply = self._reply(timeout, "while forking a worker", self.requests)
            if reply.get("op") != "forked":
                raise ForkServerError(
                    f"the worker fork server refused to fork a worker: "
                    f"{reply.get('message', reply)}"
                )
            pid = int(reply["pid"])
            # an exit taken in before this reply was an earlier worker's that had this pid
            self.exits.pop(pid, None)
        return ForkedProcess(self, pid)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server: it kills the workers it forked and exits."""
        with self.lock:
            self.dead = True
            self.sock.close()
        if not self.ready:  # still importing torch (Ctrl-C at start): it has forked nothing
            self.proc.kill()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_NULL: list[int] = []


def _stdio() -> tuple[int, int]:
    """The controller's stdout and stderr as they are now (pytest, a redirect), or /dev/null in
    the place of one that is closed: a worker's go where a fresh interpreter's would."""
    fds = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            if not _NULL:  # opened once, kept for the process's life
                _NULL.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
            fds.append(_NULL[0])
    return fds[0], fds[1]


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def get_server() -> ForkServer:
    """This process's fork server, started (not waited for) if there is none or it died."""
    global _SERVER
    with _SERVER_LOCK:
        server = _SERVER
        if server is not None and (server.owner != os.getpid() or server.dead):
            if server.owner == os.getpid():
                server.close(0.5)
            server = None  # a forked copy of the controller gets a server of its own
        if server is None:
            server = _SERVER = ForkServer()
        return server


def prestart() -> None:
    """Start this process's fork server now, so that it imports torch while the caller does
    other work (the first ``ProcessSession`` then waits less). Returns at once."""
    get_server()


def shutdown() -> None:
    """Stop this process's fork server (it kills any worker it forked that still runs); the
    next ``ProcessSession`` starts another. For tests, and to free its memory."""
    global _SERVER
    with _SERVER_LOCK:
        server, _SERVER = _SERVER, None
    if server is not None and server.owner == os.getpid():
        server.close()


def server_pid() -> int | None:
    """The pid of this process's fork server once it is ready, else None."""
    server = _SERVER
    return server.pid if server is not None and not server.dead else None


# ---- the server ----------------------------------------------------------------------------------


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    for module in OPTIONAL_PRELOAD:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - the worker imports it when needed, and reports
            pass


def _serve(sock: socket.socket) -> None:
    parent = os.getppid()
    # EOF here means the controller is gone: before the preload, so a controller that dies
    # while the server imports torch does not leave it behind either
    message, _ = _recv(sock)
    if message is None:
        return
    sys.path[:] = list(message.get("sys_path", [])) + [
        p for p in sys.path if p not in message.get("sys_path", [])
    ]
    try:
        _preload()
    except BaseException as exc:
        _send(sock, {"op": "failed", "message": f"{type(exc).__name__}: {exc}"[:4000]})
        raise
    import gc

    # objects the preload made are never collected in a worker: their pages stay shared
    gc.freeze()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through wake_w
    children: set[int] = set()
    sock_fd = sock.fileno()  # select by descriptors: one type of thing to watch
    _send(sock, {"op": "ready", "pid": os.getpid()})
    try:
        while os.getppid() == parent:
            ready, _, _ = select.select([sock_fd, wake_r], [], [], WATCH_S)
            if wake_r in ready:
                with contextlib.suppress(OSError):
                    while os.read(wake_r, 512):
                        pass
            _reap(sock, children)
            if sock_fd in ready:
                message, fds = _recv(sock)
                if message is None:
                    return  # the controller closed its end, or died
                if message.get("op") == "fork":
                    _fork(sock, message, fds, children, (wake_r, wake_w))
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
    finally:
        # nobody is left to drive the workers: end them now rather than in WATCH_S
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(OSError):
                os.waitpid(pid, 0)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        with contextlib.suppress(OSError):
            _send(
                sock, {"op": "exited", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)}
            )


def _fork(
    sock: socket.socket, message: dict, fds: list[int], children: set[int], wake: tuple[int, int]
) -> None:
    import torch

    request = message.get("request")
    refusal = None
    if len(fds) != 3:
        refusal = f"{len(fds)} file descriptors, not 3"
    # a fork after these would hand the worker a broken CUDA context, or a lock a thread held
    elif torch.cuda.is_initialized():
        refusal = "CUDA was initialised in the fork server"
    elif threading.active_count() != 1:
        refusal = "the fork server has started a thread"
    if refusal is not None:
        _send(sock, {"op": "refused", "request": request, "message": refusal})
        return
    pid = os.fork()
    if pid == 0:
        _child(sock, message, fds, wake)  # never returns
    children.add(pid)
    _send(sock, {"op": "forked", "request": request, "pid": pid})


def _child(sock: socket.socket, message: dict, fds: list[int], wake: tuple[int, int]) -> None:
    code = 1
    try:
        conn_fd, out_fd, err_fd = fds
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        for fd in (null, out_fd, err_fd):
            if fd > 2:
                os.close(fd)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        _name(str(message.get("name", "")))
        _reseed()
        _threads()
        from . import worker

        worker.serve_fd(conn_fd)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a worker's last words, then its exit code says it
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        # Not the server's atexit handlers, nor its interpreter's teardown (seconds with torch):
        # what a worker leaves behind is its pieces, and those go with the process
        os._exit(code)


def _name(name: str) -> None:
    """``ps``/``top`` show the worker's name, not the server's (Linux; best effort)."""
    if name:
        with contextlib.suppress(OSError):
            with open("/proc/self/comm", "w") as f:
                f.write(name[:15])


def _reseed() -> None:
    # Every worker would otherwise share the server's numpy random state (a fresh interpreter
    # seeds its own; ``random`` reseeds itself at a fork)
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            np.random.seed()


def _threads() -> None:
    # OMP_NUM_THREADS is read when libgomp loads, which was in the server: apply the worker's
    import torch

    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))


def main(argv: list[str]) -> None:
    if len(argv) != 2 or not argv[1].isdigit():
        sys.exit(f"usage: python -m {MODULE} FD  (started by ProcessSession)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides what Ctrl-C means
    sock = socket.socket(fileno=int(argv[1]))
    code = 1
    try:
        _serve(sock)
        code = 0
    except BaseException:  # noqa: BLE001 - the controller was told; this is for its stderr
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)  # skip torch's teardown: nothing here needs it


__all__ = [
    "ForkServer",
    "ForkServerError",
    "ForkedProcess",
    "get_server",
    "prestart",
    "server_pid",
    "shutdown",
]


if __name__ == "__main__":
    main(sys.argv)
