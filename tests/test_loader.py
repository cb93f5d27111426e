"""load_sharded on ThreadedSession: correctness against numpy, chains, errors, and statistics."""

from __future__ import annotations

import threading

import helpers.session_plugins  # noqa: F401  (registers test shard functions, here and in workers)
import numpy as np
import pytest
import torch
from helpers.loads import load_on_threads

from shardload import (
    REPLICATE,
    ArrayCheckpoint,
    PlanError,
    ProcessSession,
    SessionClosedError,
    ShardInfo,
    ThreadedSession,
    WorkerError,
    get_shard_func,
    load_sharded,
    pieces,
    register_shard_func,
)
from shardload.shared_outputs import SharedOutputs

NS = [1, 2, 3, 4, 8]


_process_sessions: dict[int, ProcessSession] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_process_sessions():
    yield
    for sess in _process_sessions.values():
        sess.close()
    _process_sessions.clear()


@pytest.fixture(params=["thread", "process"])
def session_kind(request):
    return request.param


@pytest.fixture
def run(session_kind):
    """``run(params, plan, n)``: load_sharded on a session of the kind under test.

    Worker processes take a second to start, so process sessions are kept per N for the
    module; threads are made fresh each time.
    """

    def run(params, plan, n, **kwargs):
        kwargs.setdefault("progress", False)
        if session_kind == "thread":
            with ThreadedSession(n) as sess:
                return load_sharded(params, plan, sess, **kwargs)
        sess = _process_sessions.get(n)
        if sess is None or sess.closed:
            sess = _process_sessions[n] = ProcessSession(n)
        return load_sharded(params, plan, sess, **kwargs)

    return run


# ---- the TVM Disco example ---------------------------------------------------------------------


# every N on threads; on worker processes (a session of N processes started for each N, a few
# seconds apiece) N = 1 and 2 in the fast subset, the rest marked slow
@pytest.mark.parametrize("func", ["tests.disco.shard_dim_1", "tests.disco.shard_dim_1.torch"])
@pytest.mark.parametrize(
    "session_kind, n",
    [("thread", n) for n in NS]
    + [
        ("process", 1),
        ("process", 2),
        *[pytest.param("process", n, marks=pytest.mark.slow) for n in (3, 4, 8)],
    ],
)
def test_tvm_shard_dim_1(run, func, n):
    x = np.random.default_rng(n).standard_normal((64, 64 * n)).astype(np.float16)
    # exactly the plan TVM's test writes: concrete shapes, num_shards as an extra arg
    plan = {"x_0": [[func, [[n, 64, 64], "float16"], n]]}
    result = run({"x_0": x}, plan, n)
    expected = np.split(x, n, axis=1)
    for i in range(n):
        got = result.shard("x_0", i)
        assert got.dtype == torch.float16 and got.is_contiguous()
        np.testing.assert_array_equal(got.numpy(), expected[i])


# ---- built-ins through the loader ----------------------------------------------------------------


@pytest.mark.parametrize(
    "n, kv_heads", [(1, 2), (2, 2), (3, 3), (4, 2), (8, 2), (8, 4), (4, 8), (3, 1), (8, 1)]
)
def test_split_segments_with_gqa_matches_numpy(run, n, kv_heads):
    # fused qkv rows: 24 q heads and kv_heads KV heads of 4 rows each, 8 columns; MQA included
    q_heads, hd, cols = 24, 4, 8
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((h * hd, cols)).astype(np.float32)
        for h in (q_heads, kv_heads, kv_heads)
    )
    qkv = np.concatenate([q, k, v])
    kv_rows = hd * kv_heads // min(n, kv_heads)
    rows = q_heads * hd // n + 2 * kv_rows
    plan = {
        "qkv": [
            [
                "shardload.split_segments",
                [["num_shards", rows, cols], "float32"],
                0,
                q_heads * hd,
                q_heads,
                kv_heads * hd,
                -kv_heads,
                kv_heads * hd,
                -kv_heads,
            ]
        ]
    }
    result = run({"qkv": qkv}, plan, n)
    for i in range(n):
        kv_head = i // (n // kv_heads) if n > kv_heads else None
        if kv_head is None:
            ks, vs = np.split(k, n)[i], np.split(v, n)[i]
        else:
            ks, vs = k[kv_head * hd : (kv_head + 1) * hd], v[kv_head * hd : (kv_head + 1) * hd]
        expected = np.concatenate([np.split(q, n)[i], ks, vs])
        np.testing.assert_array_equal(result.shard("qkv", i).numpy(), expected)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint32, torch.bool, torch.int8]
)
def test_dtypes_numpy_lacks_move_exactly(run, dtype):
    high = 2 if dtype == torch.bool else 256  # a bool byte other than 0/1 is undefined
    x = torch.randint(
        0, high, (6, 8 * torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8
    ).view(dtype)
    plan = {
        "x": [
            [
                "shardload.split",
                [
                    ["num_shards", 6, f"{x.shape[1]} // num_shards"],
                    str(x.dtype).removeprefix("torch."),
                ],
                1,
            ]
        ],
        "y": [
            ["shardload.replicate", [["num_shards", *x.shape], str(x.dtype).removeprefix("torch.")]]
        ],
    }
    result = run({"x": x, "y": x}, plan, 2)
    for i in range(2):
        got = result.shard("x", i)
        assert got.dtype == dtype
        assert torch.equal(
            got.view(torch.uint8), x.chunk(2, dim=1)[i].contiguous().view(torch.uint8)
        )
        assert torch.equal(result.shard("y", i).view(torch.uint8), x.view(torch.uint8))


def test_direct_reads_equal_the_full_computation(run):
    # split and split_segments read only their own ranges; the answer must be what running the
    # function on the whole tensor gives.
    x = torch.arange(2 * 24 * 3, dtype=torch.int32).reshape(2, 24, 3)
    plan = ShardInfo.from_dict(
        {
            "x": [
                [
                    "shardload.split_segments",
                    [["num_shards", 2, "16 // num_shards + 8 // min(num_shards, 2)", 3], "int32"],
                    1,
                    16,
                    4,
                    8,
                    -2,
                ]
            ]
        }
    ).bind(4)
    validated = plan.validate(ArrayCheckpoint({"x": x}).metadata())
    step = validated.params["x"].steps[0]
    full = torch.empty(step.out_shape, dtype=torch.int32)
    get_shard_func(step.func).func(x, *step.extra, full)  # the function itself, on the whole
    result = run({"x": x}, plan, 4)
    for i in range(4):
        assert torch.equal(result.shard("x", i), full[i])


# ---- chains, replication, ownership --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_two_step_chain(run, n):
    x = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    plan = {
        "x": [
            ["tests.loader.transpose", [[16, 8], "int32"]],
            ["shardload.split", [["num_shards", "16 // num_shards", 8], "int32"], 0],
        ]
    }
    result = run({"x": x}, plan, n)
    for i in range(n):
        np.testing.assert_array_equal(result.shard("x", i).numpy(), np.split(x.T, n)[i])


def test_replicated_params_are_whole_and_owned(run):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    result = run({"norm": x}, {}, 3)
    pieces = [result.shard("norm", i) for i in range(3)]
    x.add_(100)  # the caller's array changing must not change the shards
    for p in pieces:
        assert torch.equal(p, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert len({p.untyped_storage().data_ptr() for p in pieces}) == 3


def test_shards_own_their_memory(run):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    plan = {"x": [["shardload.split", [["num_shards", 2, 8], "float32"], 0]]}
    result = run({"x": x}, plan, 4)
    for i in range(4):
        piece = result.shard("x", i)
        assert piece.untyped_storage().nbytes() == piece.numel() * 4  # not a view of a bigger one


def test_worker_mapping_and_names(run):
    x = np.arange(8, dtype=np.int64)
    result = run({"a": x, "b": x}, {"a": [["shardload.split", [[2, 4], "int64"], 0]]}, 2)
    assert sorted(result.names) == ["a", "b"]
    w1 = result.worker(1)
    assert set(w1) == {"a", "b"} and torch.equal(w1["a"], torch.arange(4, 8))
    with pytest.raises(IndexError):
        result.shard("a", 2)
    with pytest.raises(KeyError):
        result.shard("c", 0)


def test_plan_bound_to_another_n_is_refused(run):
    plan = ShardInfo.from_dict(
        {"w": [["shardload.split", [["num_shards", "8 // num_shards"], "float32"], 0]]}
    ).bind(4)
    with pytest.raises(PlanError, match="bound to num_shards=4, but the session has 2"):
        run({"w": np.zeros(8, np.float32)}, plan, 2)


# ---- statistics and progress -------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_each_worker_reads_only_its_share(run, session_kind, tmp_path, n):
    from safetensors.numpy import save_file

    from shardload import open_checkpoint

    rng = np.random.default_rng(1)
    tensors = {f"w{k}": rng.standard_normal((64, 32)).astype(np.float32) for k in range(6)}
    tensors["norm"] = np.ones(32, np.float32)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    plan = {
        f"w{k}": [["shardload.split", [["num_shards", "64 // num_shards", 32], "float32"], 0]]
        for k in range(3)
    }
    plan.update(
        {
            f"w{k}": [["shardload.split", [["num_shards", 64, "32 // num_shards"], "float32"], 1]]
            for k in range(3, 6)
        }
    )
    with open_checkpoint(tmp_path / "m.safetensors") as ckpt:
        result = run(ckpt, plan, n)
        # threads read through this checkpoint; worker processes open the file themselves
        assert ckpt.bytes_read == (
            sum(result.stats.bytes_read_per_worker) if session_kind == "thread" else 0
        )
    sharded = 6 * 64 * 32 * 4
    for i in range(n):
        assert result.stats.bytes_read_per_worker[i] == sharded // n + 32 * 4
        assert result.stats.bytes_per_worker[i] == sharded // n + 32 * 4
    assert result.stats.bytes_total == sum(result.stats.bytes_per_worker)
    assert result.stats.tensors_per_worker == [7] * n and result.stats.seconds > 0


def test_progress_callback_sees_every_byte(run):
    seen = []
    lock = threading.Lock()

    def progress(nbytes):
        with lock:
            seen.append(nbytes)

    x = np.zeros((8, 8), np.float32)
    result = run(
        {"a": x, "b": x},
        {"a": [["shardload.split", [[4, 2, 8], "float32"], 0]]},
        4,
        progress=progress,
    )
    # a: 8 of 64 floats per worker; b: replicated, all 64 floats per worker
    assert sum(seen) == result.stats.bytes_total == 4 * (16 + 64) * 4


def test_staging_is_bounded_for_opaque_chains(monkeypatch):
    # Opaque chains share one full output per parameter; no more than MAX_SHARED at a time.
    live, peak = set(), [0]

    original = SharedOutputs.take

    def take(self, name, compute, *rest):
        with self._cond:
            live.update(self._cells)
            peak[0] = max(peak[0], len(self._cells))
        return original(self, name, compute, *rest)

    monkeypatch.setattr(SharedOutputs, "take", take)
    params = {f"p{k}": np.full((8, 4), k, np.float32) for k in range(20)}
    plan = {name: [["tests.loader.opaque", [[4, 2, 4], "float32"]]] for name in params}
    result = load_on_threads(params, plan, 4)
    assert peak[0] <= pieces.MAX_SHARED
    for k in range(20):
        assert torch.equal(result.shard(f"p{k}", 3), torch.full((2, 4), float(k)))


# ---- failures ------------------------------------------------------------------------------------


def test_a_raising_function_is_a_worker_error_naming_param_and_step(run, session_kind):
    plan = {
        "ok": [["shardload.split", [[2, 4], "float32"], 0]],
        "bad": [
            ["shardload.replicate", [[2, 8], "float32"]],
            ["tests.loader.boom", [[2, 8], "float32"]],
        ],
    }
    params = {"ok": np.zeros(8, np.float32), "bad": np.zeros(8, np.float32)}
    with pytest.raises(WorkerError) as info:
        run(params, plan, 2)
    err = info.value
    if session_kind == "thread":
        assert len(err.failures) == 1  # the worker that computed it; the other stops quietly
    failure = err.failures[0]
    assert failure.worker in (0, 1) and failure.exc_type == "RuntimeError"
    assert (
        "parameter 'bad', step 1 (tests.loader.boom): boom in a shard function" in failure.message
    )
    assert "in boom" in failure.traceback  # the remote traceback reaches the user
    assert f"worker {failure.worker} failed" in str(err)
    # the session survives a failed load
    again = run({"ok": np.ones(8, np.float32)}, {}, 2)
    assert torch.equal(again.shard("ok", 1), torch.ones(8))


def test_failures_from_several_workers_are_all_reported(run):
    plan = {f"p{k}": [["tests.loader.fail_numpy", [[2, 4], "float32"]]] for k in range(2)}
    params = {f"p{k}": np.zeros(8, np.float32) for k in range(2)}
    with pytest.raises(WorkerError) as info:
        run(params, plan, 2)
    assert info.value.failures[0].exc_type == "ValueError"
    assert {f.worker for f in info.value.failures} <= {0, 1}


def test_sessions_check_devices():
    with pytest.raises(ValueError, match="3 devices given for 2 workers"):
        ThreadedSession(2, device=["cpu"] * 3)
    with ThreadedSession(3, device=["cpu", "cpu", "cpu"]) as sess:
        assert len(sess.devices) == 3
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            ThreadedSession(2, device="cuda")
    with pytest.raises(ValueError, match="positive integer"):
        ThreadedSession(0)


def test_closed_session_refuses_work():
    sess = ThreadedSession(2)
    sess.close()
    sess.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        load_sharded({"a": np.zeros(2)}, REPLICATE, sess, progress=False)
    with pytest.raises(SessionClosedError) as info:
        load_sharded({"a": np.zeros(2)}, REPLICATE, sess, progress=False)
    assert (info.value.session, info.value.worker, info.value.param) == (
        "ThreadedSession",
        None,
        None,
    )
    assert str(info.value).startswith(
        "this ThreadedSession is closed (by close() or its with block ending, "
    )
    assert str(info.value).endswith("; open a new session to go on")


def test_thread_pieces_stay_readable_after_the_session_closes():
    """A ThreadedSession's pieces are in this process: closing it takes none of them."""
    params = {"w": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.ones(3, np.float32)}
    plan = {"w": [["shardload.split", [["num_shards", "4 // num_shards", 4], "float32"], 0]]}
    with ThreadedSession(2) as sess:
        result = load_sharded(params, plan, sess, progress=False)
    assert sess.closed
    assert torch.equal(result.shard("w", 1), torch.from_numpy(params["w"][2:]))
    assert torch.equal(result.worker(0)["b"], torch.ones(3))
    assert set(result.worker(1)) == {"w", "b"}


def test_cupy_functions_need_cuda_and_cupy_is_imported_lazily():
    import sys

    @register_shard_func("tests.loader.cupy_split", array="cupy")
    def cupy_split(input, output):
        output[...] = input.reshape(output.shape)

    assert "cupy" not in sys.modules  # registering does not import it
    plan = {"w": [["tests.loader.cupy_split", [[2, 4], "float32"]]]}
    with pytest.raises(PlanError) as info:
        load_on_threads({"w": np.zeros(8, np.float32)}, plan, 2)
    assert "need CUDA devices" in str(info.value) and info.value.param == "w"


@pytest.mark.parametrize(
    "cuda, wheel",
    [("13.0", "cupy-cuda13x"), ("12.8", "cupy-cuda12x"), (None, "cupy-cuda12x, cupy-cuda13x")],
)
def test_cuda_workers_without_cupy_are_told_the_wheel_of_their_cuda(monkeypatch, cuda, wheel):
    """On CUDA workers a cupy function needs ``import cupy``; which wheel gives it depends on
    the CUDA torch is built for (the GPU machine's is 13: cupy-cuda13x), said before a read."""
    import importlib.util

    from shardload import loader
    from shardload.plan import ShardInfo
    from shardload.readers.base import TensorMeta

    @register_shard_func("tests.loader.cupy_copy", array="cupy")
    def cupy_copy(input, output):
        output[...] = input

    monkeypatch.setattr(torch.version, "cuda", cuda)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a)
    )
    plan = ShardInfo.coerce(
        {"w": [["tests.loader.cupy_copy", [["num_shards", "8 // num_shards"], "float32"]]]}
    ).bind(2)
    validated = plan.validate({"w": TensorMeta("w", (8,), "float32")})
    with pytest.raises(PlanError, match=f"cupy is not installed: pip install .*{wheel}") as info:
        loader._check_devices(list(validated), [torch.device("cuda:0")] * 2, "plan.json")
    assert info.value.param == "w"
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("cupy") is not None:  # where cupy is installed, CUDA workers are let through
        loader._check_devices(list(validated), [torch.device("cuda:0")] * 2, "plan.json")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_workers_get_the_same_shards_as_cpu_workers():
    n = 4
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(n)]  # workers may share
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float16)
    plan = {
        "x": [["shardload.split", [["num_shards", "64 // num_shards", 32], "float16"], 0]],
        "y": [
            ["shardload.replicate", [["num_shards", 64, 32], "float16"]],
            ["shardload.split", [["num_shards", 1, 64, 32], "float16"], 0],
        ],
    }
    cpu = load_on_threads({"x": x, "y": x}, plan, n)
    with ThreadedSession(n, device=devices) as sess:
        gpu = load_sharded({"x": x, "y": x}, plan, sess, progress=False)
    for i in range(n):
        for name in ("x", "y"):
            piece = gpu.shard(name, i)
            assert piece.device == torch.device(devices[i])
            assert torch.equal(piece.cpu(), cpu.shard(name, i))
