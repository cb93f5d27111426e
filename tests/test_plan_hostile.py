"""Hostile plans get a clean, fast answer: a ``PlanError`` naming the plan file, the parameter and
step where they apply, what was found and the stated limit. Never a hang, a traceback, a
multi-GB allocation or a message that echoes a 50 MB input back.

The big cases generate their plans here (tens of MB) and bound their CPU time only loosely: the
point is not hanging or going quadratic, not a benchmark.
"""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from shardload import (
    PlanError,
    ShardInfo,
    ShardloadError,
    UnknownShardFunctionError,
    get_shard_func,
    register_shard_func,
)
from shardload.plan import (
    MAX_DIM,
    MAX_DIMS,
    MAX_EXPRESSIONS,
    MAX_EXTRA_ARGS,
    MAX_NUM_SHARDS,
    MAX_PARAMS,
    MAX_PLAN_BYTES,
    MAX_STEPS,
    Plan,
)
from shardload.plan import limits as plan_limits
from shardload.readers import ArrayCheckpoint

#: a generous bound on the CPU time of each big case (this process's: a busy machine stretches
#: wall time, not work). Measured on 2 shared cores: 0.2-0.6 s each, 1.9 s for 400k params;
#: quadratic ones took minutes.
CPU_S = 30.0
#: a wall-clock watchdog for the cases that could block (a FIFO): they answer at once
HANG_S = 60
#: the longest message a hostile input may produce
SHORT = 2000

SPLIT = ["shardload.split", [["num_shards", "8 // num_shards", 4], "float16"], 0]
CKPT = ArrayCheckpoint({"w": np.zeros((8, 4), np.float16), "v": np.zeros((4,), np.int32)})


def write(tmp_path, data, name="shard_info.json") -> str:
    path = tmp_path / name
    if isinstance(data, (bytes, str)):
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    else:
        with open(path, "w") as f:
            json.dump(data, f)
    return str(path)


def refused(call, *, phrase: str, **fields) -> PlanError:
    """``call()`` raises exactly a PlanError with ``phrase`` in its message and the given
    attributes; the message is short and printable to a UTF-8 terminal."""
    with pytest.raises(PlanError) as info:
        call()
    err = info.value
    message = str(err)
    assert phrase in message, message
    for key, want in fields.items():
        assert getattr(err, key) == want, (key, getattr(err, key), message)
    assert len(message) < SHORT, message[:300]
    message.encode("utf-8")  # no lone surrogate
    return err


def validate(plan: dict, n: int = 2, ckpt=CKPT, source="p.json"):
    return ShardInfo.from_dict(plan, source=source).bind(n).validate(ckpt.metadata())


# ---- 1. the plan file's path ------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_dev_zero_is_refused_without_reading_it():
    err = refused(
        lambda: ShardInfo.load("/dev/zero"), phrase="character device", source="/dev/zero"
    )
    assert "not a regular file" in str(err)


@contextmanager
def no_hang(seconds: float = HANG_S):
    """Fail (TimeoutError) instead of hanging the suite if the block does not end in time."""

    def hung(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    with no_hang():  # opening a FIFO with no writer blocks for ever; refused, it takes 1 ms
        refused(lambda: ShardInfo.load(fifo), phrase="FIFO", source=str(fifo))


def test_directory_is_refused_by_load_and_coerce(tmp_path):
    refused(lambda: ShardInfo.load(tmp_path), phrase="is a directory", source=str(tmp_path))
    refused(lambda: ShardInfo.coerce(str(tmp_path)), phrase="is a directory")
    refused(lambda: ShardInfo.coerce(tmp_path), phrase="is a directory")


def test_symlink_loop_is_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    os.symlink(b, a)
    os.symlink(a, b)
    refused(lambda: ShardInfo.load(a), phrase="symlink loop", source=str(a))


def test_symlink_to_a_regular_plan_loads(tmp_path):
    target = write(tmp_path, {"w": [SPLIT]}, "real.json")
    link = tmp_path / "shard_info.json"
    os.symlink(target, link)
    assert list(ShardInfo.load(link).steps) == ["w"]


@pytest.mark.skipif(
    os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root reads any file"
)
def test_unreadable_plan_is_refused(tmp_path):
    path = write(tmp_path, {"w": [SPLIT]})
    os.chmod(path, 0)
    refused(lambda: ShardInfo.load(path), phrase="permission denied", source=path)


def test_plan_over_the_cap_is_refused_before_reading(tmp_path):
    assert MAX_PLAN_BYTES == 256 << 20
    path = tmp_path / "shard_info.json"
    with open(path, "wb") as f:  # sparse: nothing is written, and nothing must be read
        f.truncate(MAX_PLAN_BYTES + 1)
    refused(
        lambda: ShardInfo.load(path),
        phrase=f"over the {MAX_PLAN_BYTES}-byte limit",
        source=str(path),
    )


# ---- 2. JSON must be UTF-8, finite, valid Unicode ------------------------------------------------

PLAN_TEXT = json.dumps({"w": [SPLIT]})


@pytest.mark.parametrize(
    "data, phrase",
    [
        (PLAN_TEXT.encode("utf-16"), "UTF-16 byte order mark"),
        (PLAN_TEXT.encode("utf-16-le"), "looks like UTF-16 or UTF-32"),
        (PLAN_TEXT.encode("utf-16-be"), "looks like UTF-16 or UTF-32"),
        (PLAN_TEXT.encode("utf-32"), "UTF-32 byte order mark"),
        (PLAN_TEXT.encode("utf-32-be"), "looks like UTF-16 or UTF-32"),
        (b"\xef\xbb\xbf" + PLAN_TEXT.encode(), "byte order mark"),
        (PLAN_TEXT.encode("latin-1").replace(b'"w"', b'"\xe9"'), "not UTF-8"),
    ],
)
def test_only_utf8_is_json(tmp_path, data, phrase):
    path = write(tmp_path, data)
    refused(lambda: ShardInfo.load(path), phrase=phrase, source=path)


def test_bom_in_a_str_is_refused():
    refused(lambda: ShardInfo.loads("\ufeff" + PLAN_TEXT), phrase="byte order mark")


@pytest.mark.parametrize(
    "text",
    [
        '{"__metadata__": {"scale": 1e400}, "w": []}',
        '{"__metadata__": {"deep": [[{"x": -1e400}]]}}',
        '{"w": [["shardload.split", [[2, 4, 4], "float16"], 1e400]]}',
        '{"w": [["shardload.split", [[2, 4, 4], "float16"], 1' + "0" * 400 + ".5]]}",
    ],
)
def test_numbers_overflowing_to_infinity_are_refused(tmp_path, text):
    path = write(tmp_path, text)
    refused(lambda: ShardInfo.load(path), phrase="out of the float64 range", source=path)


def test_huge_integer_literal_is_a_plan_error(tmp_path):
    path = write(
        tmp_path, '{"w": [["shardload.split", [[2, 4, 4], "float16"], ' + "9" * 5000 + "]]}"
    )
    refused(lambda: ShardInfo.load(path), phrase="not valid JSON", source=path)


@pytest.mark.parametrize(
    "text, phrase",
    [
        ('{"\\ud800": []}', "lone UTF-16 surrogate"),
        ('{"w\\udfff": [["shardload.split", [[2, 4, 4], "float16"], 0]]}', "lone UTF-16 surrogate"),
        ('{"w": [["shardload.\\udc00split", [[2, 4, 4], "float16"], 0]]}', "lone UTF-16 surrogate"),
        ('{"__metadata__": {"note": "\\ud83d"}}', "lone UTF-16 surrogate"),
        ('{"__metadata__": {"\\ude00": 1}}', "lone UTF-16 surrogate"),
    ],
)
def test_lone_surrogates_are_refused_and_the_message_prints(tmp_path, text, phrase):
    path = write(tmp_path, text)
    refused(lambda: ShardInfo.load(path), phrase=phrase, source=path)


def test_surrogate_pairs_are_fine():
    info = ShardInfo.loads('{"\\ud83d\\ude00": [], "__metadata__": {"x": "\\ud83d\\ude00"}}')
    assert list(info.steps) == ["\U0001f600"] and info.metadata == {"x": "\U0001f600"}


@pytest.mark.parametrize(
    "plan, phrase",
    [
        ({"\ud800": []}, "not valid Unicode"),
        ({"w": [["shardload.\udc00", [[2], "int32"]]]}, "not valid Unicode"),
        ({"__metadata__": {"x": "\ud800"}}, "not valid Unicode"),
        ({"__metadata__": {"x": [1.0, float("inf")]}}, "inf, which is not a JSON number"),
        ({"__metadata__": {"x": float("nan")}}, "nan, which is not a JSON number"),
        ({"__metadata__": {"x": {1, 2}}}, "a set, which is not a JSON value"),
        ({"__metadata__": {1: "x"}}, "keys must be strings"),
        ({"__metadata__": [1]}, "__metadata__ must be a JSON object, got list"),
        ({"__metadata__": "x"}, "__metadata__ must be a JSON object, got str"),
        ({"w": [["f", [[2], "int32"], float("inf")]]}, "within the int64 range"),
        ({"w": [["f", [[2], "int32"], float("nan")]]}, "within the int64 range"),
    ],
)
def test_python_dicts_are_held_to_json(plan, phrase):
    refused(lambda: ShardInfo.from_dict(plan, source="mem"), phrase=phrase, source="mem")


# ---- 3. size and time ----------------------------------------------------------------------------


def test_stated_limits():
    assert (MAX_NUM_SHARDS, MAX_STEPS, MAX_DIMS, MAX_DIM) == (4096, 16, 64, 2**53)
    assert MAX_EXTRA_ARGS == MAX_PARAMS == 1 << 20 and MAX_EXPRESSIONS == 1 << 16


def test_too_many_extra_args():
    step = ["shardload.take_units", [[2, 4], "float16"], 0, 1] + [0] * (MAX_EXTRA_ARGS - 1)
    refused(
        lambda: ShardInfo.from_dict({"w": [step]}, source="p.json"),
        phrase=f"{MAX_EXTRA_ARGS + 1} extra args, more than the {MAX_EXTRA_ARGS}",
        source="p.json",
        param="w",
        step=0,
    )


def test_too_many_dims():
    step = ["shardload.replicate", [[1] * (MAX_DIMS + 1), "float16"]]
    refused(
        lambda: ShardInfo.from_dict({"ok": [], "w": [SPLIT, step]}, source="p.json"),
        phrase=f"out_shape has {MAX_DIMS + 1} dims, more than the {MAX_DIMS}",
        source="p.json",
        param="w",
        step=1,
    )
    ShardInfo.from_dict({"w": [["shardload.replicate", [[1] * MAX_DIMS, "float16"]]]})


def test_too_many_steps():
    refused(
        lambda: ShardInfo.from_dict({"w": [SPLIT] * (MAX_STEPS + 1)}, source="p.json"),
        phrase=f"{MAX_STEPS + 1} steps, more than the {MAX_STEPS}",
        param="w",
    )


def test_too_many_params(monkeypatch):
    monkeypatch.setattr(plan_limits, "MAX_PARAMS", 10)
    plan = {f"p{i}": [] for i in range(11)}
    refused(
        lambda: ShardInfo.from_dict({"__metadata__": {}, **plan}, source="p.json"),
        phrase="names 11 parameters, more than the 10",
        source="p.json",
    )
    del plan["p0"]
    ShardInfo.from_dict({"__metadata__": {}, **plan})  # the metadata key is no parameter


def test_too_many_distinct_expressions(monkeypatch):
    monkeypatch.setattr(plan_limits, "MAX_EXPRESSIONS", 10)
    same = ["shardload.take_units", [["num_shards", 4], "float16"], 0, 1] + ["0 * num_shards"] * 50
    ShardInfo.from_dict({"w": [same]})  # one expression 50 times is one expression
    distinct = [f"{i} // num_shards" for i in range(11)]
    step = ["shardload.take_units", [["num_shards", 4], "float16"], 0, 1] + distinct
    refused(
        lambda: ShardInfo.from_dict({"w": [step]}, source="p.json"),
        phrase="more than 10 distinct num_shards expressions",
        param="w",
        step=0,
    )


def test_expressions_are_parsed_once_per_plan(monkeypatch):
    from shardload import symbolic

    calls = []
    real = symbolic.compile
    monkeypatch.setattr(symbolic, "compile", lambda text: calls.append(text) or real(text))
    steps = {f"w{i}": [SPLIT] for i in range(1000)}
    info = ShardInfo.from_dict(steps)
    assert sorted(calls) == ["8 // num_shards", "num_shards"]
    plan = info.bind(4)
    assert len(calls) == 2 and plan.params["w999"][0].out_shape == (4, 2, 4)


def timed(call):
    start = time.process_time()
    try:
        call()
    finally:
        cpu = time.process_time() - start
        assert cpu < CPU_S, f"took {cpu:.1f} s of CPU"


def test_50mb_plan_with_15m_expression_args_in_one_step(tmp_path):
    args = ["num_shards % 4 - 1 + 0 * num_shards"] * 1_500_000
    path = write(
        tmp_path, {"w": [["shardload.take_units", [["num_shards", 4], "float16"], 0, 1, *args]]}
    )
    assert 50_000_000 < os.path.getsize(path) < MAX_PLAN_BYTES
    timed(
        lambda: refused(
            lambda: ShardInfo.load(path),
            phrase="1500002 extra args, more than",
            source=path,
            param="w",
            step=0,
        )
    )


def test_25m_dims_in_one_out_shape(tmp_path):
    path = write(
        tmp_path,
        {"w": [["shardload.split", [["num_shards"] + ["1"] * 2_500_000 + [8], "float16"], 0]]},
    )
    timed(
        lambda: refused(
            lambda: ShardInfo.load(path),
            phrase="2500002 dims, more than the 64",
            source=path,
            param="w",
            step=0,
        )
    )


def test_plan_at_the_arg_cap_binds_and_validates_in_time(tmp_path):
    units = 1 << 19
    args = ["num_shards - 2"] * (MAX_EXTRA_ARGS - 2)  # every worker: unit 0 (N=2), 2**19 each
    path = write(
        tmp_path,
        {"w": [["shardload.take_units", [["num_shards", units, 4], "float16"], 0, 1, *args]]},
    )
    ckpt = ArrayCheckpoint({"w": torch.empty((units, 4), dtype=torch.float16)})

    def run():
        plan = ShardInfo.load(path).bind(2)
        # the shape rule sees 2**20 - 2 indices, 2**19 - 1 per worker: not the declared 2**19
        refused(
            lambda: plan.validate(ckpt.metadata()),
            phrase="disagrees with",
            source=path,
            param="w",
            step=0,
        )

    timed(run)


@pytest.mark.slow
def test_400k_params_the_checkpoint_lacks(tmp_path):
    plan = {f"model.layers.{i}.mlp.x": [SPLIT] for i in range(400_000)}
    path = write(tmp_path, plan)
    assert os.path.getsize(path) > 40_000_000

    def run():
        plan = ShardInfo.load(path).bind(2)
        err = refused(
            lambda: plan.validate(CKPT.metadata()),
            phrase="no tensor named 'model.layers.0.mlp.x'",
            source=path,
            param="model.layers.0.mlp.x",
        )
        assert "and 399999 more" in str(err)

    timed(run)


def test_100k_long_missing_names(tmp_path):
    path = write(tmp_path, {f"{i:06d}" + "x" * 480: [] for i in range(100_000)})
    assert os.path.getsize(path) > 49_000_000
    timed(
        lambda: refused(
            lambda: ShardInfo.load(path).bind(2).validate(CKPT.metadata()),
            phrase="and 99999 more",
            source=path,
        )
    )


def test_did_you_mean_in_a_big_checkpoint_is_quick():
    names = [
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"
        for layer in range(20)
        for e in range(64)
        for p in ("gate", "up", "down")
    ]
    ckpt = ArrayCheckpoint({n: np.zeros(1, np.float16) for n in names})
    start = time.process_time()
    refused(
        lambda: validate({"model.layers.3.mlp.experts.7.gate_proj.weigth": []}, ckpt=ckpt),
        phrase="no tensor named 'model.layers.3.mlp.experts.7.gate_proj.weigth' (did you "
        "mean 'model.layers.3.mlp.experts.7.gate_proj.weight'?)",
    )
    assert time.process_time() - start < 5  # CPU time; measured 0.03 s
    err = refused(lambda: validate({"x" * 10_000: []}, ckpt=ckpt), phrase="no tensor named")
    assert "did you mean" not in str(err)


# ---- 4. chained growth and impossible shapes -----------------------------------------------------


def replicate_chain(k: int) -> list:
    steps, shape = [], [256, 256]
    for _ in range(k):
        shape = ["num_shards", *shape]
        steps.append(["shardload.replicate", [list(shape), "float32"]])
    return steps


BIG = ArrayCheckpoint({"w": np.zeros((256, 256), np.float32)})  # 256 KiB


def test_a_chain_of_replicates_is_bounded_by_the_stored_tensor():
    validate({"w": replicate_chain(1)}, 2, BIG)
    validate({"w": replicate_chain(2)}, 2, BIG)  # 1 MiB: within 2 x N x 256 KiB + slack
    err = refused(
        lambda: validate({"w": replicate_chain(11)}, 2, BIG),
        phrase="from a 262144-byte stored tensor",
        source="p.json",
        param="w",
        step=2,
    )
    assert "refusing to allocate" in str(err) and "2097152 bytes" in str(err)


def test_a_chain_of_replicates_of_a_tiny_tensor_is_refused_too():
    tiny = ArrayCheckpoint({"a": np.zeros((4, 8), np.float32)})  # 128 bytes
    steps = [["shardload.replicate", [[2] * k + [4, 8], "float32"]] for k in range(1, 12)]
    refused(
        lambda: validate({"a": steps}, 2, tiny),
        phrase="from a 128-byte stored tensor",
        param="a",
        step=9,
    )


def test_a_long_chain_is_refused_by_its_length():
    refused(
        lambda: validate({"w": replicate_chain(64)}, 2, BIG),
        phrase="64 steps, more than the 16",
        param="w",
    )


def test_growth_after_a_shrinking_step_is_still_bounded_by_the_stored_tensor():
    @register_shard_func("tests.hostile.anything")
    def anything(input, output):  # no shape rule: the declared shape is all we know
        pass

    tiny = ["tests.hostile.anything", [[1], "float32"]]
    huge = ["tests.hostile.anything", [["num_shards", 256, 256, 64], "float32"]]
    refused(lambda: validate({"w": [tiny, huge]}, 2, BIG), phrase="stored tensor", step=1)


def test_per_part_scales_expanded_to_rows_are_not_a_bomb():
    # 3 per-part FP8 scales -> one per row of a Llama-3-70B-sized fused qkv (10240 rows)
    ckpt = ArrayCheckpoint({"s": np.ones((3,), np.float32)})
    plan = {
        "s": [
            ["shardload.repeat_segments", [[10240, 1], "float32"], 8192, 1024, 1024],
            [
                "shardload.split_segments",
                [["num_shards", "10240 // num_shards", 1], "float32"],
                0,
                8192,
                64,
                1024,
                8,
                1024,
                8,
            ],
        ]
    }
    validate(plan, 8, ckpt)


@pytest.mark.parametrize(
    "shape, phrase",
    [
        ([MAX_DIM + 1], "beyond the 9007199254740992 (2**53)"),
        ([2**64], "beyond the 9007199254740992 (2**53)"),
        ([10**30], "beyond the 9007199254740992 (2**53)"),
    ],
)
def test_dims_beyond_2_53_are_refused_at_parse(shape, phrase):
    step = ["shardload.replicate", [shape, "float32"]]
    refused(
        lambda: ShardInfo.from_dict({"w": [step]}, source="p.json"),
        phrase=phrase,
        param="w",
        step=0,
    )


@pytest.mark.parametrize(
    "shape, phrase",
    [
        (["num_shards + 9007199254740991"], "beyond the 9007199254740992"),
        (
            ["num_shards", 0, 2**40, 2**30],
            "more than 2**63 - 1 bytes",
        ),  # zero-size, yet strides overflow
        (["num_shards", 2**31, 2**31, 2**31], "more than 2**63 - 1 bytes"),
        (["num_shards * 4611686018427387904"], "out of the int64 range"),
    ],
)
def test_shapes_no_tensor_can_have_are_refused_at_bind(shape, phrase):
    info = ShardInfo.from_dict({"w": [["shardload.replicate", [shape, "int8"]]]}, source="p.json")
    refused(lambda: info.bind(2), phrase=phrase, source="p.json", param="w", step=0)


# ---- 5. the number of workers --------------------------------------------------------------------


def test_num_shards_is_capped():
    assert ShardInfo.from_dict({}).bind(MAX_NUM_SHARDS).num_shards == MAX_NUM_SHARDS
    refused(
        lambda: ShardInfo.from_dict({}, source="p.json").bind(100_000),
        phrase="num_shards is 100000, more than the 4096 workers",
        source="p.json",
    )
    # the one check of the number of workers (limits.num_shards_problem), for plans too
    refused(
        lambda: ShardInfo.from_dict({}, source="p.json").bind(0),
        phrase="num_shards must be a positive integer, at most 4096, got 0",
        source="p.json",
    )
    refused(lambda: Plan(MAX_NUM_SHARDS + 1, {}), phrase="more than the 4096")


# ---- 6. names and values are quoted, never echoed whole ------------------------------------------


def test_a_50mb_parameter_name_is_cut_in_the_message():
    name = "w" * 50_000_000
    err = refused(lambda: validate({name: [SPLIT]}), phrase="(50000000 characters)")
    assert err.param == name


def test_a_100k_character_function_name():
    name = "shardload.split" + "x" * 100_000
    start = time.process_time()
    with pytest.raises(UnknownShardFunctionError) as info:
        validate({"w": [[name, [[2, 4, 4], "float16"], 0]]})
    assert time.process_time() - start < 5  # CPU time; measured under 0.01 s
    err = info.value
    assert err.name == name and err.suggestions == [] and isinstance(err, KeyError)
    assert (err.source, err.param, err.step) == ("p.json", "w", 0)
    assert len(str(err)) < SHORT and "(100015 characters)" in str(err)


def test_close_function_names_still_get_suggestions():
    with pytest.raises(UnknownShardFunctionError) as info:
        validate({"w": [["shardload.splitt", [[2, 4, 4], "float16"], 0]]})
    assert "shardload.split" in info.value.suggestions


@pytest.mark.parametrize(
    "step, phrase",
    [
        (["f" * 100_000, [[2], "int32"]], None),
        ([["x"] * 100_000, [[2], "int32"]], "function name must be a non-empty string"),
        (["f", [[2], "int32", "x" * 100_000]], "output spec must be [out_shape, dtype]"),
        (["f", [[2], "d" * 10_000_000]], "unknown dtype"),
        (["f", [["n" * 10_000], "int32"]], "longer than the 256-character limit"),
        (["f", [[[1] * 100_000], "int32"]], "out_shape[0] is [1, 1, 1"),
        (["f", [[2], "int32"], "x" * 1000], "extra arg 0"),
        (["f", [[2], "int32"], {"k" * 1000: 1}], "extra args must be JSON scalars"),
    ],
)
def test_parse_messages_are_short(step, phrase):
    if phrase is None:  # a long but well-formed name parses; it fails at validate
        with pytest.raises(UnknownShardFunctionError) as info:
            validate({"w": [step]})
        assert len(str(info.value)) < SHORT
        return
    refused(
        lambda: ShardInfo.from_dict({"w": [step]}, source="p.json"),
        phrase=phrase,
        param="w",
        step=0,
    )


def test_huge_arg_lists_are_cut_in_validate_messages():
    indices = [9] * 200_000  # out of range for the 8 rows
    err = refused(
        lambda: validate(
            {"w": [["shardload.take_units", [[2, 800_000, 4], "float16"], 0, 1, *indices]]}
        ),
        phrase="unit index 9 is out of range",
        param="w",
        step=0,
    )
    assert "(200002 items)" in str(err)
    err = refused(
        lambda: validate({"w": [["shardload.split", [[2, 4, 4], "float16"], *([0] * 100_000)]]}),
        phrase="takes 1 extra arg(s), the step gives 100000",
    )
    assert "(100000 items)" in str(err)


def test_plain_integer_plan_for_many_ns_names_a_few():
    plan = {f"w{i}": [["shardload.replicate", [[i + 1], "int8"]]] for i in range(100)}
    err = refused(lambda: ShardInfo.from_dict(plan).bind(3), phrase="(100 values)")
    assert "num_shards=1, 2, 3, 4" in str(err)


# ---- 7. built-in shape rules: values and args out of range ---------------------------------------


@pytest.mark.parametrize(
    "dtype, value, phrase",
    [
        ("int64", 10**30, None),  # beyond int64: refused as a plan number already
        ("int32", 2**40, "does not fit int32"),
        ("int32", -(2**31) - 1, "does not fit int32"),
        ("uint8", 256, "does not fit uint8"),
        ("uint8", -1, "does not fit uint8"),
        ("int8", 128, "does not fit int8"),
        ("uint64", -1, "does not fit uint64"),
        ("int32", True, "must be an integer, got True"),
        ("int32", 2.0, "must be an integer, got 2.0"),
        ("int32", None, "must be an integer, got None"),
    ],
)
def test_constant_values_must_fit_the_dtype(dtype, value, phrase):
    ckpt = ArrayCheckpoint({"v": torch.zeros(2, dtype=getattr(torch, dtype))})
    plan = {"v": [["shardload.constant", [["num_shards", 2], dtype], value, 7]]}
    if phrase is None:
        refused(lambda: validate(plan, 2, ckpt), phrase="within the int64 range", param="v")
        return
    refused(lambda: validate(plan, 2, ckpt), phrase=phrase, source="p.json", param="v", step=0)


@pytest.mark.parametrize(
    "dtype, values",
    [
        ("int32", (2**31 - 1, -(2**31))),
        ("uint8", (255, 0)),
        ("int64", (2**63 - 1, -(2**63))),
        ("uint32", (2**32 - 1, 0)),
        ("uint64", (2**64 - 1, 2**63)),
    ],
)
def test_constant_values_at_the_edges_are_exact(dtype, values):
    func = get_shard_func("shardload.constant")
    x = torch.zeros(2, dtype=getattr(torch, dtype))
    shape, out_dtype = func.shape_rule((2,), dtype, *values, num_shards=3)
    out = torch.empty(shape, dtype=getattr(torch, out_dtype))
    func.func(x, *values, out)
    if dtype == "uint64":  # no arithmetic on uint64 in torch: compare the bits
        got = [[v % 2**64 for v in row] for row in out.view(torch.int64).tolist()]
    else:
        got = out.tolist()
    assert got == [list(values)] * 3


@pytest.mark.parametrize(
    "step, phrase",
    [
        (
            [
                "shardload.split_segments",
                [["num_shards", 4, 4], "float16"],
                0,
                *([0, 1] * 256),
                8,
                2,
            ],
            "257 segments, more than the 256",
        ),
        (
            [
                "shardload.repeat_segments",
                [["0 * num_shards + 9007199254740992", 1], "float16"],
                2**53,
                1,
            ],
            "beyond the 9007199254740992",
        ),
        (
            ["shardload.take_units", [["num_shards", 4, 4], "float16"], 0, -1, 0, 1],
            "not a whole number of units of -1",
        ),
        (
            ["shardload.take_units", [["num_shards", 1, 4], "float16"], 0, 1, 0, 8],
            "unit index 8 is out of range for 8 units",
        ),
        (
            ["shardload.take_units", [["num_shards", 1, 4], "float16"], 5, 1, 0, 1],
            "dim 5 is out of range",
        ),
        (["shardload.split", [["num_shards", 4, 4], "float16"], 2**62], "is out of range"),
        (["shardload.split", [["num_shards", 4, 4], "float16"], True], "must be an integer"),
        (
            ["shardload.split_segments", [["num_shards", 4, 4], "float16"], 0, 8, 0],
            "units 0 non-zero",
        ),
    ],
)
def test_builtin_args_out_of_range(step, phrase):
    ckpt = ArrayCheckpoint({"w": np.zeros((8, 4), np.float16), "s": np.zeros((2,), np.float16)})
    name = "s" if step[0] == "shardload.repeat_segments" else "w"
    refused(lambda: validate({name: [step]}, 2, ckpt), phrase=phrase, param=name, step=0)


@pytest.mark.parametrize(
    "exc",
    [
        IndexError("index 10 is out of range"),
        OverflowError("cannot fit"),
        ZeroDivisionError("by zero"),
        KeyError("k"),
    ],
)
def test_a_shape_rule_raising_becomes_a_plan_error(exc):
    def rule(in_shape, in_dtype, *extra, num_shards):
        raise exc

    register_shard_func("tests.hostile.raising", lambda input, output: None, shape_rule=rule)
    refused(
        lambda: validate({"w": [["tests.hostile.raising", [[2], "float16"]]]}),
        phrase="cannot apply to input [8, 4] float16",
        param="w",
        step=0,
    )


@pytest.mark.parametrize("result", [None, 7, ((2, 4), "int33"), ((2, 4),)])
def test_a_shape_rule_returning_garbage_becomes_a_plan_error(result):
    register_shard_func(
        "tests.hostile.garbage",
        lambda input, output: None,
        shape_rule=lambda in_shape, in_dtype, num_shards: result,
    )
    refused(
        lambda: validate({"w": [["tests.hostile.garbage", [[2], "float16"]]]}),
        phrase="cannot apply",
        param="w",
        step=0,
    )


def test_a_shape_rule_message_is_cut():
    def rule(in_shape, in_dtype, *extra, num_shards):
        raise ValueError("y" * 1_000_000)

    register_shard_func("tests.hostile.chatty", lambda input, output: None, shape_rule=rule)
    err = refused(
        lambda: validate({"w": [["tests.hostile.chatty", [[2], "float16"]]]}),
        phrase="(1000000 characters)",
    )
    assert isinstance(err, ShardloadError)


# ---- end to end ----------------------------------------------------------------------------------


def test_load_sharded_refuses_a_hostile_plan_before_starting_work(tmp_path):
    from shardload import ThreadedSession, load_sharded

    with ThreadedSession(num_workers=2, device="cpu") as session:
        refused(
            lambda: load_sharded(
                {"w": np.zeros((8, 4), np.float16)}, str(tmp_path), session, progress=False
            ),
            phrase="is a directory",
        )
        path = write(tmp_path, '{"__metadata__": {"x": 1e400}, "w": []}')
        refused(
            lambda: load_sharded(
                {"w": np.zeros((8, 4), np.float16)}, path, session, progress=False
            ),
            phrase="out of the float64 range",
        )
        plan = {"v": [["shardload.constant", [["num_shards", 2], "int32"], "num_shards", -7]]}
        sharded = load_sharded({"v": np.zeros(2, np.int32)}, plan, session, progress=False)
        assert sharded.shard("v", 1).tolist() == [2, -7]
