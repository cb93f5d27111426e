"""Loads from object storage stream within a bounded window: the peak memory of the load's
whole process tree stays under what the workers keep plus the window, whatever the
checkpoint's size (two sizes, one over four windows), on threads and on worker processes,
against a real GCS server on 127.0.0.1 (fake-gcs-server, a process of its own, behind the
counting proxy: moto's S3 server would run in this process, and its memory would count).

Memory is measured as the kernel accounts it: the proportional set size of anonymous and
shared memory (``Pss_Anon + Pss_Shmem`` of ``/proc/<pid>/smaps_rollup``) of this process and
every worker process, summed (a page that several processes map counts once), sampled while
the load runs, less the same before it started. The bound is generous (10%, and a few MiB
for the client's buffers); fetching the whole checkpoint before copying, as loads did before
streaming, would exceed it by the checkpoint's size less the window.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("obstore")

from helpers import objectservers
from safetensors.numpy import save_file

from shardload import ProcessSession, ThreadedSession, load_sharded, open_checkpoint
from shardload.sources import store
from shardload.sources.specs import FileSource, ObjectSpec

#: a read plan's source that is an object (what the stream planning looks at)
_OBJECT_SOURCE = FileSource("/m.safetensors", None, ObjectSpec("s3://b/m.safetensors", 0, "e", "t"))

BUCKET = "memory"
MIB = 1 << 20
WINDOW_MB = 16
#: the client's own memory besides the window: its GET buffers (chunk x concurrency) and slack
#: for the allocator
SLACK = 24 * MIB
ROWS, COLS = 512, 1024  # float32: 2 MiB a tensor


@pytest.fixture(scope="module")
def server():
    yield from objectservers.object_server("gs")


@pytest.fixture
def env(server, monkeypatch):
    objectservers.use_env(monkeypatch, server.env())
    monkeypatch.setenv("SHARDLOAD_OBJECT_WINDOW_MB", str(WINDOW_MB))
    monkeypatch.setenv("SHARDLOAD_OBJECT_CHUNK_MB", "1")
    monkeypatch.setenv("SHARDLOAD_OBJECT_CONCURRENCY", "4")
    store.reset_default_client()
    yield server
    store.reset_default_client()


def _checkpoint(server, tmp_path_factory, tensors: int) -> tuple[str, int]:
    """A checkpoint of ``tensors`` float32 matrices of 2 MiB each, split by rows, uploaded;
    its URL and its data bytes."""
    folder = tmp_path_factory.mktemp(f"ckpt{tensors}")
    rng = np.random.default_rng(tensors)
    data = {
        f"w.{k:03d}": rng.standard_normal((ROWS, COLS), dtype=np.float32) for k in range(tensors)
    }
    plan = {
        name: [["shardload.split", [["num_shards", f"{ROWS} // num_shards", COLS], "float32"], 0]]
        for name in data
    }
    return _upload(server, folder, data, plan, f"c{tensors}"), tensors * ROWS * COLS * 4


def _upload(server, folder, data: dict, plan: dict, prefix: str) -> str:
    """``data`` and its ``plan`` written into ``folder`` as a checkpoint and uploaded under
    ``prefix``; its URL."""
    import json

    save_file(data, str(folder / "model.safetensors"))
    (folder / "shard_info.json").write_text(json.dumps(plan))
    try:
        server.make_bucket(BUCKET)
    except Exception:  # noqa: BLE001 - made by an earlier test
        pass
    for name in ("model.safetensors", "shard_info.json"):
        server.put(BUCKET, f"{prefix}/{name}", (folder / name).read_bytes())
    return server.url(BUCKET, f"{prefix}/")


@pytest.fixture(scope="module")
def small(server, tmp_path_factory):
    return _checkpoint(server, tmp_path_factory, 12)  # 24 MiB: 1.5 windows


@pytest.fixture(scope="module")
def large(server, tmp_path_factory):
    return _checkpoint(server, tmp_path_factory, 48)  # 96 MiB: 6 windows


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            text = f.read().decode()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss_Anon", "Pss_Shmem"):
            total += int(rest.split()[0]) * 1024
    return total


def _tree(pid: int, leave_out: set) -> list[int]:
    """``pid`` and every descendant (through /proc/<pid>/task/*/children), but those in
    ``leave_out`` and theirs (the emulator)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in leave_out:
            continue
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


class _Peak:
    """The peak of the tree's memory while the ``with`` block runs, sampled every 10 ms."""

    def __init__(self, server):
        self.leave_out = {server._child.proc.pid}

    def _now(self) -> int:
        return sum(map(_pss, _tree(os.getpid(), self.leave_out)))

    def __enter__(self) -> _Peak:
        self.base = self._now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())

    @property
    def grew(self) -> int:
        return self.peak - self.base


@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("kind", [ThreadedSession, ProcessSession])
def test_peak_memory_is_kept_plus_the_window(env, request, size, kind):
    url, data_bytes = request.getfixturevalue(size)
    with kind(2) as sess, open_checkpoint(url) as ckpt:
        env.reset_counts()
        with _Peak(env) as peak:
            sharded = load_sharded(ckpt, None, sess, progress=False)
        sent = env.bytes_sent(f"{url.split('/', 3)[3]}model.safetensors")
        kept = sharded.stats.bytes_total
        bound = 1.1 * (kept + WINDOW_MB * MIB) + SLACK
        assert kept == data_bytes  # split by rows: the workers keep every byte once
        assert peak.grew <= bound, (
            f"{kind.__name__}, {size}: the load's processes grew by "
            f"{peak.grew / MIB:.1f} MiB, over kept "
            f"{kept / MIB:.1f} MiB + the window"
        )
        # a worker's piece is what the file holds (the load is right, not only small)
        with open_checkpoint(url) as again:
            whole = again.read("w.000")
        assert torch.equal(sharded.shard("w.000", 1), whole[ROWS // 2 :])
    # every byte once, even through a window a sixth of the checkpoint
    assert data_bytes <= sent <= data_bytes * 1.01


# ---- seen while it happens: the watchdog, a failed fetch, the bar ------------------------------


def test_each_torchrun_rank_streams_within_the_window(env, large, tmp_path, monkeypatch):
    # a torchrun rank is a loader of its own: it streams its own spans through its own window,
    # and grows by what it keeps plus at most the window (each rank measures itself). Each
    # keeps 48 MiB of rows and reads 48 MiB: fetched whole before copying, a rank would grow
    # by 96 MiB, over the bound of 1.1 x (48 + 4) + 24 = 81 MiB
    import json
    import subprocess
    import sys

    window_mb = 4
    monkeypatch.setenv("SHARDLOAD_OBJECT_WINDOW_MB", str(window_mb))

    url, _ = large
    folder = tmp_path / "local"
    folder.mkdir()
    for name in ("model.safetensors", "shard_info.json"):
        key = url.split(f"{BUCKET}/", 1)[1] + name
        (folder / name).write_bytes(_get(env, key))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    run_env["PYTHONPATH"] = os.pathsep.join([repo, os.path.join(repo, "tests")])
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "helpers.object_rank_job",
            url,
            str(folder),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
        env=run_env,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["equal"], rank
        bound = 1.1 * (result["kept"] + window_mb * MIB) + SLACK
        assert result["grew"] <= bound, (rank, result["grew"] / MIB, bound / MIB)
        print(
            f"rank {rank}: kept {result['kept'] / MIB:.0f} MiB, grew "
            f"{result['grew'] / MIB:.0f} MiB (bound {bound / MIB:.0f})"
        )


def _get(server, key: str) -> bytes:
    """An object's bytes (the local copy a test compares with)."""
    client = store.default_client()
    info = client.head(server.url(BUCKET, key))
    return client.get_bytes(info, 0, info.size)


@pytest.mark.parametrize("kind", [ThreadedSession, ProcessSession])
def test_a_fetch_that_stops_is_a_stall_the_watchdog_names(env, small, kind):
    from shardload import WorkerError

    url, _ = small
    key = f"{url.split('/', 3)[3]}model.safetensors"
    with kind(2) as sess, open_checkpoint(url) as ckpt:
        env.inject("delay", key=key, seconds=20, times=None)  # the GETs stop answering
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            load_sharded(ckpt, None, sess, progress=False, timeout=2)
        took = time.monotonic() - start
        env.clear_faults()
    message = str(info.value)
    assert "waiting for its bytes from object storage" in message, message
    assert "\n" not in message and took < 12, (took, message)


@pytest.mark.parametrize("kind", [ThreadedSession, ProcessSession])
def test_a_fetch_that_fails_fails_the_load_with_its_own_line(env, small, kind, monkeypatch):
    from shardload import StorageError

    monkeypatch.setenv("SHARDLOAD_OBJECT_RETRIES", "1")
    store.reset_default_client()
    url, _ = small
    key = f"{url.split('/', 3)[3]}model.safetensors"
    with kind(2) as sess, open_checkpoint(url) as ckpt:
        env.inject("error", key=key, status=503, times=None)
        with pytest.raises(StorageError) as info:
            load_sharded(ckpt, None, sess, progress=False)
        env.clear_faults()
        message = str(info.value)
        assert message.startswith(f"{url}model.safetensors") and "\n" not in message, message
        # the session lives on: the next load, with the server well again, is whole
        sharded = load_sharded(ckpt, None, sess, progress=False)
        assert sharded.stats.bytes_total == 12 * ROWS * COLS * 4


def test_the_fetch_has_a_bar_of_its_own(env, small, monkeypatch):
    import tqdm.auto

    bars: dict = {}

    class Bar:
        def __init__(self, total, desc, **kwargs):
            self.n, self.total = 0, total
            bars[desc] = self

        def update(self, n):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    url, data_bytes = small
    with ThreadedSession(2) as sess:
        load_sharded(url, None, sess, progress=True)
    assert bars["fetching"].total == bars["fetching"].n == data_bytes
    assert bars["loading"].n == data_bytes


# ---- the order of the stream ---------------------------------------------------------------------


def test_the_stream_takes_every_workers_order():
    # a worker holding some parameters only (expert parallelism) takes a subsequence of the
    # load's order; merged by first sight, [a, c] and [a, b, c] would put b after c, and the
    # second worker would find c released behind it
    from shardload.pieces.stream import piece_units, stream_units
    from shardload.readplan import PieceRead, ReadPlan, Run

    def plan(rank, names):
        run = (Run(0, 0, 1, 1, 1, 0, 1),)
        return ReadPlan(
            rank,
            2,
            (_OBJECT_SOURCE,),
            tuple(PieceRead(n, (1,), "uint8", run, False, None, None, False) for n in names),
        )

    plans = [plan(0, ["a", "c", "e"]), plan(1, ["a", "b", "c", "d", "e"])]
    names = stream_units(plans).names
    assert names == ["a", "b", "c", "d", "e"]
    plans = [plan(0, ["x", "e0", "e2", "y"]), plan(1, ["x", "e1", "e3", "y"])]
    names = stream_units(plans).names
    assert names.index("y") > max(names.index(e) for e in ("e0", "e1", "e2", "e3"))
    assert names[0] == "x"
    with pytest.raises(ValueError, match="contradict"):
        stream_units([plan(0, ["a", "b"]), plan(1, ["b", "a"])])
    with pytest.raises(ValueError, match="not in the stream's order"):
        piece_units(plan(0, ["b", "a"]), stream_units([plan(0, ["a", "b"])]))


@pytest.mark.parametrize("kind", [ThreadedSession, ProcessSession])
def test_experts_placed_on_some_workers_stream_through_a_small_window(
    env, kind, tmp_path, monkeypatch
):

    monkeypatch.setenv("SHARDLOAD_OBJECT_WINDOW_MB", "4")  # two tensors: releases all along
    rng = np.random.default_rng(7)
    data, placement, plan = {}, {}, {}
    for layer in range(4):
        data[f"l{layer}.attn"] = rng.standard_normal((ROWS, COLS), dtype=np.float32)
        plan[f"l{layer}.attn"] = [
            ["shardload.split", [["num_shards", f"{ROWS} // num_shards", COLS], "float32"], 0]
        ]
        for e in range(4):
            data[f"l{layer}.e{e}"] = rng.standard_normal((ROWS, COLS), dtype=np.float32)
            placement[f"l{layer}.e{e}"] = [e % 2]
    plan["__placement__"] = {"num_shards": 2, "params": placement}
    url = _upload(env, tmp_path, data, plan, "experts")
    with kind(2) as sess:
        local = load_sharded(str(tmp_path), None, sess, progress=False)
        remote = load_sharded(url, None, sess, progress=False)
        for i in range(2):
            a, b = local.worker(i), remote.worker(i)
            assert a.keys() == b.keys() and len(a) == 4 + 8
            for name in a:
                assert torch.equal(a[name], b[name]), (i, name)


def test_split_runs_keeps_every_byte_and_waits_for_whole_blocks():
    # checked against a plain numpy copy of the same runs: the parts together copy exactly
    # what the runs copy, and every block of part k lies wholly before cut k (so it is present
    # once unit k is fetched) and ends after cut k - 1 (no part waits longer than it must)
    from shardload.pieces.stream import split_runs
    from shardload.readplan import Run

    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)

    def copy(runs, size):
        out = np.zeros(size, np.uint8)
        for r in runs:
            for k in range(r.count):
                s = r.offset + k * (r.stride or r.nbytes)
                d = r.dst_offset + k * (r.dst_stride or r.nbytes)
                out[d : d + r.nbytes] = src[s : s + r.nbytes]
        return out

    for trial in range(300):
        nbytes = int(rng.integers(1, 600))
        count = int(rng.integers(1, 40))
        stride = nbytes + int(rng.integers(0, 300)) if rng.random() < 0.7 else 0
        offset = int(rng.integers(0, 2000))
        run = Run(0, offset, nbytes, count, stride, int(rng.integers(0, 50)), 0)
        other = Run(1, 5, 7, 1, 0, 0, 0)  # another source: with the first part
        end = offset + (count - 1) * (stride or nbytes) + nbytes
        cuts = sorted({int(c) for c in rng.integers(offset + 1, end + 1, int(rng.integers(1, 8)))})
        parts = split_runs([run, other], 0, cuts)
        assert len(parts) == len(cuts) + 1 and other in parts[0]
        size = run.dst_offset + count * nbytes
        assert np.array_equal(
            copy([r for p in parts for r in p if r.source == 0], size), copy([run], size)
        ), trial
        for k, part in enumerate(parts):
            for r in part:
                if r.source != 0:
                    continue
                for i in range(r.count):
                    begin = r.offset + i * (r.stride or r.nbytes)
                    last = begin + r.nbytes - 1
                    if k < len(cuts):
                        assert last < cuts[k], (trial, k, r)
                    if k > 0:
                        assert last >= cuts[k - 1], (trial, k, r)


@pytest.mark.parametrize("kind", [ThreadedSession, ProcessSession])
@pytest.mark.parametrize("axis", [0, 1])
def test_a_large_tensor_streams_in_parts(env, kind, axis, tmp_path, monkeypatch):
    # a tensor of many parts: each worker copies part after part as they arrive (contiguous
    # runs when split by rows, strided ones by columns), through a window of a few parts, and
    # gets what the local load gets

    from shardload.pieces import stream, units

    monkeypatch.setattr(units, "PART_BYTES", 256 << 10)
    monkeypatch.setenv("SHARDLOAD_OBJECT_WINDOW_MB", "1")
    made, reached = [], []
    init, reach = stream.ObjectStream.__init__, stream.Consumer.reach
    monkeypatch.setattr(
        stream.ObjectStream,
        "__init__",
        lambda self, *a, **k: (made.append(self), init(self, *a, **k))[1],
    )
    monkeypatch.setattr(
        stream.Consumer,
        "reach",
        lambda self, unit, *a: (reached.append(unit), reach(self, unit, *a))[1],
    )
    rng = np.random.default_rng(11)
    big = rng.standard_normal((2048, 1024), dtype=np.float32)  # 8 MiB: 32 parts
    data = {
        "a.small": rng.standard_normal((64, 64), dtype=np.float32),
        "b.big": big,
        "c.small": rng.standard_normal((64, 64), dtype=np.float32),
    }
    shape = {
        0: [["num_shards", "2048 // num_shards", 1024], "float32"],
        1: [["num_shards", 2048, "1024 // num_shards"], "float32"],
    }[axis]
    plan = {
        name: [["shardload.split", [["num_shards", "64 // num_shards", 64], "float32"], 0]]
        for name in ("a.small", "c.small")
    }
    plan["b.big"] = [["shardload.split", shape, axis]]
    prefix = f"parts{axis}{kind.__name__}"
    url = _upload(env, tmp_path, data, plan, prefix)
    with kind(2) as sess:
        local = load_sharded(str(tmp_path), None, sess, progress=False)
        remote = load_sharded(url, None, sess, progress=False)
        for i in range(2):
            a, b = local.worker(i), remote.worker(i)
            assert a.keys() == b.keys() == data.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), (i, name)
    (stream_,) = made
    assert len(stream_.layout.names) == 2 + 32
    assert stream_.peak_held <= (1 << 20) + (256 << 10)  # the window, not the 8 MiB tensor
    if kind is ThreadedSession:  # the workers' own calls are seen in this process only
        assert len(set(reached)) >= 30
    assert env.bytes_sent(f"{prefix}/model.safetensors") <= os.path.getsize(
        tmp_path / "model.safetensors"
    )


# ---- the fetch's threads, without a server ------------------------------------------------------


class _FakeObject:
    """An object's bytes as a stream fetches them: ``need_spans`` takes ``delay`` seconds and
    fails from the ``fail_at``-th call on; the threads it ran on are recorded."""

    class client:
        max_gap = 0

    borrowed = False

    def __init__(self, delay: float = 0.0, fail_at: int | None = None):
        self.delay, self.fail_at, self.calls, self.threads = delay, fail_at, 0, set()

    def need_spans(self, spans):
        self.calls += 1
        self.threads.add(threading.current_thread())
        time.sleep(self.delay)
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise OSError("the object store went away")
        return sum(e - b for b, e in spans)

    def release(self, begin, end):
        pass


def _stream_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The stream threads alive that were not before (an earlier test's GET held up by its
    server may still be ending)."""
    return [t for t in set(threading.enumerate()) - before if t.name.startswith("shardload-stream")]


def _one_worker_stream(obj, pieces: int = 40):
    from shardload.pieces.stream import ObjectStream, stream_units
    from shardload.readplan import PieceRead, ReadPlan, Run

    plan = ReadPlan(
        0,
        1,
        (_OBJECT_SOURCE,),
        tuple(
            PieceRead(f"p{k}", (64,), "uint8", (Run(0, 64 * k, 64),), False, None, None, False)
            for k in range(pieces)
        ),
    )
    # a batch of two pieces: twenty batches
    stream = ObjectStream({0: obj}, stream_units([plan]), 1, window=4 * 128)
    stream.batch_bytes = 128
    return plan, stream


def test_the_fetch_runs_its_batches_on_one_pool_and_joins_it_when_closed():
    before = set(threading.enumerate())
    obj = _FakeObject()
    plan, stream = _one_worker_stream(obj)
    consumer = stream.start().consumer(0, plan)
    for j in range(len(plan.pieces)):
        consumer.at(j, lambda: None, lambda: False)
    consumer.finish()
    stream.close()
    assert obj.calls == 20 and len(obj.threads) <= 2  # IN_FLIGHT threads, not one per batch
    assert not _stream_threads(before) and not stream.fetching


def test_a_failed_or_interrupted_fetch_leaves_no_thread_behind():
    from shardload.pieces.stream import StreamFailed

    before = set(threading.enumerate())
    obj = _FakeObject(fail_at=3)
    plan, stream = _one_worker_stream(obj)
    consumer = stream.start().consumer(0, plan)
    with pytest.raises(OSError, match="went away"):
        for j in range(len(plan.pieces)):
            consumer.at(j, lambda: None, lambda: False)
    assert isinstance(stream.error, OSError) and not isinstance(stream.error, StreamFailed)
    stream.close()
    assert not _stream_threads(before)
    # closed with GETs in flight (Ctrl-C): the threads end with them, within the close's wait
    obj = _FakeObject(delay=0.2)
    plan, stream = _one_worker_stream(obj)
    stream.start()
    time.sleep(0.05)
    stream.close()
    assert not _stream_threads(before) and stream.control.words is None  # released, closed


def test_the_window_is_read_by_the_projects_one_parser():
    from shardload.pieces.stream import DEFAULT_WINDOW_BYTES, window_from_env

    assert window_from_env({}) == DEFAULT_WINDOW_BYTES
    assert window_from_env({"SHARDLOAD_OBJECT_WINDOW_MB": " 2 "}) == 2 << 20
    for bad in ("0", "-1", "nan", "lots"):
        with pytest.raises(ValueError) as info:
            window_from_env({"SHARDLOAD_OBJECT_WINDOW_MB": bad})
        assert str(info.value).startswith(
            f"SHARDLOAD_OBJECT_WINDOW_MB={bad!r} is not a number of MiB from "
        ), info.value
        assert "unset it for the default (1024)" in str(info.value)


def test_a_stream_spec_travels_as_json_and_is_checked_when_read_back():
    import json

    from shardload.pieces.stream import StreamSpec

    spec = StreamSpec("/proc/1/fd/7", 3, 2, (0, -1, 1), (0, -1, 4), {2: (0, (16, 32, 48))})
    wire = json.loads(json.dumps(spec.to_json()))
    assert wire["cuts"] == {"2": [0, [16, 32, 48]]}
    assert StreamSpec.from_json(wire, pieces=3) == spec
    bad = {
        "consumers": ({**wire, "consumers": 0}, "'consumers' is not a positive whole number"),
        "slot": ({**wire, "slot": 3}, "'slot' is not a whole number below 3"),
        "units": ({**wire, "units": [0, 1]}, "'units' is not a list of 3 whole numbers"),
        "last": ({**wire, "last": [0, "1", 2]}, "'last' is not a list of whole numbers"),
        "cut key": ({**wire, "cuts": {"3": [0, [1]]}}, "'cuts' is not keyed by piece numbers"),
        "cut": ({**wire, "cuts": {"2": [0, 16]}}, "'cuts/2' is not \\[source, \\[offsets"),
    }
    for what, (data, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            StreamSpec.from_json(data, pieces=3)
            pytest.fail(what)
    with pytest.raises(ValueError, match="not an object"):
        StreamSpec.from_json([1, 2], pieces=3)
