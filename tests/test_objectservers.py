"""The object-storage emulators the tests use (``helpers.objectservers``): moto (``s3://``),
fake-gcs-server (``gs://``) and Azurite (``az://``), each behind the counting, fault-injecting
proxy, driven by obstore itself with nothing but the environment ``env()`` gives. What a
client may rely on from them, and what obstore does with them:

* head, list with a prefix, ranged GETs with If-Match; bytes counted at the proxy are the bytes
  asked for, and setup (``put``, ``delete``) is not counted;
* If-Match with a wrong ETag: 412 from moto and Azurite; fake-gcs-server *ignores* If-Match on
  its XML API (what obstore reads with) and serves the object: on ``gs://`` a read is pinned
  with ``version`` (the generation, ``?generation=``), which it does honour;
* an injected 503 is retried by obstore; a body dropped midway is resumed with a Range GET
  from the byte it got to, and an object replaced meanwhile fails the read (no mixed bytes);
* error answers have the service's own body; the emulator processes die with the session.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from urllib.parse import quote

import pytest

obstore = pytest.importorskip("obstore")

from helpers import objectservers  # noqa: E402
from helpers.objectservers import SCHEME_PARAMS  # noqa: E402
from helpers.subprocesses import subprocess_env  # noqa: E402
from obstore.exceptions import GenericError, PermissionDeniedError, PreconditionError  # noqa: E402
from obstore.store import from_url  # noqa: E402

BUCKET = "shardload-objects"  # a valid name for all three: 3-63 characters, lower case
BIG = "ckpt/model-00001-of-00002.bin"
OBJECTS = {
    BIG: random.Random(1).randbytes(1 << 20),
    "ckpt/model-00002-of-00002.bin": random.Random(2).randbytes(300_000),
    "ckpt/config.json": b'{"model_type": "llama"}',
    "ckpt/sub dir/a+b=c.bin": b"odd name" * 10,  # spaces, '+', '=': how each encodes
    "other/x.bin": b"x",
}
#: retries that give up fast
FAST = {
    "max_retries": 2,
    "init_backoff": timedelta(milliseconds=10),
    "max_backoff": timedelta(milliseconds=50),
    "retry_timeout": timedelta(seconds=10),
}


@pytest.fixture(scope="session", params=SCHEME_PARAMS)
def server(request):
    """One server per scheme, its bucket made and ``OBJECTS`` in it."""
    for server in objectservers.object_server(request.param):
        server.make_bucket(BUCKET)
        for key, data in OBJECTS.items():
            server.put(BUCKET, key, data)
        yield server


@pytest.fixture
def store(server, monkeypatch):
    """An obstore store on the bucket, made with the server's environment only (obstore reads
    it when a store is made); faults and counts reset."""
    objectservers.use_env(monkeypatch, server.env())
    server.clear_faults()
    server.reset_counts()
    yield from_url(server.url(BUCKET))
    server.clear_faults()


def get(store, key: str, **options) -> bytes:
    return bytes(obstore.get(store, key, options=options).bytes())


# -- the environment --------------------------------------------------------------------------


def test_env_points_at_the_proxy(server, store):
    env = server.env()
    if server.scheme == "gs":  # the endpoint is in the service-account file
        with open(env["GOOGLE_SERVICE_ACCOUNT"]) as f:
            assert json.load(f)["gcs_base_url"] == server.endpoint
    else:
        assert any(value.startswith(server.endpoint) for value in env.values())
    assert all(objectservers.is_cloud_setting(name) for name in env)
    assert server.url(BUCKET, "a/b") == f"{server.scheme}://{BUCKET}/a/b"
    whole = server.subprocess_env(
        {
            "AWS_PROFILE": "someone",
            "GOOGLE_CLOUD_PROJECT": "p",
            "AZURE_STORAGE_CONNECTION_STRING": "x",
            "PATH": "/bin",
        }
    )
    assert whole == {"PATH": "/bin", **env}
    # the store reaches the emulator through the proxy, and only through it
    assert obstore.head(store, "other/x.bin")["size"] == 1
    assert [(r.method, r.bucket, r.key) for r in server.requests()] == [
        ("HEAD", BUCKET, "other/x.bin")
    ]


def test_setup_is_not_counted(server, store):
    server.put(BUCKET, "tmp/setup.bin", b"abc")
    server.make_bucket(BUCKET)  # again: no error
    assert get(store, "tmp/setup.bin") == b"abc"
    server.delete(BUCKET, "tmp/setup.bin")
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "tmp/setup.bin")
    assert [(r.method, r.key, r.status) for r in server.requests()] == [
        ("GET", "tmp/setup.bin", 200),
        ("HEAD", "tmp/setup.bin", 404),
    ]
    assert server.bytes_sent() == 3


# -- what a reader relies on ------------------------------------------------------------------


def test_head(server, store):
    for key, data in OBJECTS.items():
        meta = obstore.head(store, key)
        assert meta["path"] == key and meta["size"] == len(data)
        assert meta["e_tag"]
        if server.scheme == "gs":
            assert meta["version"].isdigit()  # the object's generation
        else:
            assert meta["version"] is None  # no versioning on the bucket
    heads = server.requests(method="HEAD")
    assert [r.key for r in heads] == list(OBJECTS) and all(r.status == 200 for r in heads)
    assert server.bytes_sent() == 0


def test_list_with_prefix(server, store):
    listed = {m["path"]: m["size"] for m in obstore.list(store, prefix="ckpt/").collect()}
    assert listed == {k: len(v) for k, v in OBJECTS.items() if k.startswith("ckpt/")}
    listing = server.requests()
    assert listing and all(
        r.key == "" and r.bucket == BUCKET and r.method == "GET" for r in listing
    )
    assert server.bytes_sent() == 0  # a listing is not object data
    with_delimiter = obstore.list_with_delimiter(store, prefix="ckpt")
    assert with_delimiter["common_prefixes"] == ["ckpt/sub dir"]


def test_ranged_gets_count_the_bytes_asked_for(server, store):
    data = OBJECTS[BIG]
    etag = obstore.head(store, BIG)["e_tag"]
    ranges = [(0, 1), (10, 1000), (500_000, 600_000), (len(data) - 7, len(data))]
    for a, b in ranges:
        assert get(store, BIG, range=(a, b), if_match=etag) == data[a:b]
    gets = server.requests(method="GET")
    assert [r.range for r in gets] == [f"bytes={a}-{b - 1}" for a, b in ranges]
    assert all(r.status == 206 and r.headers.get("if-match") == etag for r in gets)
    assert server.bytes_sent(BIG) == server.bytes_sent() == sum(b - a for a, b in ranges)
    odd = "ckpt/sub dir/a+b=c.bin"
    assert get(store, odd, range=(2, 5)) == OBJECTS[odd][2:5]
    assert server.bytes_sent(odd) == 3
    # the whole object, once
    server.reset_counts()
    assert get(store, BIG) == data and server.bytes_sent(BIG) == len(data)


def test_if_match(server, store):
    meta = obstore.head(store, BIG)
    assert get(store, BIG, range=(0, 100), if_match=meta["e_tag"]) == OBJECTS[BIG][:100]
    wrong = '"0123456789abcdef"'
    if server.scheme == "gs":
        # fake-gcs-server ignores If-Match on its XML API: the object comes, 200
        assert get(store, BIG, range=(0, 100), if_match=wrong) == OBJECTS[BIG][:100]
        assert server.requests()[-1].headers.get("if-match") == wrong
        # the generation pins a read: ?generation=, which it honours (a wrong one: 404)
        assert get(store, BIG, range=(0, 100), version=meta["version"]) == OBJECTS[BIG][:100]
        assert server.requests()[-1].query == f"generation={meta['version']}"
        with pytest.raises(FileNotFoundError):
            get(store, BIG, range=(0, 100), version=str(int(meta["version"]) + 1))
    else:
        with pytest.raises(PreconditionError):
            get(store, BIG, range=(0, 100), if_match=wrong)
        assert server.requests()[-1].status == 412
    assert server.bytes_sent(BIG) == 100 * (3 if server.scheme == "gs" else 1)


# -- faults -----------------------------------------------------------------------------------


def test_503_is_retried(server, store):
    fault = server.inject("slowdown", times=2, key=BIG)
    assert get(store, BIG, range=(0, 4096)) == OBJECTS[BIG][:4096]
    assert fault.hits == 2
    assert [r.status for r in server.requests(method="GET")] == [503, 503, 206]
    assert server.bytes_sent() == 4096  # error bodies are not object data


def test_503_gives_up_after_the_retries(server, monkeypatch):
    objectservers.use_env(monkeypatch, server.env())
    server.reset_counts()
    server.inject("slowdown", times=None, key=BIG)
    try:
        with pytest.raises(GenericError, match="503"):
            get(from_url(server.url(BUCKET), retry_config=FAST), BIG, range=(0, 10))
    finally:
        server.clear_faults()
    assert len(server.requests()) == 1 + FAST["max_retries"]


def test_dropped_body_is_resumed(server, store):
    data = OBJECTS[BIG]
    server.inject("drop", after_bytes=1000, key=BIG)
    assert get(store, BIG) == data
    gets = server.requests(method="GET")
    # the rest asked for with a Range from where the body broke: no byte sent twice
    assert [(r.range, r.status, r.fault) for r in gets] == [
        (None, 200, "drop"),
        (f"bytes=1000-{len(data) - 1}", 206, None),
    ]
    assert server.bytes_sent(BIG) == len(data)
    # and within a range
    server.reset_counts()
    server.inject("drop", after_bytes=100, key=BIG)
    assert get(store, BIG, range=(10, 5000)) == data[10:5000]
    assert [r.range for r in server.requests()] == ["bytes=10-4999", "bytes=110-4999"]
    assert server.bytes_sent() == 4990


def test_dropped_body_of_a_replaced_object_fails(server, store):
    """The object is replaced between the broken body and the resumed GET: obstore sends no
    If-Match with the resumed GET, but checks what comes back, and fails the read."""
    key = "tmp/replaced.bin"
    old, new = random.Random(3).randbytes(200_000), random.Random(4).randbytes(200_000)
    server.put(BUCKET, key, old)
    server.inject("drop", after_bytes=1000, key=key)
    server.inject("delay", key=key, before=lambda: server.put(BUCKET, key, new))
    with pytest.raises(GenericError, match="body error"):
        get(store, key)
    first, resumed = server.requests(key=key)
    assert (first.fault, first.range) == ("drop", None)
    assert resumed.range == "bytes=1000-199999" and "if-match" not in resumed.headers
    assert resumed.status == 206  # the new object's bytes came, and were not taken
    server.delete(BUCKET, key)


def test_endless_drops_give_up(server, monkeypatch):
    objectservers.use_env(monkeypatch, server.env())
    server.reset_counts()
    server.inject("drop", after_bytes=1000, key=BIG, times=None)
    try:
        with pytest.raises(GenericError, match="body error"):
            get(from_url(server.url(BUCKET), retry_config=FAST), BIG)
    finally:
        server.clear_faults()
    assert len(server.requests()) == 1 + FAST["max_retries"]


def test_error_bodies_are_the_services_own(server, store):
    """What a client sees of an injected error, raw: status, content type, body."""
    key = "ckpt/config.json"
    path = {
        "s3": f"/{BUCKET}/{key}",
        "gs": f"/{BUCKET}/{quote(key)}",
        "az": f"/devstoreaccount1/{BUCKET}/{key}",
    }[server.scheme]
    server.inject("slowdown", key=key)
    status, headers, body = _raw(server, "GET", path)
    assert status == 503
    code = {"s3": "SlowDown", "gs": "ServiceUnavailable", "az": "ServerBusy"}[server.scheme]
    assert headers["content-type"].startswith("application/xml")
    assert body.startswith(b"<?xml") and f"<Error><Code>{code}</Code>".encode() in body
    if server.scheme == "az":
        assert headers["x-ms-error-code"] == "ServerBusy"
    server.inject("error", status=403, key=key, method="HEAD")
    status, headers, body = _raw(server, "HEAD", path)
    assert status == 403 and body == b"" and int(headers["content-length"]) > 0
    # and obstore takes it for what it is
    server.inject("error", status=403, key=key, method="HEAD")
    with pytest.raises(PermissionDeniedError):
        obstore.head(store, key)


@pytest.mark.parametrize("server", ["gs"], indirect=True)
def test_gcs_json_api_paths(server, store):
    """fake-gcs-server's JSON API through the proxy (obstore reads with the XML API; other
    clients and the setup use this one): listings, metadata and media, counted as such."""
    key = "ckpt/config.json"
    name = quote(key, safe="")
    status, _, body = _raw(server, "GET", f"/storage/v1/b/{BUCKET}/o?prefix=ckpt/")
    assert status == 200
    assert {i["name"] for i in json.loads(body)["items"]} == {
        k for k in OBJECTS if k.startswith("ckpt/")
    }
    status, _, body = _raw(server, "GET", f"/storage/v1/b/{BUCKET}/o/{name}")
    assert status == 200 and json.loads(body)["size"] == str(len(OBJECTS[key]))
    assert server.bytes_sent() == 0  # a listing and metadata: not object data
    assert _raw(server, "GET", f"/storage/v1/b/{BUCKET}/o/{name}?alt=media")[2] == OBJECTS[key]
    assert _raw(server, "GET", f"/download/storage/v1/b/{BUCKET}/o/{name}")[2] == OBJECTS[key]
    assert server.bytes_sent(key) == 2 * len(OBJECTS[key])
    assert _raw(server, "GET", "/storage/v1/b")[0] == 200  # the buckets: no bucket's
    assert [(r.bucket, r.key) for r in server.requests()] == [
        (BUCKET, ""),
        (BUCKET, key),
        (BUCKET, key),
        (BUCKET, key),
        ("", ""),
    ]
    # an error on the JSON API is JSON
    server.inject("slowdown", key=key)
    status, headers, body = _raw(server, "GET", f"/storage/v1/b/{BUCKET}/o/{name}?alt=media")
    assert status == 503 and headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == 503 and error["errors"][0]["reason"] == "backendError"


# -- the processes ----------------------------------------------------------------------------


def test_free_port():
    port = objectservers.free_port()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    assert not low <= port <= high
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_taken_port_is_passed_over(monkeypatch):
    """The port drawn for an emulator is taken before it binds it: another port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused at once
        ports = iter([taken.getsockname()[1], objectservers.free_port()])
        second = None

        def draw():
            nonlocal second
            second = next(ports)
            return second

        monkeypatch.setattr(objectservers, "free_port", draw)
        with objectservers.make_server("gs") as gcs:
            assert gcs.upstream_port == second != taken.getsockname()[1]
            gcs.make_bucket("abc")


def test_emulator_stops_with_close(monkeypatch):
    gcs = objectservers.make_server("gs", preload={"early": {"a/b.bin": b"xyz"}}).start()
    child, port = gcs._child, gcs.upstream_port
    objectservers.use_env(monkeypatch, gcs.env())
    assert get(from_url(gcs.url("early")), "a/b.bin") == b"xyz"  # loaded at start
    gcs.close()
    assert child.proc.poll() is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_emulator_dies_with_its_parent():
    """A session killed outright (no atexit, no fixture teardown) leaves no emulator behind:
    the parent-death signal ends it."""
    if objectservers._SETPRIV is None:
        pytest.skip("no setpriv here")
    code = (
        "import sys, time; from helpers import objectservers as o\n"
        "s = o.make_server('gs').start()\n"
        "print(s._child.proc.pid, s.upstream_port, s._tmp, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    tmp = None
    try:
        pid, port, tmp = parent.stdout.readline().split()
        pid, port = int(pid), int(port)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert _wait_for(lambda: not _alive(pid), timeout=10), f"emulator {pid} outlived"
        # and every process of its group (it runs in a group of its own): a probe of its port
        # could meet another emulator that took the freed port, as tests run side by side
        assert _wait_for(lambda: not objectservers.group_members(pid), timeout=10), (
            objectservers.group_members(pid)
        )
    finally:
        parent.kill()
        parent.wait()
        if tmp is not None and os.path.basename(tmp).startswith("shardload-gs-"):
            shutil.rmtree(tmp, ignore_errors=True)  # what its close() would have removed


# -- helpers ----------------------------------------------------------------------------------


def _raw(server, method: str, path: str) -> tuple:
    """One request to the proxy, unsigned: (status, lower-case headers, body)."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", int(server.endpoint.rsplit(":", 1)[1]), timeout=30
    )
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False
