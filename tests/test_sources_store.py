"""The object-storage client layer (``shardload.sources``): URLs of every scheme, coalescing,
and every read against a real S3 server (moto's, behind the counting, fault-injecting proxy of
``helpers.s3server``), through obstore."""

from __future__ import annotations

import doctest
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

import numpy as np
from helpers import s3server
from helpers.s3server import ACCESS_KEY_ID, SECRET_ACCESS_KEY
from helpers.subprocesses import subprocess_env
from hypothesis import given, settings
from hypothesis import strategies as st

from shardload import sources
from shardload.errors import FormatError, StorageError
from shardload.sources import store as storemod
from shardload.sources import store_config, store_info, store_pool, store_spans
from shardload.sources import urls as urlsmod
from shardload.sources.store import MAX_GAP, ObjectClient, ObjectInfo, coalesce
from shardload.sources.urls import ObjectUrl

BUCKET = "models"
#: retry settings that fail fast
FAST = {"retries": 2, "backoff": 0.01, "backoff_cap": 0.05}
#: every failure in this file must come within this many seconds
BOUND_S = 5.0


@pytest.fixture(scope="session")
def s3():
    yield from s3server.s3_server()


@pytest.fixture(scope="session")
def bucket(s3):
    s3.client().create_bucket(Bucket=BUCKET)
    return BUCKET


@pytest.fixture(autouse=True)
def aws_env(request, monkeypatch):
    """Every test that uses the server sees only its AWS settings; faults and counts reset."""
    if "s3" not in request.fixturenames:
        yield None
        return
    server = request.getfixturevalue("s3")
    s3server.use_env(monkeypatch, server.aws_env())
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # the emulator speaks plain HTTP
    server.clear_faults()
    server.reset_counts()
    yield server
    server.clear_faults()


def put(s3, key: str, size: int, seed: int = 0) -> bytes:
    data = random.Random(f"{key}:{seed}").randbytes(size)
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=data)
    return data


def check_clean(exc: BaseException) -> str:
    """``exc``'s message: one line, no credential, nothing chained that could carry one."""
    text = str(exc)
    assert "\n" not in text and "\r" not in text, text
    for secret in (ACCESS_KEY_ID, SECRET_ACCESS_KEY, SECRET_ACCESS_KEY[:16]):
        assert secret not in text and secret not in repr(exc), text
        assert secret not in str(getattr(exc, "reason", "")), text
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    return text


def raises_within(exc_type, fn, bound: float = BOUND_S):
    began = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn()
    took = time.monotonic() - began
    assert took < bound, f"took {took:.1f} s"
    check_clean(info.value)
    return info.value


# ------------------------------------------------------------------------------ URLs, offline


def test_is_object_url():
    assert sources.is_object_url("s3://models/x")
    assert sources.is_object_url("s3://models")
    assert sources.is_object_url("gs://models/x") and sources.is_object_url("az://ckpt/x")
    for path in (
        "models/x",
        "/s3://x",
        "S3://models/x",
        "gcs://b/k",
        "https://x/y",
        "",
        None,
        b"s3://models/x",
    ):
        assert not sources.is_object_url(path)
    import pathlib

    assert not sources.is_object_url(pathlib.Path("s3:/models"))


@pytest.mark.parametrize(
    "url, bucket, key",
    [
        ("s3://models/llama/model.safetensors", "models", "llama/model.safetensors"),
        ("s3://models", "models", ""),
        ("s3://models/", "models", ""),
        ("s3://my.bucket-1/dir/", "my.bucket-1", "dir/"),
        ("s3://abc/" + "é" * 512, "abc", "é" * 512),  # 1024 UTF-8 bytes: the limit
        ("s3://b12/a b/ü?x=1#y", "b12", "a b/ü?x=1#y"),  # any other character is a key's
        ("gs://my_bucket.v2/dir/", "my_bucket.v2", "dir/"),  # GCS allows '_'
        ("az://ckpt-01/dir/x", "ckpt-01", "dir/x"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_parse_good(url, bucket, key):
    u = ObjectUrl.parse(url)
    assert (u.bucket, u.key) == (bucket, key)
    assert str(u) == f"{u.scheme}://{bucket}/{key}"
    assert ObjectUrl.parse(str(u)) == u


@pytest.mark.parametrize(
    "url, says",
    [
        ("S3://models/k", "does not start with one of s3://, gs://, az://"),
        ("s3:/models/k", "does not start with one of"),
        ("models/k", "does not start with one of"),
        ("gcs://models/k", "does not start with one of"),
        ("gs://goog-models/k", "reserved prefix 'goog'"),
        ("az://ab/k", "container name 'ab' is 2 characters long (3 to 63)"),
        ("az://ck_pt/k", "holds '_'"),
        ("az://ck--pt/k", "two adjacent dashes"),
        ("s3:///k", "bucket name is empty"),
        ("s3://ab/k", "2 characters long (3 to 63)"),
        ("s3://" + "a" * 64 + "/k", "64 characters long (3 to 63)"),
        ("s3://Models/k", "holds 'M'"),
        ("s3://my_bucket/k", "holds '_'"),
        ("s3://-models/k", "begin and end with a letter or a digit"),
        ("s3://models./k", "begin and end with a letter or a digit"),
        ("s3://mo..dels/k", "two adjacent periods"),
        ("s3://192.168.1.10/k", "formatted as an IP address"),
        ("s3://xn--models/k", "reserved prefix 'xn--'"),
        ("s3://models-s3alias/k", "reserved suffix '-s3alias'"),
        ("s3://models/" + "k" * 1025, "1025 bytes long in UTF-8"),
        ("s3://models/" + "é" * 513, "1026 bytes long in UTF-8"),
        ("s3://models/a\nb", "control character (U+000A)"),
        ("s3://models/a\x00b", "control character (U+0000)"),
        ("s3://models/a\ud800", "lone surrogate"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_parse_bad(url, says):
    with pytest.raises(StorageError) as info:
        ObjectUrl.parse(url)
    exc = info.value
    assert exc.usage is True and exc.byte_range is None and exc.url == url
    text = str(exc)
    assert "\n" not in text and says in text and "not a valid object storage URL" in text
    scheme = url.partition("://")[0]
    form = {"s3": "s3://BUCKET/KEY", "gs": "gs://BUCKET/KEY", "az": "az://CONTAINER/KEY"}
    assert text.endswith(f"write it as {form.get(scheme, 'SCHEME://BUCKET/KEY')}")
    assert len(text) < 600  # a 1025-byte key is not echoed whole


def test_parse_not_a_string():
    with pytest.raises(TypeError):
        ObjectUrl.parse(b"s3://models/k")


def test_join_and_folders():
    folder = ObjectUrl.parse("s3://models/llama/")
    assert (
        str(folder.join("model-00001.safetensors")) == "s3://models/llama/model-00001.safetensors"
    )
    assert str(folder.join("./sub//x.bin")) == "s3://models/llama/sub/x.bin"
    assert str(ObjectUrl.parse("s3://models/llama").join("a")) == "s3://models/llama/a"
    assert str(ObjectUrl.parse("s3://models").join("a")) == "s3://models/a"
    assert ObjectUrl.parse("s3://models/a/b.bin").folder == ObjectUrl("s3", "models", "a/")
    assert ObjectUrl.parse("s3://models/b.bin").folder == ObjectUrl("s3", "models", "")
    assert str(ObjectUrl.parse("az://ckpt/a/b.bin").folder.join("c")) == "az://ckpt/a/c"
    for bad in ("../x", "a/../../x", "/etc/passwd", ".", "a\nb"):
        with pytest.raises(StorageError) as info:
            folder.join(bad)
        assert info.value.usage
    with pytest.raises(ValueError):
        folder.join("")


def test_object_info_identity_is_json():
    info = ObjectInfo("s3://models/k", 10, '"abc"', "2026-01-01T00:00:00+00:00")
    assert json.loads(json.dumps(info.identity)) == ['"abc"', 10, "2026-01-01T00:00:00+00:00"]


def test_doctests():
    for module in (storemod, store_config, store_info, store_pool, store_spans, urlsmod, sources):
        assert doctest.testmod(module).failed == 0


# ---------------------------------------------------------------------------------- coalesce


def reference_coalesce(spans, gap):
    """Brute force: the set of wanted bytes, its maximal runs, runs closer than ``gap`` joined."""
    wanted = sorted({i for b, e in spans for i in range(b, e)})
    runs: list[list[int]] = []
    for i in wanted:
        if runs and i == runs[-1][1]:
            runs[-1][1] = i + 1
        elif runs and i - runs[-1][1] <= gap:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs], set(wanted)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=25), st.integers(0, 25)
)
def test_coalesce_against_brute_force(raw, gap):
    spans = [(b, b + n) for b, n in raw]
    merged = coalesce(spans, gap, small_gap=gap)  # every gap up to `gap` read through
    reference, wanted = reference_coalesce(spans, gap)
    assert merged == reference
    covered = {i for b, e in merged for i in range(b, e)}
    assert wanted <= covered  # every wanted byte is read
    for (_, e0), (b1, _) in itertools.pairwise(merged):
        assert b1 - e0 > gap  # sorted, kept apart by > gap
    for b, e in merged:  # the bounded over-read rule:
        assert b in wanted and e - 1 in wanted  # no span grows at its ends,
        hole = 0  # and no gap read through is
        for i in range(b, e):  # longer than max_gap
            hole = 0 if i in wanted else hole + 1
            assert hole <= gap


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 400)), max_size=25),
    st.integers(0, 100),
    st.integers(0, 1000),
)
def test_coalesce_reads_at_most_a_small_gap_or_a_quarter_more(raw, small, gap):
    spans = [(b, b + n) for b, n in raw]
    merged = coalesce(spans, gap, small_gap=small)
    runs, wanted = reference_coalesce(spans, 0)
    covered = {i for b, e in merged for i in range(b, e)}
    assert wanted <= covered
    holes = []
    for (_, e0), (b1, e1) in itertools.pairwise(runs):
        read_through = e0 in covered
        ok = b1 - e0 <= min(small, gap) or (b1 - e0 <= gap and 4 * (b1 - e0) <= e1 - b1)
        assert read_through == ok  # exactly the rule's gaps
        if read_through:
            holes.append(b1 - e0)
    assert len(covered) - len(wanted) == sum(holes)
    assert sum(holes) <= min(small, gap) * len(holes) + len(wanted) / 4


def test_coalesce_edges():
    assert coalesce([]) == []
    assert coalesce([(5, 5), (7, 7)]) == []
    assert coalesce([(0, 10), (10, 20)], max_gap=0) == [(0, 20)]  # adjacent
    assert coalesce([(0, 10), (11, 20)], max_gap=0) == [(0, 10), (11, 20)]
    assert coalesce([(0, 100), (10, 20)], max_gap=0) == [(0, 100)]  # contained
    # a gap up to MAX_GAP is read through where it is at most a quarter of the run it joins
    assert coalesce([(0, 1), (1 + MAX_GAP, 1 + 5 * MAX_GAP)]) == [(0, 1 + 5 * MAX_GAP)]
    assert coalesce([(0, 1), (2 + MAX_GAP, 2 + 5 * MAX_GAP)]) == [
        (0, 1),
        (2 + MAX_GAP, 2 + 5 * MAX_GAP),
    ]
    assert coalesce([(0, 1), (1 + MAX_GAP, 2 + MAX_GAP)]) == [(0, 1), (1 + MAX_GAP, 2 + MAX_GAP)]
    assert coalesce([(np.int64(3), np.int64(9))]) == [(3, 9)]
    for bad, exc in [
        ([(5, 4)], ValueError),
        ([(-1, 4)], ValueError),
        ([(1.0, 4)], TypeError),
        ([(1, 2, 3)], TypeError),
        ([None], TypeError),
    ]:
        with pytest.raises(exc):
            coalesce(bad)
    with pytest.raises(ValueError):
        coalesce([(0, 1)], max_gap=-1)


def test_client_arguments_checked():
    for kwargs in (
        {"concurrency": 0},
        {"chunk_bytes": 0},
        {"retries": -1},
        {"retries": 99},
        {"concurrency": True},
        {"backoff": -1},
        {"max_gap": 1.5},
    ):
        with pytest.raises(ValueError):
            ObjectClient(**kwargs)


# ------------------------------------------------------------------------- against the server


def test_head_list_and_identity(s3, bucket):
    a = put(s3, "fold/a.bin", 1000)
    put(s3, "fold/b.bin", 0)
    put(s3, "fold/sub/c.bin", 10)
    s3.client().put_object(Bucket=BUCKET, Key="fold/", Body=b"")  # a console "folder"
    client = ObjectClient()
    info = client.head("s3://models/fold/a.bin")
    assert info.url == "s3://models/fold/a.bin" and info.size == len(a)
    assert info.etag.startswith('"') and info.last_modified.endswith("+00:00")
    listed = client.list_folder("s3://models/fold")
    assert [i.url for i in listed] == ["s3://models/fold/a.bin", "s3://models/fold/b.bin"]
    assert listed[0].identity == info.identity  # HEAD and a listing agree on the identity
    assert listed[1].size == 0
    assert client.list_folder(ObjectUrl.parse("s3://models/fold/")) == listed
    assert client.list_folder("s3://models/fold/sub/")[0].url == "s3://models/fold/sub/c.bin"
    assert client.list_folder("s3://models/nothing-here/") == []


def test_list_and_cap(s3, bucket):
    for i in range(5):
        put(s3, f"many/{i}.bin", 3)
    client = ObjectClient(**FAST)
    assert [i.url for i in client.list_folder("s3://models/many/")] == [
        f"s3://models/many/{i}.bin" for i in range(5)
    ]
    exc = raises_within(
        StorageError, lambda: ObjectClient(max_folder_objects=4).list_folder("s3://models/many")
    )
    assert exc.usage and "more than 4 entries" in str(exc)


def test_head_of_a_folder_is_refused(s3, bucket):
    exc = raises_within(StorageError, lambda: ObjectClient().head("s3://models/fold/"))
    assert exc.usage and "names a folder" in str(exc)


def test_get_bytes_and_get_into(s3, bucket):
    data = put(s3, "get/x.bin", 100_003)
    client = ObjectClient(chunk_bytes=7000, concurrency=3)
    info = client.head("s3://models/get/x.bin")
    assert client.get_bytes(info, 0, len(data)) == data
    assert client.get_bytes(info, 99_999, 100_003) == data[99_999:]
    assert client.get_bytes(info, 5, 5) == b""
    buf = bytearray(50_000)
    client.get_into(info, 1234, buf)
    assert bytes(buf) == data[1234:51234]
    arr = np.zeros((100, 25), dtype=np.float32)  # 10,000 bytes, 2-D
    client.get_into(info, 8, arr)
    assert arr.tobytes() == data[8:10_008]
    client.get_into(info, 3, memoryview(bytearray(10))[2:7])
    assert s3.bytes_sent("get/x.bin") == len(data) + 4 + 50_000 + 10_000 + 5
    with pytest.raises(ValueError):
        client.get_bytes(info, 0, len(data) + 1)
    with pytest.raises(ValueError):
        client.get_into(info, -1, bytearray(3))
    with pytest.raises(TypeError):
        client.get_into(info, 0, b"readonly")
    with pytest.raises(ValueError):
        client.get_into(info, 0, np.zeros((10, 10), dtype=np.uint8)[:, ::2])


@pytest.mark.parametrize(
    "concurrency, chunk_bytes, max_gap",
    [
        (1, 8 << 20, MAX_GAP),
        (4, 4096, 0),
        (8, 1000, 100),
        (3, 65_536, 2000),
    ],
)
def test_fetch(s3, bucket, concurrency, chunk_bytes, max_gap):
    key = f"fetch/{concurrency}-{chunk_bytes}.bin"
    data = put(s3, key, 300_000)
    client = ObjectClient(concurrency=concurrency, chunk_bytes=chunk_bytes, max_gap=max_gap)
    info = client.head(f"s3://models/{key}")
    rng = random.Random(chunk_bytes)
    spans = [
        (b, min(b + rng.randrange(1, 6000), len(data)))
        for b in (rng.randrange(len(data)) for _ in range(40))
    ]
    spans += [(0, 1), (len(data) - 1, len(data))]
    s3.reset_counts()

    # straight into the object's bytes: each GET lands in place, over-read included
    whole = bytearray(len(data))
    with memoryview(whole) as into:
        n = client.fetch(info, spans, into=into)
    merged = coalesce(spans, max_gap)
    assert n == sum(e - b for b, e in merged)
    for b, e in merged:
        assert whole[b:e] == data[b:e]
    assert s3.bytes_sent(key) == n  # the server sent no more: each byte once
    gets = s3.requests(key=key, method="GET")
    assert len(gets) == len(store_spans.pieces(merged, chunk_bytes))
    with pytest.raises(TypeError):
        client.fetch(info, spans)  # no into=
    with pytest.raises(ValueError):
        client.fetch(info, spans, into=memoryview(bytearray(len(data) - 1)))


def test_fetch_nothing(s3, bucket):
    put(s3, "fetch/empty.bin", 0)
    client = ObjectClient()
    info = client.head("s3://models/fetch/empty.bin")
    into = memoryview(bytearray(0))
    assert client.fetch(info, [], into=into) == 0
    assert client.fetch(info, [(0, 0)], into=into) == 0
    assert s3.requests(method="GET") == []
    with pytest.raises(ValueError):
        client.fetch(info, [(0, 1)], into=into)


def test_fetch_failure_stops_the_rest(s3, bucket):
    data = put(s3, "fetch/stop.bin", 200_000)
    client = ObjectClient(concurrency=4, chunk_bytes=1000)
    info = client.head("s3://models/fetch/stop.bin")
    s3.reset_counts()
    s3.inject("error", key="fetch/stop.bin", status=403, code="AccessDenied", times=None)
    exc = raises_within(
        StorageError,
        lambda: client.fetch(info, [(0, len(data))], into=memoryview(bytearray(len(data)))),
    )
    assert "access denied" in str(exc)
    assert len(s3.requests(method="GET")) <= 2 * 4  # 200 pieces: most never asked


def test_get_into_honours_the_in_flight_limit(s3, bucket, monkeypatch):
    """At most ``concurrency`` GETs in flight in the process, whatever the calls: four
    threads reading at once through a client of two."""
    import obstore

    data = put(s3, "flight/x.bin", 40_000)
    client = ObjectClient(concurrency=2, chunk_bytes=5000)
    info = client.head("s3://models/flight/x.bin")
    get, lock, now, most = obstore.get, threading.Lock(), [0], [0]

    def counted_get(*args, **kwargs):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.02)
            return get(*args, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(obstore, "get", counted_get)
    results = [b""] * 4
    readers = [
        threading.Thread(
            target=lambda k=k: results.__setitem__(k, client.get_bytes(info, 0, len(data)))
        )
        for k in range(4)
    ]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert results == [data] * 4
    assert most[0] <= 2


def test_one_pool_per_client(s3, bucket):
    """The GETs run on the client's own long-lived threads: fetches reuse them."""
    data = put(s3, "pool/x.bin", 50_000)
    client = ObjectClient(concurrency=3, chunk_bytes=4000)
    info = client.head("s3://models/pool/x.bin")

    def gets() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("shardload-get")}

    before = gets()
    for _ in range(5):
        whole = bytearray(len(data))
        client.fetch(info, [(0, len(data))], into=memoryview(whole))
        assert whole == data
    mine = gets() - before
    assert 0 < len(mine) <= 3  # the calling thread is one of the three
    client.close()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in mine)


# ------------------------------------------------------------------------------------ retries


def test_slowdown_twice_then_success(s3, bucket):
    data = put(s3, "retry/slow.bin", 20_000)
    client = ObjectClient(**FAST)
    info = client.head("s3://models/retry/slow.bin")
    fault = s3.inject("slowdown", times=2)
    s3.reset_counts()
    assert client.get_bytes(info, 100, 20_000) == data[100:]
    assert fault.hits == 2
    assert [r.status for r in s3.requests(method="GET")] == [503, 503, 206]
    assert s3.bytes_sent() == 19_900


def test_dropped_connection_resumes(s3, bucket):
    data = put(s3, "retry/drop.bin", 50_000)
    client = ObjectClient(**FAST)
    info = client.head("s3://models/retry/drop.bin")
    s3.inject("drop", after_bytes=12_345)
    s3.reset_counts()
    assert client.get_bytes(info, 0, 50_000) == data
    gets = s3.requests(method="GET")
    assert [(r.range, r.sent) for r in gets] == [
        ("bytes=0-49999", 12_345),
        ("bytes=12345-49999", 37_655),
    ]
    assert s3.bytes_sent() == 50_000  # the resume asked the rest


def test_dropped_connections_in_fetch_resume(s3, bucket):
    data = put(s3, "retry/dropfetch.bin", 64_000)
    client = ObjectClient(concurrency=4, chunk_bytes=8000, **FAST)
    info = client.head("s3://models/retry/dropfetch.bin")
    s3.inject("drop", after_bytes=100, times=3)
    s3.reset_counts()
    got = bytearray(len(data))
    n = client.fetch(info, [(0, len(data))], into=memoryview(got))
    assert got == data and n == len(data) and s3.bytes_sent() == len(data)


def test_server_error_forever(s3, bucket):
    put(s3, "retry/500.bin", 5000)
    client = ObjectClient(retries=3, backoff=0.01, backoff_cap=0.05)
    info = client.head("s3://models/retry/500.bin")
    s3.inject("error", status=500, code="InternalError", times=None)
    s3.reset_counts()
    exc = raises_within(StorageError, lambda: client.get_bytes(info, 10, 4000))
    assert exc.usage is False and exc.byte_range == (10, 4000)
    assert exc.url == "s3://models/retry/500.bin"
    assert str(exc).startswith("s3://models/retry/500.bin: bytes [10, 4000): ")
    assert "4 attempts" in str(exc) and "HTTP 500" in str(exc)
    assert len(s3.requests(method="GET")) == 4


def test_not_retried_4xx(s3, bucket):
    put(s3, "retry/403.bin", 100)
    client = ObjectClient(**FAST)
    info = client.head("s3://models/retry/403.bin")
    s3.inject("error", status=403, code="AccessDenied", times=None)
    s3.reset_counts()
    exc = raises_within(StorageError, lambda: client.get_bytes(info, 0, 100))
    assert exc.usage is True and exc.byte_range == (0, 100)
    assert "access denied" in str(exc) and "may not read it" in str(exc)
    assert len(s3.requests(method="GET")) == 1


# ------------------------------------------------------------------------------------- errors


def test_missing_key_and_bucket(s3, bucket):
    client = ObjectClient(**FAST)
    exc = raises_within(StorageError, lambda: client.head("s3://models/nope/model.bin"))
    assert exc.usage and str(exc) == (
        "s3://models/nope/model.bin: no such object; check the "
        "path, or list the folder it should be in "
        "(s3://models/nope/)"
    )
    for call in (
        lambda: client.head("s3://no-such-bucket/k"),
        lambda: client.list_folder("s3://no-such-bucket/dir/"),
    ):
        exc = raises_within(StorageError, call)
        assert exc.usage and "no such S3 bucket 'no-such-bucket'" in str(exc)
        assert s3.endpoint in str(exc)


def test_access_denied(s3, bucket):
    put(s3, "denied/a.bin", 10)
    client = ObjectClient(**FAST)
    s3.inject("error", status=403, code="AccessDenied", method="HEAD")
    exc = raises_within(StorageError, lambda: client.head("s3://models/denied/a.bin"))
    assert exc.usage and exc.byte_range is None
    assert "access denied" in str(exc) and "may not read it" in str(exc)
    s3.inject("error", status=403, code="AccessDenied", key="")
    exc = raises_within(StorageError, lambda: client.list_folder("s3://models/denied/"))
    assert exc.usage and "may not list it" in str(exc)


def test_no_credentials(s3, bucket, monkeypatch):
    s3server.use_env(monkeypatch, s3.aws_env(credentials=False))
    exc = raises_within(StorageError, lambda: ObjectClient(**FAST).head("s3://models/fold/a.bin"))
    assert exc.usage is True, exc
    assert "credentials" in str(exc) and "AWS_ACCESS_KEY_ID" in str(exc), exc


def test_dead_endpoint(s3, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
        s3server.use_env(monkeypatch, s3.aws_env(endpoint=dead))
        # a retry would wait a second first: the refusal comes at once, not retried (no
        # retry cures a wrong setting), naming the variable that set the endpoint
        exc = raises_within(
            StorageError,
            lambda: ObjectClient(retries=2, backoff=1.0).head("s3://models/k"),
            bound=0.9,
        )
    assert exc.usage is False
    assert dead in str(exc) and "could not connect" in str(exc), exc
    assert "AWS_ENDPOINT_URL" in str(exc) and "refused" in str(exc), exc


def test_bad_endpoint_url(s3, monkeypatch):
    s3server.use_env(monkeypatch, s3.aws_env(endpoint="not a url"))
    exc = raises_within(StorageError, lambda: ObjectClient(**FAST).head("s3://models/k"))
    assert "endpoint" in str(exc), exc


def test_refused_credentials_never_echoed(s3, bucket):
    """A real S3 echoes the access key id (and the string to sign) in a SignatureDoesNotMatch
    body; botocore's own message repeats the body's message. Ours repeats neither."""
    put(s3, "secret/a.bin", 10)
    echo = (
        f"<AWSAccessKeyId>{ACCESS_KEY_ID}</AWSAccessKeyId><StringToSign>AWS4-HMAC-SHA256 "
        f"{SECRET_ACCESS_KEY}</StringToSign><SignatureProvided>00ff</SignatureProvided>"
    )
    said = f"The request signature we calculated does not match. Key {ACCESS_KEY_ID}"
    for key in (None, ""):  # objects, and listings
        s3.inject(
            "error",
            status=403,
            code="SignatureDoesNotMatch",
            message=said,
            extra=echo,
            times=None,
            key=key,
        )
    import botocore.exceptions  # a plain botocore call through the proxy shows the danger
    import botocore.session

    plain = botocore.session.Session().create_client("s3", endpoint_url=s3.endpoint)
    with pytest.raises(botocore.exceptions.ClientError) as leaked:
        plain.get_object(Bucket=BUCKET, Key="secret/a.bin")
    assert ACCESS_KEY_ID in str(leaked.value)

    client = ObjectClient(**FAST)
    info = ObjectInfo("s3://models/secret/a.bin", 10, '"x"', "")
    for call in (
        lambda: client.get_bytes(info, 0, 10),
        lambda: client.fetch(info, [(0, 10)], into=memoryview(bytearray(10))),
        lambda: client.list_folder("s3://models/secret/"),
    ):
        exc = raises_within(StorageError, call)
        assert exc.usage and "the S3 credentials in use were refused" in str(exc), exc


def test_obstore_missing(monkeypatch):
    for name in ("obstore", "obstore.store"):
        monkeypatch.setitem(sys.modules, name, None)
    exc = raises_within(StorageError, lambda: ObjectClient().head("gs://models/k"))
    assert exc.usage and str(exc).endswith('pip install "shardload[objects]"')


def test_obstore_is_imported_lazily(s3, bucket):
    """``import shardload`` (and the CLI's module) never import obstore; the first read of a
    URL does, in a subprocess configured only by ``s3.env()``."""
    data = put(s3, "lazy/a.bin", 100)
    code = (
        "import sys, shardload, shardload.sources, shardload.sources.store as s\n"
        "s.ObjectClient(); s.ObjectUrl.parse('s3://models/k'); s.coalesce([(0, 1)])\n"
        "import shardload.cli\n"
        "assert 'obstore' not in sys.modules, 'obstore imported'\n"
        "c = s.default_client(); info = c.head('s3://models/lazy/a.bin')\n"
        "sys.stdout.write(c.get_bytes(info, 0, info.size).hex())\n"
        "assert 'obstore' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env({**s3.env(), "AWS_ALLOW_HTTP": "true"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert bytes.fromhex(done.stdout) == data


# ---------------------------------------------------------------------------------- identity


def test_object_replaced_between_head_and_get(s3, bucket):
    put(s3, "changed/a.bin", 5000, seed=1)
    client = ObjectClient(**FAST)
    info = client.head("s3://models/changed/a.bin")
    put(s3, "changed/a.bin", 5000, seed=2)  # same size, new bytes
    now = client.head("s3://models/changed/a.bin")
    for call in (
        lambda: client.get_bytes(info, 0, 100),
        lambda: client.fetch(info, [(0, 100), (4000, 5000)], into=memoryview(bytearray(5000))),
    ):
        exc = raises_within(FormatError, call)
        assert exc.file == "s3://models/changed/a.bin"
        assert str(exc) == (
            f"s3://models/changed/a.bin: the object changed while loading "
            f"(ETag now {now.etag}, was {info.etag}); do not replace a "
            "checkpoint while it is loading"
        )


def test_object_deleted_between_head_and_get(s3, bucket):
    put(s3, "changed/b.bin", 100)
    client = ObjectClient(**FAST)
    info = client.head("s3://models/changed/b.bin")
    s3.client().delete_object(Bucket=BUCKET, Key="changed/b.bin")
    exc = raises_within(FormatError, lambda: client.get_bytes(info, 0, 10))
    assert "the object changed while loading (it can no longer be read: no such object" in str(exc)


# ------------------------------------------------------------------ processes and settings


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # threads: moto's, the proxy's
def test_a_child_forked_after_reading_objects_is_refused_at_once(s3, bucket):
    # the library's runtime does not survive a fork (its threads stay behind): a child that
    # tried would hang, so it is told, at once, in one line, how to start its process instead
    data = put(s3, "fork/a.bin", 30_000)
    client = ObjectClient(chunk_bytes=10_000, concurrency=2)
    info = client.head("s3://models/fork/a.bin")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running anything of pytest's
        try:
            client.get_bytes(info, 0, len(data))
            os.write(write, b"read")
        except StorageError as exc:
            os.write(write, str(exc).encode()[:1000])
        except BaseException as exc:  # noqa: BLE001
            os.write(write, repr(exc).encode()[:1000])
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.02)
    said = os.read(read, 1000).decode()
    os.close(read)
    assert said.startswith(
        "s3://models/fork/a.bin: this process was forked from one that had read object storage"
    ), said
    assert "'spawn'" in said and "\n" not in said
    assert client.get_bytes(info, 0, 10) == data[:10]  # the parent reads on


def test_default_client_settings(monkeypatch):
    monkeypatch.setenv("SHARDLOAD_OBJECT_CONCURRENCY", "3")
    monkeypatch.setenv("SHARDLOAD_OBJECT_CHUNK_MB", "0.25")
    monkeypatch.setenv("SHARDLOAD_OBJECT_RETRIES", "")  # empty: the default
    with storemod.use_client() as client:
        assert storemod.default_client() is client
        assert (client.concurrency, client.chunk_bytes, client.retries) == (3, 256 << 10, 5)
        own = ObjectClient(concurrency=2)
        with storemod.use_client(own):
            assert storemod.default_client() is own
        assert storemod.default_client() is client
    assert storemod.default_client() is not client
    storemod.reset_default_client()
    assert storemod.settings_from_env({}) == {
        "concurrency": 8,
        "chunk_bytes": 8 << 20,
        "retries": 5,
        "max_gap": 1 << 20,
    }
    assert storemod.settings_from_env({"SHARDLOAD_OBJECT_MAX_GAP_KB": "0"})["max_gap"] == 0
    for name, value in [
        ("SHARDLOAD_OBJECT_CONCURRENCY", "0"),
        ("SHARDLOAD_OBJECT_CONCURRENCY", "x"),
        ("SHARDLOAD_OBJECT_CONCURRENCY", "2.5"),
        ("SHARDLOAD_OBJECT_CHUNK_MB", "-1"),
        ("SHARDLOAD_OBJECT_CHUNK_MB", "nan"),
        ("SHARDLOAD_OBJECT_RETRIES", "21"),
        ("SHARDLOAD_OBJECT_RETRIES", "-1"),
        ("SHARDLOAD_OBJECT_MAX_GAP_KB", "-1"),
    ]:
        with pytest.raises(ValueError) as info:
            storemod.settings_from_env({name: value})
        assert str(info.value).startswith(f"{name}={value!r} ")
    monkeypatch.setenv("SHARDLOAD_OBJECT_RETRIES", "lots")
    with pytest.raises(ValueError, match="SHARDLOAD_OBJECT_RETRIES"):
        storemod.default_client()


def test_proxy_stops_its_threads(monkeypatch):
    before = set(threading.enumerate())
    with s3server.S3Server() as server:
        s3server.use_env(monkeypatch, server.aws_env())
        server.client().create_bucket(Bucket="other")
        server.client().put_object(Bucket="other", Key="k", Body=b"abc")
        monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
        client = ObjectClient()
        info = client.head("s3://other/k")  # keep-alive connections
        assert client.get_bytes(info, 0, 3) == b"abc"
        assert server.bytes_sent("k") == 3
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        if not left:
            break
        time.sleep(0.05)
    assert not left, left
