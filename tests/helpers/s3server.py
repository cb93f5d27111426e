"""A real S3 server on loopback for the tests: moto's server, behind a small proxy of our own.

``S3Server`` starts ``moto.server.ThreadedMotoServer`` on 127.0.0.1 and, in front of it, a
threaded HTTP/1.1 proxy (standard library only) that forwards every request to moto and

1. **counts** the response body bytes it sends to clients: per object key and in total, for
   successful (2xx) answers to requests that name an object (``bytes_sent``), and logs every
   request it answered (``requests``): the server-side count tests compare with what the
   client kept;
2. **injects faults** by rule (``inject``): an S3 error answer with a proper XML body (503
   ``SlowDown``, 500 ``InternalError``, 403 ``AccessDenied``, anything), a connection dropped
   after M bytes of a body, a delay.

The shardload client under test talks to the proxy (``endpoint``, and ``AWS_ENDPOINT_URL`` in
``aws_env()``); ``client()`` is a botocore client straight to moto, for setting up buckets and
objects without touching the counts. ``close()`` (or leaving the ``with`` block) stops the
proxy's threads, every one, and moto.

Fixtures wrap ``s3_server`` (a generator)::

    @pytest.fixture(scope="session")
    def s3():
        yield from s3server.s3_server()

and point botocore at it with ``use_env(monkeypatch, s3.aws_env())``; a subprocess gets
``s3.env()``.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator, Optional
from urllib.parse import unquote, urlsplit
from xml.sax.saxutils import escape

import pytest

__all__ = ["S3Server", "Fault", "s3_server", "use_env", "ACCESS_KEY_ID", "SECRET_ACCESS_KEY",
           "REGION", "NO_SUCH_FILE"]

#: the dummy credentials the tests sign with: no message may ever repeat them
ACCESS_KEY_ID = "AKIASHARDLOADTEST7Q2X"
SECRET_ACCESS_KEY = "sHaRdLoAdTeStSeCrEt/9f8e7d6c5b4a3+ZYXWVUTSRQ"
REGION = "us-east-1"
#: where the AWS config and credentials files are said to be: nowhere
NO_SUCH_FILE = "/nonexistent/shardload-tests/aws"
#: a body is written in parts of this size, and counted as far as the client took it
SEND_PART = 1 << 20

#: response headers a proxy does not pass on (hop-by-hop, or set by the proxy itself)
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding",
                         "te", "trailer", "upgrade", "content-length"})
_DEFAULT_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "AccessDenied": "Access Denied",
    "ServiceUnavailable": "Service is unable to handle request.",
}


@dataclass
class Fault:
    """One fault rule: what to do, to which requests, how many more times.

    ``kind``: ``"error"`` (answer ``status`` with an S3 XML error ``code`` and ``message``, plus
    the raw XML ``extra`` inside ``<Error>``), ``"drop"`` (forward, then send only
    ``after_bytes`` bytes of the body and close the connection), ``"delay"`` (forward after
    ``seconds``; any rule may also delay by ``seconds`` first). ``method`` (None: any) and
    ``key`` (None: any object key; listings and bucket requests match only ``key=""``) select
    the requests; ``times`` is how many it hits (None: every one). ``hits`` counts the hits."""

    kind: str
    times: Optional[int] = 1
    method: Optional[str] = "GET"
    key: Optional[str] = None
    status: int = 500
    code: str = "InternalError"
    message: Optional[str] = None
    extra: str = ""
    after_bytes: int = 0
    seconds: float = 0.0
    hits: int = 0

    def matches(self, method: str, key: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method is not None and self.method != method:
            return False
        return bool(key) if self.key is None else self.key == key


@dataclass
class Request:
    """A request the proxy answered."""

    method: str
    bucket: str
    key: str
    range: Optional[str]
    status: int = 0
    sent: int = 0
    fault: Optional[str] = None
    query: str = field(default="", repr=False)
    #: ``reset_counts`` calls before the request arrived: a request still being answered when
    #: the counts are reset (a delayed one a client gave up on) is not counted after it
    generation: int = field(default=0, repr=False)


class _Proxy(ThreadingHTTPServer):
    daemon_threads = False  # joined by server_close: no thread outlives close()
    block_on_close = True
    allow_reuse_address = True
    # a real server's listen backlog: socketserver's default of 5 drops the connections of a
    # burst (N workers x their concurrent GETs), which clients see as a second's SYN retry
    request_queue_size = 128

    def __init__(self, owner: "S3Server"):
        self.owner = owner
        self.open_connections: set = set()
        self.conn_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

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

    server: _Proxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._answer()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _read_body(self) -> Optional[bytes]:
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
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        entry = Request(self.command, bucket, key, self.headers.get("Range"),
                        query=parts.query, generation=owner._generation)
        fault = owner._match(self.command, key)
        entry.fault = fault.kind if fault else None
        if fault is not None and fault.seconds:
            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "error":
            entry.status = fault.status
            owner._record(entry)  # before the answer, as _forward does
            self._error(fault, entry)
        else:
            self._forward(body, entry, fault)  # records the request before sending its body

    def _error(self, fault: Fault, entry: Request) -> None:
        message = fault.message if fault.message is not None else \
            _DEFAULT_MESSAGES.get(fault.code, "Injected by the test proxy.")
        xml = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
               f"{escape(fault.code)}</Code><Message>{escape(message)}</Message><Resource>"
               f"{escape(urlsplit(self.path).path)}</Resource><RequestId>SHARDLOADTESTPROXY"
               f"</RequestId>{fault.extra}</Error>").encode()
        self.send_response_only(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(xml)))
        self.send_header("x-amz-request-id", "SHARDLOADTESTPROXY")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)
        entry.status = fault.status

    def _forward(self, body: Optional[bytes], entry: Request, fault: Optional[Fault]) -> None:
        owner = self.server.owner
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in _HOP_BY_HOP and k.lower() != "expect"}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(owner.moto_host, owner.moto_port, timeout=30)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, resp_headers = resp.status, resp.getheaders()
        finally:
            conn.close()
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
        self.end_headers()
        entry.status = status
        out = b"" if self.command == "HEAD" else data[:fault.after_bytes] if drop else data
        # counted before it is sent: a client that has read the body may ask for the count at
        # once, before this thread would get to record it
        entry.sent = len(out)
        owner._record(entry)
        if self.command == "HEAD":
            return
        written = 0
        try:
            # in parts, so that a client that goes away mid-body is counted as far as it got
            view = memoryview(out)
            while written < len(out):
                self.wfile.write(view[written:written + SEND_PART])
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


class S3Server:
    """moto's S3 server on 127.0.0.1 behind a counting, fault-injecting proxy. A context
    manager; ``start()``/``close()`` otherwise."""

    def __init__(self) -> None:
        self._moto: Any = None
        self._proxy: Optional[_Proxy] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[Request] = []
        self._generation = 0
        self.moto_host = "127.0.0.1"
        self.moto_port = 0

    # -- life -------------------------------------------------------------------------------

    def start(self) -> "S3Server":
        pytest.importorskip("botocore")
        moto_server = pytest.importorskip("moto.server")
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request lines
        self._moto = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0,
                                                    verbose=False)
        self._moto.start()
        self.moto_host, self.moto_port = self._moto.get_host_and_port()
        self._proxy = _Proxy(self)
        self._thread = threading.Thread(target=self._proxy.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="s3server-proxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()            # the accept loop ends
            self._proxy.drop_connections()    # idle keep-alive handlers see EOF
            self._proxy.server_close()        # and are joined
            self._thread.join(10)
            self._proxy = None
        if self._moto is not None:
            self._moto.stop()
            self._moto = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- where it is ------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The proxy's URL: what the client under test talks to."""
        assert self._proxy is not None, "the server is not started"
        return f"http://127.0.0.1:{self._proxy.server_address[1]}"

    @property
    def moto_endpoint(self) -> str:
        return f"http://{self.moto_host}:{self.moto_port}"

    def aws_env(self, *, credentials: bool = True, endpoint: Optional[str] = None) -> dict:
        """The AWS settings a client needs to reach the proxy (or ``endpoint``) and nothing
        else: dummy credentials (none with ``credentials=False``), the region, no instance
        metadata, no config or credentials file."""
        env = {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_DEFAULT_REGION": REGION,
               "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": NO_SUCH_FILE,
               "AWS_SHARED_CREDENTIALS_FILE": NO_SUCH_FILE, "BOTO_CONFIG": NO_SUCH_FILE}
        if credentials:
            env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY)
        return env

    def env(self, base: Optional[dict] = None, **kwargs: Any) -> dict:
        """A whole environment for a subprocess: ``base`` (default: this process's) without
        any AWS setting of its own, plus ``aws_env(**kwargs)``."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not _is_aws_setting(k)}
        env.update(self.aws_env(**kwargs))
        return env

    def client(self) -> Any:
        """A botocore S3 client straight to moto (not counted, no faults), for setup."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.Session().create_client(
            "s3", endpoint_url=self.moto_endpoint, region_name=REGION,
            aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY,
            config=Config(retries={"total_max_attempts": 1}))

    # -- counts -----------------------------------------------------------------------------

    def _record(self, entry: Request) -> None:
        with self._lock:
            if entry.generation == self._generation:
                self._log.append(entry)

    def bytes_sent(self, key: Optional[str] = None) -> int:
        """Body bytes sent in successful answers to object requests: for ``key``, or all."""
        with self._lock:
            return sum(r.sent for r in self._log
                       if r.key and 200 <= r.status < 300 and (key is None or r.key == key))

    def requests(self, key: Optional[str] = None, method: Optional[str] = None) -> list:
        """The requests answered (``Request``s), in order; those for ``key`` / ``method``."""
        with self._lock:
            return [r for r in self._log if (key is None or r.key == key)
                    and (method is None or r.method == method)]

    def reset_counts(self) -> None:
        with self._lock:
            self._log.clear()
            self._generation += 1

    # -- faults -----------------------------------------------------------------------------

    def inject(self, kind: str = "error", **rule: Any) -> Fault:
        """Add a fault rule (see ``Fault``); shorthands: ``inject("slowdown", times=2)``,
        ``inject("error", status=403, code="AccessDenied")``, ``inject("drop",
        after_bytes=1000)``, ``inject("delay", seconds=0.5)``. Returns the rule."""
        if kind == "slowdown":
            kind = "error"
            rule.setdefault("status", 503)
            rule.setdefault("code", "SlowDown")
        if kind not in ("error", "drop", "delay"):
            raise ValueError(f"unknown fault kind {kind!r}")
        fault = Fault(kind, **rule)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _match(self, method: str, key: str) -> Optional[Fault]:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, key):
                    fault.hits += 1
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None


def _is_aws_setting(name: str) -> bool:
    return name.startswith("AWS_") or name == "BOTO_CONFIG"


def use_env(monkeypatch: Any, env: dict) -> None:
    """Make ``env`` this process's only AWS settings, for one test (``monkeypatch``)."""
    for name in list(os.environ):
        if _is_aws_setting(name):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def s3_server() -> Iterator[S3Server]:
    """A started ``S3Server``, closed afterwards: the body of an ``s3`` fixture (skips when
    moto or botocore is not installed)."""
    with S3Server() as server:
        yield server
