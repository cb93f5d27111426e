"""Plans: parsing, binding to N, validation against checkpoint metadata, and the JSON Schema."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from helpers.plan_corpus import INVALID, SPLIT_W, VALID

from shardload import PlanError, ShardInfo, UnknownShardFunctionError, register_shard_func
from shardload.errors import cli_text
from shardload.plan import json_schema
from shardload.readers import ArrayCheckpoint, TensorMeta


def meta(**tensors):
    """{name: TensorMeta} from name=(shape, dtype)."""
    return {k: TensorMeta(k, tuple(s), d) for k, (s, d) in tensors.items()}


W_META = meta(w=((8, 4), "float16"), b=((4,), "float32"))


def write(tmp_path, text, name="shard_info.json"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# ---- parse ---------------------------------------------------------------------------------------


def test_tvm_format_round_trips(tmp_path):
    plan = {
        "x_0": [["tests.disco.shard_dim_1", [[4, 64, 64], "float16"], 4]],
        "model.layers.0.mlp.down_proj.qweight": [["shardload.split", [[4, 344, 4096], "int32"], 0]],
    }
    path = write(tmp_path, json.dumps(plan))
    info = ShardInfo.load(path)
    assert info.source == path
    assert info.to_dict() == plan
    assert ShardInfo.loads(info.dumps()).to_dict() == plan
    assert not info.is_symbolic and info.planned_num_shards == 4


@pytest.mark.parametrize(
    "text, phrase",
    [
        ('{"w": [], "w": []}', "duplicate key 'w'"),
        ('{"w": [["shardload.split", [[NaN, 2], "float16"], 0]]}', "NaN"),
        ('{"w": [["shardload.split", [[Infinity, 2], "float16"], 0]]}', "Infinity"),
        ('{"w": [["shardload.split", [[2, 2], "float16"], -Infinity]]}', "-Infinity"),
        ('{"w": ', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        (b'{"w": "\xff"}', "not UTF-8"),
    ],
)
def test_json_level_errors_name_the_file(tmp_path, text, phrase):
    path = write(tmp_path, text)
    with pytest.raises(PlanError) as info:
        ShardInfo.load(path)
    assert info.value.source == path
    assert phrase in str(info.value) and path in str(info.value)


@pytest.mark.parametrize(
    "step, phrase",
    [
        ("shardload.split", "a step must be a list"),
        (["shardload.split"], "a step must be a list"),
        ([7, [[2], "int32"]], "function name must be a non-empty string"),
        (["f", [[2], "int32", 1]], "output spec must be [out_shape, dtype]"),
        (["f", [[2.0], "int32"]], "out_shape[0] is 2.0"),
        (["f", [[True], "int32"]], "out_shape[0] is True"),
        (["f", [[-1], "int32"]], "out_shape[0] is -1"),
        (["f", [["num_shards ** 2"], "int32"]], "out_shape[0]"),
        (["f", [["shards"], "int32"]], "unknown name 'shards'"),
        (["f", [[2], "int33"]], "unknown dtype 'int33'"),
        (["f", [[2], "int32"], [1, 2]], "extra arg 0"),
        (["f", [[2], "int32"], {"dim": 0}], "extra arg 0"),
        (["f", [[2], "int32"], 0, "qkv"], "extra arg 1"),
    ],
)
def test_step_structure_errors_name_param_and_step(step, phrase):
    with pytest.raises(PlanError) as info:
        ShardInfo.from_dict({"ok": [], "w": [["shardload.replicate", [[2], "int32"]], step]})
    err = info.value
    assert (err.param, err.step) == ("w", 1)
    assert phrase in str(err)


def test_empty_list_means_replicated():
    info = ShardInfo.from_dict({"b": []})
    validated = info.bind(3).validate(W_META)
    assert validated.params["b"].replicated and validated.params["w"].replicated
    assert validated.params["w"].piece_shape == (8, 4)


def test_oversized_plan_file_is_refused(tmp_path, monkeypatch):
    from shardload.plan import limits

    monkeypatch.setattr(limits, "MAX_PLAN_BYTES", 10)
    path = write(tmp_path, json.dumps(SPLIT_W))
    with pytest.raises(PlanError, match="over the 10-byte limit"):
        ShardInfo.load(path)
    with pytest.raises(PlanError, match="over the 10-byte limit"):
        ShardInfo.loads(json.dumps(SPLIT_W))


def test_missing_plan_file_is_a_plan_error(tmp_path):
    with pytest.raises(PlanError) as info:
        ShardInfo.load(tmp_path / "nope.json")
    assert "nope.json" in str(info.value)


# ---- bind ----------------------------------------------------------------------------------------


# the two ends of what the 8-row tensor allows (8 // num_shards is 8, then 1); 2 and 4 evaluate
# the same expressions the same way
@pytest.mark.parametrize("n", [1, 8])
def test_symbolic_plan_binds_for_every_n(n):
    plan = ShardInfo.from_dict(SPLIT_W).bind(n)
    step = plan.params["w"][0]
    assert step.out_shape == (n, 8 // n, 4) and step.extra == (0,)
    plan.validate(W_META)


def test_symbolic_extra_args_are_evaluated():
    info = ShardInfo.from_dict(
        {
            "w": [
                [
                    "shardload.split_segments",
                    [["num_shards", "8 // num_shards", 4], "float16"],
                    "num_shards - num_shards",
                    8,
                    "min(num_shards, 8)",
                ]
            ]
        }
    )
    assert info.bind(2).params["w"][0].extra == (0, 8, 2)


def test_concrete_plan_with_another_n_says_how_to_replan():
    info = ShardInfo.from_dict(
        {"w": [["shardload.split", [[4, 2, 4], "float16"], 0]]}, source="plan.json"
    )
    assert info.bind(4).num_shards == 4
    with pytest.raises(PlanError) as err:
        info.bind(2)
    message = str(err.value)
    assert "num_shards=4" in message and "num_shards=2" in message
    # the core says it in Python; the CLI prints the command instead (errors.cli_text)
    assert "`plan_for(checkpoint, num_shards=2)`" in message
    assert "expressions of num_shards" in message and "--shards" not in message
    assert "`shardload plan --shards 2`" in cli_text(err.value)
    assert "plan_for" not in cli_text(err.value)
    assert err.value.source == "plan.json"


def test_plan_without_sharded_params_binds_for_any_n():
    assert ShardInfo.from_dict({"b": []}).bind(7).num_shards == 7


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_bind_needs_a_positive_int(n):
    with pytest.raises(PlanError, match="positive integer"):
        ShardInfo.from_dict(SPLIT_W).bind(n)


def test_expression_going_negative_for_this_n():
    info = ShardInfo.from_dict(
        {"w": [["shardload.split", [["num_shards", "4 - num_shards", 4], "float16"], 0]]}
    )
    with pytest.raises(PlanError, match=r"out_shape\[1\] = '4 - num_shards' is -4"):
        info.bind(8)


def test_plan_is_immutable():
    plan = ShardInfo.from_dict(SPLIT_W).bind(2)
    with pytest.raises(TypeError):
        plan.params["x"] = ()
    with pytest.raises(AttributeError):
        plan.params["w"][0].out_shape = (1,)


# ---- validate ------------------------------------------------------------------------------------


def validate(plan: dict, n: int, metadata=W_META, source="p.json"):
    return ShardInfo.from_dict(plan, source=source).bind(n).validate(metadata)


def test_unknown_function_suggests_close_matches():
    with pytest.raises(UnknownShardFunctionError) as info:
        validate({"w": [["shardload.splt", [[2, 4, 4], "float16"], 0]]}, 2)
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, PlanError)
    assert (err.source, err.param, err.step, err.name) == ("p.json", "w", 0, "shardload.splt")
    assert "shardload.split" in err.suggestions
    assert "Did you mean 'shardload.split'" in str(err)
    assert "never imported" in str(err)


def test_unknown_function_in_a_later_step_names_that_step():
    with pytest.raises(UnknownShardFunctionError) as info:
        validate(
            {
                "w": [
                    ["shardload.replicate", [[2, 8, 4], "float16"]],
                    ["no.such.func", [[2, 8, 4], "float16"]],
                ]
            },
            2,
        )
    assert info.value.step == 1


def test_wrong_number_of_extra_args():
    with pytest.raises(PlanError) as info:
        validate({"w": [["shardload.split", [[2, 4, 4], "float16"], 0, 1]]}, 2)
    assert "takes 1 extra arg(s), the step gives 2" in str(info.value)
    assert (info.value.param, info.value.step) == ("w", 0)


def test_declared_shape_disagreeing_with_the_shape_rule():
    with pytest.raises(PlanError) as info:
        validate({"w": [["shardload.split", [[2, 8, 4], "float16"], 1]]}, 2)
    assert "declared output [2, 8, 4] float16 disagrees" in str(info.value)
    assert "makes [2, 8, 2] float16" in str(info.value)
    validate({"w": [["shardload.split", [[2, 8, 2], "float16"], 1]]}, 2)  # the corrected step


def test_declared_dtype_disagreeing_with_the_shape_rule():
    with pytest.raises(PlanError, match="declared output .* int32 disagrees"):
        validate({"w": [["shardload.split", [[2, 4, 4], "int32"], 0]]}, 2)


def test_shape_rule_refusal_is_reported_with_the_reason():
    with pytest.raises(PlanError) as info:
        validate({"w": [["shardload.split", [[3, 2, 4], "float16"], 0]]}, 3)
    assert "does not divide into 3 equal shards" in str(info.value)


def test_last_axis_0_must_be_n():
    @register_shard_func("tests.plan.identity")
    def identity(input, output):
        output.copy_(input)

    with pytest.raises(PlanError) as info:
        validate({"w": [["tests.plan.identity", [["4 * num_shards", 4], "float16"]]]}, 2)
    assert "must have num_shards=2 on axis 0, got 8" in str(info.value)
    assert info.value.step == 0


def test_plan_naming_a_missing_tensor():
    with pytest.raises(PlanError) as info:
        validate({"ww": [["shardload.split", [[2, 4, 4], "float16"], 0]]}, 2)
    assert info.value.param == "ww"
    assert "no tensor named 'ww'" in str(info.value) and "did you mean 'w'" in str(info.value)


def test_memory_bomb_is_refused_before_allocation():
    @register_shard_func("tests.plan.anything")
    def anything(input, output):  # no shape rule: the declared shape is all we know
        pass

    ok = {"w": [["tests.plan.anything", [[2, 16, 4], "float16"]]]}
    validate(ok, 2)  # 2x: fine
    with pytest.raises(PlanError) as info:
        validate({"w": [["tests.plan.anything", [[2, 10**6, 10**6], "float16"]]]}, 2)
    assert "refusing to allocate" in str(info.value)


def test_numpy_function_on_bfloat16_is_refused():
    @register_shard_func("tests.plan.np_split", array="numpy")
    def np_split(input, output):
        output[...] = np.stack(np.split(input, output.shape[0]))

    with pytest.raises(PlanError, match="numpy has no bfloat16"):
        validate(
            {"w": [["tests.plan.np_split", [[2, 4, 4], "bfloat16"]]]},
            2,
            metadata=meta(w=((8, 4), "bfloat16")),
        )


def test_validation_reads_no_tensor_data():
    ckpt = ArrayCheckpoint({"w": np.zeros((8, 4), np.float16)})
    ShardInfo.from_dict(SPLIT_W).bind(2).validate(ckpt.metadata())
    assert ckpt.bytes_read == 0


# ---- the JSON Schema agrees with the parser (the plans: helpers.plan_corpus) ---------------------


@pytest.mark.parametrize("plan", VALID)
def test_schema_and_parser_accept(plan):
    jsonschema.validate(plan, json_schema())
    ShardInfo.from_dict(plan)


@pytest.mark.parametrize("plan", INVALID)
def test_schema_and_parser_refuse(plan):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(plan, json_schema())
    with pytest.raises(PlanError):
        ShardInfo.from_dict(plan)


def test_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(json_schema())


def test_example_plan_matches_the_schema():
    from helpers.paths import EXAMPLE

    with open(f"{EXAMPLE}/shard_info.json") as f:
        jsonschema.validate(json.load(f), json_schema())


def test_metadata_is_kept_and_is_not_a_parameter():
    info = ShardInfo.from_dict(
        {
            "__metadata__": {"tensor_parallel": {"num_shards": 2}},
            "w": [["shardload.split", [[2, 4, 4], "float16"], 0]],
        }
    )
    assert list(info.steps) == ["w"]
    plan = info.bind(2)
    assert plan.metadata == {"tensor_parallel": {"num_shards": 2}}
    assert ShardInfo.loads(info.dumps()).metadata == info.metadata
    assert plan.to_dict()["__metadata__"] == info.metadata
    plan.validate(W_META)  # the metadata key matches no tensor, and needs not
