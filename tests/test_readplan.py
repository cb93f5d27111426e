"""Read plans: each worker reads only its own bytes, and what it reads is exactly what the
shard function, run on the whole tensor, would have given it.

The reference everywhere is the compute-then-slice path: the registered function itself run on
the whole stored tensor, keeping ``output[i]``. The read plans are checked against it for every
built-in with a ``ranges`` rule (from an in-memory checkpoint and from a safetensors file, where
the runs are real strided byte copies), for the planner's zero-padded plans, and for a plugin
that declares its own rule; and worker processes are checked to receive read plans and nothing
to parse.
"""

from __future__ import annotations

import math
import os

import helpers.readplan_plugins  # noqa: F401  (registers tests.readplan.*, here and in workers)
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shardload import (
    ArrayCheckpoint,
    ProcessSession,
    ShardInfo,
    ThreadedSession,
    WorkerError,
    get_shard_func,
    load_sharded,
    open_checkpoint,
)
from shardload.pieces import read_piece, run_steps
from shardload.readplan import ReadPlan, build_read_plans, read_plan_for

NS = (1, 2, 3, 4, 8)


def compute_then_slice(param, x: torch.Tensor) -> torch.Tensor:
    """The full output of ``param``'s steps on the whole tensor ``x`` (the reference)."""
    return run_steps([(s.func, s.out_shape, s.dtype, s.extra) for s in param.steps], x, param.name)


def check_reads_equal_compute(ckpt, plan, tensors: dict[str, torch.Tensor]) -> None:
    validated = plan.validate(ckpt.metadata())
    n = validated.num_shards
    for i in range(n):
        rp = read_plan_for(validated, ckpt, i)
        for piece in rp.pieces:
            param = validated.params[piece.name]
            assert piece.chain is None, f"{piece.name} is computed, not read"
            got = read_piece(ckpt, piece, n, i)
            want = (
                tensors[piece.name]
                if param.replicated
                else compute_then_slice(param, tensors[piece.name])[i]
            )
            assert got.dtype == want.dtype and torch.equal(got, want), (piece.name, n, i)
            # only its own bytes: a piece is exactly the bytes it keeps, minus zero padding
            assert piece.bytes_read <= piece.nbytes


def segments(n_q: int, n_kv: int, head: int) -> list:
    return [n_q * head, n_q, n_kv * head, -n_kv, n_kv * head, -n_kv]


# (name, stored shape, dtype, function, extra args as a function of N, the N it applies to)
BUILTIN_CASES = [
    ("split_rows", (24, 6), torch.float16, "shardload.split", lambda n: [0], (1, 2, 3, 4, 8)),
    ("split_cols", (5, 24), torch.int32, "shardload.split", lambda n: [1], (1, 2, 3, 4, 8)),
    ("split_mid", (2, 24, 3), torch.bfloat16, "shardload.split", lambda n: [1], (1, 2, 3, 4, 8)),
    ("split_last_neg", (3, 16), torch.uint8, "shardload.split", lambda n: [-1], (1, 2, 4, 8)),
    ("rebase", (32,), torch.int32, "shardload.split_rebase", lambda n: [0], (1, 2, 4, 8)),
    (
        "qkv_gqa",
        (8 * 4 + 2 * 2 * 4, 5),
        torch.float32,
        "shardload.split_segments",
        lambda n: [0, *segments(8, 2, 4)],
        (1, 2, 4, 8),
    ),
    (
        "qkv_cols",
        (3, 8 * 4 + 2 * 2 * 4),
        torch.int32,
        "shardload.split_segments",
        lambda n: [1, *segments(8, 2, 4)],
        (1, 2, 4, 8),
    ),
    ("replicate", (6, 4), torch.float16, "shardload.replicate", lambda n: [], NS),
    ("replicate_0d", (), torch.float32, "shardload.replicate", lambda n: [], NS),
    # worker i takes heads i, i + n, ... and a zero head where the 5 run out
    (
        "take_padded",
        (5 * 3, 4),
        torch.float16,
        "shardload.take_units",
        lambda n: [
            0,
            3,
            *[h if h < 5 else -1 for i in range(n) for h in range(i, math.ceil(5 / n) * n, n)],
        ],
        NS,
    ),
    (
        "take_cols",
        (4, 5 * 2),
        torch.int32,
        "shardload.take_units",
        lambda n: [
            1,
            2,
            *[(i * 2 + j) % 5 if (i + j) % 3 else -1 for i in range(n) for j in range(2)],
        ],
        NS,
    ),
    # packed 4-bit codes whose zero weight is code 8: zero units are 0x88888888 words
    (
        "take_fill",
        (5 * 3, 4),
        torch.int32,
        "shardload.take_units_fill",
        lambda n: [
            0,
            3,
            -0x77777778,
            *[h if h < 5 else -1 for i in range(n) for h in range(i, math.ceil(5 / n) * n, n)],
        ],
        NS,
    ),
]


def _tensor(shape, dtype) -> torch.Tensor:
    x = torch.arange(math.prod(shape), dtype=torch.int64) * 7 % 251
    if dtype == torch.int32 and shape == (32,):  # a g_idx: nondecreasing group indices
        x = torch.arange(32) // 4
    return x.reshape(shape).to(dtype)


def _plan(func: str, shape, dtype, extra, n: int):
    torch_dtype = str(dtype).split(".")[1]
    x = torch.empty(shape, dtype=dtype)
    rule = get_shard_func(func).shape_rule
    out_shape, out_dtype = rule(tuple(shape), torch_dtype, *extra, num_shards=n)
    return ShardInfo.from_dict({"x": [[func, [list(out_shape), out_dtype], *extra]]}).bind(n), x


@pytest.mark.parametrize("case", BUILTIN_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("stored", ["memory", "file"])
def test_every_builtin_reads_what_compute_then_slice_keeps(case, stored, tmp_path):
    _, shape, dtype, func, extra, ns = case
    x = _tensor(shape, dtype)
    if stored == "memory":
        ckpt = ArrayCheckpoint({"x": x})
    else:
        # other tensors around it: offsets are not 0, and the file's data has its header before it
        save_file(
            {
                "a": torch.ones(3, dtype=torch.int8),
                "x": x,
                "z": torch.zeros(5, dtype=torch.float64),
            },
            str(tmp_path / "m.safetensors"),
        )
        ckpt = open_checkpoint(str(tmp_path / "m.safetensors"))
    with ckpt:
        for n in ns:
            plan, _ = _plan(func, shape, dtype, extra(n), n)
            check_reads_equal_compute(
                ckpt,
                plan,
                {
                    "x": x,
                    "a": torch.ones(3, dtype=torch.int8),
                    "z": torch.zeros(5, dtype=torch.float64),
                },
            )


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_take_units_and_segments_at_random(data):
    n = data.draw(st.sampled_from(NS))
    unit = data.draw(st.integers(1, 3))
    units = data.draw(st.integers(1, 6))
    other = data.draw(st.integers(1, 3))
    dim = data.draw(st.sampled_from([0, 1]))
    per = data.draw(st.integers(1, 3))
    picks = data.draw(st.lists(st.integers(-1, units - 1), min_size=per * n, max_size=per * n))
    shape = (units * unit, other) if dim == 0 else (other, units * unit)
    x = _tensor(shape, torch.int32)
    plan, _ = _plan("shardload.take_units", shape, torch.int32, [dim, unit, *picks], n)
    check_reads_equal_compute(ArrayCheckpoint({"x": x}), plan, {"x": x})


def test_arrays_that_are_views_of_larger_ones_are_read_from_their_own_bytes():
    big = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    x = big[2:4]  # contiguous, but 16 floats into its storage
    plan = ShardInfo.from_dict({"x": [["shardload.split", [[2, 2, 4], "float32"], 1]]}).bind(2)
    check_reads_equal_compute(ArrayCheckpoint({"x": x}), plan, {"x": x})


def test_read_plans_travel_as_json_unchanged(tmp_path):
    x = _tensor((5 * 3, 4), torch.float16)
    save_file({"x": x}, str(tmp_path / "m.safetensors"))
    with open_checkpoint(str(tmp_path / "m.safetensors")) as ckpt:
        plan, _ = _plan(
            "shardload.take_units", (15, 4), torch.float16, [0, 3, 0, 2, 4, 1, 3, -1], 2
        )
        for rp in build_read_plans(plan.validate(ckpt.metadata()), ckpt):
            assert ReadPlan.from_json(rp.to_json()) == rp
            assert rp.sources[0].path.endswith("m.safetensors")


_OBJECT = {
    "url": "s3://b/m.safetensors",
    "size": 128,
    "etag": '"e"',
    "last_modified": "2026-01-01T00:00:00Z",
    "shared": "/proc/1/fd/5",
}


@pytest.mark.parametrize(
    "source",
    [
        {"file": "/m.safetensors", "identity": [1, 2, 3, 4]},
        {"file": "/m.safetensors", "identity": None, "object": _OBJECT},
        {"tensor": "w"},
    ],
)
def test_a_read_plans_sources_are_typed_and_travel_as_the_same_json(source):
    from shardload.pieces import wire
    from shardload.sources.specs import FileSource, TensorSource

    data = {"rank": 0, "num_shards": 1, "sources": [source], "pieces": []}
    plan = ReadPlan.from_json(data)
    assert isinstance(plan.sources[0], FileSource if "file" in source else TensorSource)
    assert plan.to_json() == data
    assert wire.encode(plan)["sources"] == [source]
    assert wire.decode(wire.encode(plan)) == plan


@pytest.mark.parametrize(
    "source, message",
    [
        ("m.safetensors", "source 0 is not an object: str"),
        ({"path": "/m"}, "source 0 names neither a 'file' nor a 'tensor'"),
        ({"file": 5}, "source 0: 'file' is not a path"),
        ({"file": "/m", "identity": [1, 2]}, "'identity' is not null or a list of 4 whole"),
        ({"file": "/m", "identity": None, "object": []}, "'object' is not an object"),
        ({"file": "/m", "object": {**_OBJECT, "size": "128"}}, "'object/size' is not a whole"),
        ({"file": "/m", "object": {**_OBJECT, "etag": None}}, "'object/etag' is not a string"),
        ({"file": "/m", "object": {**_OBJECT, "shared": 5}}, "'object/shared' is not a path"),
        ({"file": "/m", "mode": "w"}, "'mode' is not a field of a file source"),
        ({"tensor": ["w"]}, "'tensor' is not a string"),
    ],
)
def test_a_read_plans_malformed_source_is_refused_naming_its_field(source, message):
    # they were taken as they came, and failed later, far from the plan (a KeyError in the
    # worker, a path of 5 opened)
    from shardload.pieces import wire

    data = {"rank": 0, "num_shards": 1, "sources": [{"file": "/ok"}, source], "pieces": []}
    message = message.replace("source 0", "source 1")
    with pytest.raises(ValueError, match="a read plan's source 1") as refused:
        ReadPlan.from_json(data)
    assert message in str(refused.value)
    compact = {
        **wire.encode(ReadPlan.from_json({**data, "sources": []})),
        "sources": data["sources"],
    }
    with pytest.raises(ValueError, match="a read plan's source 1"):
        wire.decode(compact)


# ---- the planner's zero-padded plans -------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 5, 8])
def test_padded_plans_read_only_their_units(tmp_path, n):
    from helpers.quantized_models import PLAIN, THREE, write_model

    from shardload.planners import plan_for

    model = write_model(str(tmp_path), THREE, PLAIN[0])  # 12 query heads, 3 KV heads: padded
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt, num_shards=n)
        assert not info.is_symbolic and "tensor_parallel" in info.metadata
        tensors = {name: ckpt.read(name) for name in ckpt.names()}
        plan = info.bind(n)
        check_reads_equal_compute(ckpt, plan, tensors)
        validated = plan.validate(ckpt.metadata())
        sharded = sum(p.meta.nbytes for p in validated if not p.replicated)
        replicated = sum(p.meta.nbytes for p in validated if p.replicated)
        for rp in build_read_plans(validated, ckpt):
            # about 1/N of the sharded bytes (a padded worker reads less), never the whole
            assert rp.bytes_read - replicated <= math.ceil(sharded / n * 1.5)
        with ThreadedSession(n) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
        assert max(result.stats.bytes_read_per_worker) < sharded + replicated


# ---- a plugin that declares its own ranges ------------------------------------------------------


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plugin") / "model.safetensors")
    tensors = {
        "before": torch.arange(10, dtype=torch.float32),
        "w": torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3),
        "w2": torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3) + 1000,
    }
    save_file(tensors, path)
    return path, tensors


# threads at N = 1 (one block: the whole tensor), 2 and 4 (each worker its own row block, rows
# reversed, by the plugin's ranges rule and fixup); worker processes at N = 2 only: what
# processes change is where the plugin's rules run and that the computed step's bytes are read
# once per process, which N does not change (processes at N = 1 and 4 took 1.3 and 4.6 s for the
# same paths)
@pytest.mark.parametrize("kind,n", [("thread", 1), ("thread", 2), ("thread", 4), ("process", 2)])
def test_a_plugin_with_a_ranges_rule_reads_only_its_bytes(plugin_file, kind, n):
    path, tensors = plugin_file
    out = [[n, 16 // n, 3], "float32"]
    info = {
        "w": [["tests.readplan.blocks_reversed", out]],
        "w2": [["tests.readplan.blocks_reversed_computed", out]],
    }
    plan = ShardInfo.from_dict(info).bind(n)
    Session = ThreadedSession if kind == "thread" else ProcessSession
    kwargs = {} if kind == "thread" else {"plugins": ["helpers.readplan_plugins"]}
    with Session(n, **kwargs) as sess, open_checkpoint(path) as ckpt:
        validated = plan.validate(ckpt.metadata())
        reads = build_read_plans(validated, ckpt)
        result = load_sharded(ckpt, info, sess, progress=False)
        want_w = compute_then_slice(validated.params["w"], tensors["w"])
        want_w2 = compute_then_slice(validated.params["w2"], tensors["w2"])
        for i in range(n):
            assert torch.equal(result.shard("w", i), want_w[i])
            assert torch.equal(result.shard("w2", i), want_w2[i])
            piece = {p.name: p for p in reads[i].pieces}
            assert piece["w"].chain is None and piece["w2"].chain is not None
            assert piece["w"].bytes_read == 16 // n * 3 * 4  # its rows, nothing else
        stats = result.stats
        whole = 16 * 3 * 4
        before = 10 * 4  # replicated
        if kind == "process":
            # each worker process reads its rows of w, all of w2 (computed), all of "before"
            assert stats.bytes_read_per_worker == [16 // n * 3 * 4 + whole + before] * n
        else:
            # threads compute w2 once and share it: its bytes are counted once in all
            assert sum(stats.bytes_read_per_worker) == n * (16 // n * 3 * 4 + before) + whole


@pytest.mark.slow
def test_a_worker_process_gets_a_read_plan_and_parses_nothing(plugin_file):
    path, tensors = plugin_file
    info = {"w": [["shardload.split", [[2, 8, 3], "float32"], 0]]}
    with ProcessSession(2, plugins=["helpers.readplan_plugins"]) as sess:
        result = load_sharded(path, info, sess, progress=False)
        assert torch.equal(result.shard("w", 1), tensors["w"][8:])
        # the worker carried out its read plan (byte runs of a file it mapped) without the
        # plan parser, the planners, the loader or the safetensors header reader
        never = [
            "shardload.plan",
            "shardload.planners",
            "shardload.loader",
            "shardload.readers.safetensors",
            "shardload.readers.gguf",
            "shardload.readers.mlc",
            "shardload.cli",
        ]
        assert sess.call("tests.readplan.imported", never) == [[], []]
        assert sess.call("tests.readplan.sum_of", "w") == [
            float(tensors["w"][:8].sum()),
            float(tensors["w"][8:].sum()),
        ]


@pytest.mark.slow
def test_a_file_changed_before_the_workers_map_it_is_refused(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file({"w": torch.zeros(8, 4)}, path)
    with open_checkpoint(path) as ckpt, ProcessSession(2) as sess:
        os.utime(path, ns=(1, 1))  # the controller has it open; the file is then touched
        with pytest.raises(WorkerError) as err:
            load_sharded(
                ckpt, {"w": [["shardload.split", [[2, 4, 4], "float32"], 0]]}, sess, progress=False
            )
        assert "the file changed" in str(err.value) and sorted(err.value.workers) == [0, 1]


@pytest.mark.slow
def test_worker_processes_free_the_pieces_of_dropped_results(plugin_file):
    import gc

    path, tensors = plugin_file
    info = {"w": [["shardload.split", [[2, 8, 3], "float32"], 0]]}
    with ProcessSession(2, plugins=["helpers.readplan_plugins"]) as sess:
        first = load_sharded(path, info, sess, progress=False)
        second = load_sharded(path, info, sess, progress=False)
        assert sess.call("tests.readplan.loads_held") == [2, 2]
        del first
        gc.collect()
        third = load_sharded(path, info, sess, progress=False)  # frees the dropped one first
        assert sess.call("tests.readplan.loads_held") == [2, 2]
        assert torch.equal(second.shard("w", 1), third.shard("w", 1))


def test_a_ranges_rule_that_disagrees_with_its_function_is_a_plan_error():
    from shardload import PlanError, Selection, register_shard_func

    def rule(in_shape, in_dtype, *, num_shards):
        return (num_shards, in_shape[0] // num_shards, *in_shape[1:]), in_dtype

    def one_row_too_many(in_shape, in_dtype, *, num_shards, index):
        rows = in_shape[0] // num_shards
        return Selection(0, ((index * rows, rows + 1),))

    register_shard_func(
        "tests.readplan.wrong_ranges", lambda x, out: None, shape_rule=rule, ranges=one_row_too_many
    )
    plan = {"x": [["tests.readplan.wrong_ranges", [[2, 4, 3], "float32"]]]}
    with ThreadedSession(2) as sess, pytest.raises(PlanError) as err:
        load_sharded({"x": torch.zeros(8, 3)}, plan, sess, progress=False)
    assert "disagrees with the function" in str(err.value)
    assert err.value.param == "x" and err.value.step == 0


# ---- checkpoints the real tools wrote ----------------------------------------------------------


def test_the_published_smollm2_gguf_padded_at_4_reads_its_own_units(smollm2):
    # a real llama.cpp-quantized file (Q4_1 blocks, mixed types) and the planner's padded plan:
    # every worker's read plan gives what computing each tensor whole and slicing it gives
    from shardload.planners import plan_for

    with open_checkpoint(smollm2) as ckpt:
        info = plan_for(ckpt, num_shards=4)
        assert "tensor_parallel" in info.metadata  # 9 query / 3 KV heads: padded
        plan = info.bind(4)
        tensors = {name: ckpt.read(name) for name in ckpt.names()}
        check_reads_equal_compute(ckpt, plan, tensors)
        validated = plan.validate(ckpt.metadata())
        sharded = sum(p.meta.nbytes for p in validated if not p.replicated)
        replicated = sum(p.meta.nbytes for p in validated if p.replicated)
        for rp in build_read_plans(validated, ckpt):
            assert rp.bytes_read - replicated <= sharded * 0.3  # about 1/4, never all of it


@pytest.mark.parametrize("n", [2, 3])
def test_a_transformers_checkpoint_reads_equal_compute(tmp_path, n):
    # written by transformers' save_pretrained; N=3 is padded (4 query heads, 2 KV heads)
    import transformers

    from shardload.planners import plan_for

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with open_checkpoint(str(tmp_path)) as ckpt:
        plan = plan_for(ckpt, num_shards=n).bind(n)
        check_reads_equal_compute(ckpt, plan, {k: ckpt.read(k) for k in ckpt.names()})


# ---- a run's arithmetic --------------------------------------------------------------------


def test_a_run_of_blocks_back_to_back_is_checked_over_all_of_them():
    # stride 0 (or dst_stride 0) means blocks back to back, as the copies read it; the bounds
    # check once read it as one block, so a run reaching past its source or piece passed it
    # and failed later in numpy or torch, not as the parameter's error
    from shardload.errors import ShardloadError
    from shardload.readplan import Run, check_run

    back_to_back = Run(0, 0, 8, count=2)
    assert (back_to_back.step, back_to_back.end, back_to_back.spans()) == (8, 16, [(0, 16)])
    assert back_to_back.dst_end == 16
    check_run(back_to_back, 16, 16, "w")
    for source_len, dst_len in ((8, 16), (16, 8)):
        with pytest.raises(ShardloadError, match="parameter 'w'.*outside"):
            check_run(back_to_back, source_len, dst_len, "w")
    strided = Run(0, 4, 2, count=3, stride=6, dst_offset=1, dst_stride=3)
    assert (strided.end, strided.dst_end) == (18, 9)
    assert strided.spans() == [(4, 6), (10, 12), (16, 18)]
    with pytest.raises(ShardloadError, match="malformed"):
        check_run(Run(0, 0, 8, count=0), 16, 16, "w")
