"""Opening a checkpoint of many files in object storage fetches their headers at once (issue 40,
goal 4): what it opens is what the local open gives, the headers (and nothing else) are what
the server sends, several requests are in flight together, a failure is named by its object
and leaves nothing running.

Against the tests' emulators behind the counting proxy (``helpers/objectservers.py``), each
request delayed as a distant service's is (``add_latency``). How long an open takes is measured
by ``benchmarks/bench_objects.py --open-files 200`` (printed, not asserted).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import numpy as np
import pytest

pytest.importorskip("obstore")

from helpers import objectservers
from helpers.objectservers import scheme_params
from safetensors.numpy import save_file

from shardload import FormatError, StorageError, open_checkpoint
from shardload.readers import safetensors as st
from shardload.sources import store as store_module

BUCKET = "models"
FILES = 40
#: the prefix of its checkpoint: its own (the servers and their bucket are the session's, and
#: test_sources_store lists "many/")
MANY = "open-many"
LATENCY_S = 0.02
per_scheme = pytest.mark.parametrize("scheme", scheme_params())


def on(scheme: str):
    return pytest.mark.parametrize("scheme", scheme_params(scheme))


@pytest.fixture(scope="module")
def servers():
    def setup(server) -> None:
        server.make_bucket(BUCKET)
        server.uploaded = set()

    yield from objectservers.servers_on_demand(setup)


@pytest.fixture
def server(servers, scheme, monkeypatch):
    yield from objectservers.serving(servers(scheme), monkeypatch)


def write_many(folder, files: int = FILES) -> dict[str, int]:
    """A sharded checkpoint of ``files`` small safetensors files and its index; each file's
    header length by name."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map, headers = {}, {}
    for k in range(files):
        name = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        tensors = {
            f"layers.{k}.{j}.weight": rng.standard_normal((k % 3 + 1, 4), dtype=np.float32)
            for j in range(5)
        }
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        with open(os.path.join(folder, name), "rb") as f:
            headers[name] = struct.unpack("<Q", f.read(8))[0]
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"]}, f)
    return headers


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("many") / "ckpt")
    return folder, write_many(folder)


def upload(server, folder: str, prefix: str) -> str:
    if (folder, prefix) not in server.uploaded:
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                server.put(BUCKET, f"{prefix}/{name}", f.read())
        server.uploaded.add((folder, prefix))
    return server.url(BUCKET, f"{prefix}/")


def opened(path: str):
    with open_checkpoint(path) as ckpt:
        return (
            list(ckpt.metadata().items()),
            [ckpt.locate(name)[1:] for name in ckpt.metadata()],
            sorted(os.path.basename(f) for f in ckpt.file_metadata),
            [ckpt.file_metadata[f] for f in sorted(ckpt.file_metadata)],
            ckpt.index_metadata,
        )


def nothing_left_running(server) -> bool:
    """No request of the open is still on its way: none answered after it returned or raised
    (its threads are a long-lived pool's, kept idle for the next open, so they are not
    counted; the server's log is)."""
    answered = len(server.requests())
    time.sleep(4 * LATENCY_S)
    return len(server.requests()) == answered


@per_scheme
def test_many_files_open_as_the_local_checkpoint(server, many):
    folder, headers = many
    url = upload(server, folder, MANY)
    objectservers.add_latency(server, LATENCY_S)
    server.reset_counts()
    assert opened(url) == opened(folder)
    # each file: one GET of its first HEADER_GUESS bytes (these files are smaller: whole)
    for name in headers:
        size = os.path.getsize(os.path.join(folder, name))
        assert len(server.requests(f"{MANY}/{name}", "GET")) == 1, name
        assert server.bytes_sent(f"{MANY}/{name}") == min(size, st.HEADER_GUESS), name
    assert nothing_left_running(server)


@on("gs")
def test_a_header_longer_than_the_guess_takes_a_second_get(server, many, monkeypatch):
    """The rest of the header and nothing more; a file whose header length the rules
    refuse is refused, the bytes of its first GET all that was fetched of it."""
    folder, headers = many
    url = upload(server, folder, MANY)
    monkeypatch.setattr(st, "HEADER_GUESS", 64)
    server.reset_counts()
    assert opened(url) == opened(folder)
    for name, n in headers.items():
        assert [r.range for r in server.requests(f"{MANY}/{name}", "GET")] == [
            "bytes=0-63",
            f"bytes=64-{8 + n - 1}",
        ], name
        assert server.bytes_sent(f"{MANY}/{name}") == 8 + n, name


@on("s3")
def test_a_hostile_length_in_a_set_fetches_no_more(server, tmp_path, monkeypatch):
    folder = str(tmp_path / "hostile")
    write_many(folder, 4)
    victim = os.path.join(folder, "model-00003-of-00004.safetensors")
    with open(victim, "r+b") as f:
        f.write((90_000_000).to_bytes(8, "little"))  # far past the file's end
    url = upload(server, folder, "hostile-set")
    monkeypatch.setattr(st, "HEADER_GUESS", 64)
    server.reset_counts()
    with pytest.raises(FormatError, match="runs past the end") as info:
        open_checkpoint(url)
    assert "model-00003-of-00004.safetensors" in str(info.value)
    assert server.bytes_sent("hostile-set/model-00003-of-00004.safetensors") == 64


@on("s3")
def test_the_headers_are_fetched_together(server, many):
    """Several header GETs are in the proxy at once: the first ``TOGETHER`` wait there for
    each other (a barrier); an open that fetched them in turn would break it."""
    folder, _ = many
    url = upload(server, folder, MANY)
    TOGETHER = 8
    barrier = threading.Barrier(TOGETHER, timeout=20)
    met = []

    def meet() -> None:
        if not met and not barrier.broken:
            barrier.wait()  # raises in the proxy's thread if they do not all come
            met.append(True)

    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):  # (the side files are fetched before, together)
            server.inject("delay", seconds=0.0, times=None, key=f"{MANY}/{name}", before=meet)
    server.reset_counts()
    try:
        assert len(opened(url)[0]) == 5 * FILES
    finally:
        barrier.abort()
    assert met, f"fewer than {TOGETHER} header requests were ever in flight at once"


@per_scheme
def test_a_failing_object_is_named_and_nothing_is_left_running(server, many):
    folder, _ = many
    url = upload(server, folder, MANY)
    bad = "model-00017-of-00040.safetensors"
    server.inject("error", status=403, times=None, key=f"{MANY}/{bad}")
    objectservers.add_latency(server, LATENCY_S)
    with pytest.raises(StorageError) as info:
        open_checkpoint(url)
    assert bad in str(info.value)
    assert nothing_left_running(server)
    # the files after it: fetched only as far as they were already on their way
    later = [
        r
        for r in server.requests(method="GET")
        if r.key.startswith(f"{MANY}/")
        and r.key > f"{MANY}/{bad}"
        and r.key.endswith(".safetensors")
    ]
    assert len(later) <= 2 * store_module.OPEN_CONCURRENCY


@on("gs")
def test_the_first_failure_in_order_is_the_one_raised(server, tmp_path):
    """A file whose header is corrupt, before one the server refuses: opening in order meets
    the corrupt one first, and says so, whichever of the two was fetched first."""
    folder = str(tmp_path / "mixed")
    write_many(folder, 12)
    corrupt = os.path.join(folder, "model-00004-of-00012.safetensors")
    with open(corrupt, "r+b") as f:
        f.seek(8)
        f.write(b"[")  # the header is no longer an object
    url = upload(server, folder, "mixed")
    server.inject("error", status=403, times=None, key="mixed/model-00009-of-00012.safetensors")
    with pytest.raises(FormatError) as info:
        open_checkpoint(url)
    assert "model-00004-of-00012.safetensors" in str(info.value)
    assert str(info.value).startswith("gs://")
    assert nothing_left_running(server)


@on("az")
def test_side_files_fail_by_name(server, many):
    folder, _ = many
    url = upload(server, folder, MANY)
    server.inject("error", status=403, times=None, key=f"{MANY}/model.safetensors.index.json")
    with pytest.raises(StorageError) as info:
        open_checkpoint(url)
    assert "model.safetensors.index.json" in str(info.value)
    assert nothing_left_running(server)


def test_each_runs_every_item_and_reports_the_earliest_failure():
    """``sources.store.each`` on its own: every item once; after a failure nothing starts,
    and every item before the failed one did."""
    seen, lock = [], threading.Lock()

    def work(k: int) -> None:
        with lock:
            seen.append(k)
        if k in (30, 70):
            raise ValueError(k)

    failed = store_module.each(list(range(100)), work, threads=8)
    assert 30 in failed and str(failed[min(failed)]) == "30"
    assert set(range(31)) <= set(seen) and len(seen) == len(set(seen))
    seen.clear()
    assert store_module.each(list(range(50)), lambda k: seen.append(k), threads=8) == {}
    assert sorted(seen) == list(range(50))
    assert store_module.each([], work) == {}
