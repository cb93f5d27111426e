"""The plan is checked in one place: the shipped JSON Schema is built from the parser's limits
(``plan.json_schema``), and the parser and the schema accept and refuse the same plans.

The parser (``ShardInfo.from_dict``) stays the runtime check; jsonschema runs only here. Where
the schema cannot say what the parser checks (the grammar of expressions beyond their alphabet,
``2.0`` as a dim, lone surrogates, the count of distinct expressions), the case is listed in
``SCHEMA_CANNOT_SAY``, each with the reason, and the test checks that it is exactly there that
they differ. Duplicate keys, NaN, the file's size and encoding are properties of the JSON text,
which a schema never sees (``strict_json`` refuses them before either): not cases here.

To regenerate the shipped file after changing a limit::

    SHARDLOAD_WRITE_SCHEMA=1 python -m pytest tests/test_plan_schema.py
"""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from helpers.plan_corpus import INVALID as PLAN_INVALID
from helpers.plan_corpus import VALID as PLAN_VALID

from shardload import PlanError, ShardInfo
from shardload import plan as plan_module
from shardload.plan import (
    MAX_DIM,
    MAX_DIMS,
    MAX_EXTRA_ARGS,
    MAX_PARAMS,
    MAX_PLAN_BYTES,
    MAX_STEPS,
    json_schema,
    schema_text,
    step_json,
    write_schema,
)
from shardload.plan import limits as plan_limits
from shardload.plan import steps as plan_steps


def shipped_path() -> str:
    import shardload

    return os.path.join(os.path.dirname(shardload.__file__), plan_module.SCHEMA_FILE)


def schema_accepts(plan) -> bool:
    return jsonschema.Draft202012Validator(json_schema()).is_valid(plan)


def parser_accepts(plan) -> bool:
    try:
        ShardInfo.from_dict(plan)
    except PlanError:
        return False
    return True


# ---- the shipped file is json_schema() ---------------------------------------------------------


def test_shipped_schema_is_built_from_the_parser_limits():
    if os.environ.get("SHARDLOAD_WRITE_SCHEMA"):
        write_schema()
    with open(shipped_path(), encoding="utf-8") as f:
        text = f.read()
    assert text == schema_text(), (
        "shardload/schemas/shard_info.schema.json is out of date: regenerate it with "
        "SHARDLOAD_WRITE_SCHEMA=1 python -m pytest tests/test_plan_schema.py"
    )
    assert json.loads(text) == json_schema()


def test_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(json_schema())


def test_schema_states_the_limits_the_parser_applies():
    schema = json_schema()
    defs = schema["$defs"]
    counts = schema["allOf"][0]  # __metadata__ and __placement__ are no params
    assert counts["then"]["maxProperties"] == MAX_PARAMS + 2
    assert counts["else"]["then"]["maxProperties"] == MAX_PARAMS + 1
    assert counts["else"]["else"]["maxProperties"] == MAX_PARAMS
    assert schema["additionalProperties"]["maxItems"] == MAX_STEPS
    assert defs["step"]["maxItems"] == MAX_EXTRA_ARGS + 2
    assert defs["outSpec"]["prefixItems"][0]["maxItems"] == MAX_DIMS
    assert defs["dim"]["oneOf"][0]["maximum"] == MAX_DIM
    # the description once said 64 MiB while the parser allowed 256 MiB
    assert f"at most {MAX_PLAN_BYTES} bytes (256 MiB)" in schema["description"]
    from shardload import dtypes, symbolic

    assert set(defs["dtype"]["enum"]) == set(dtypes.ITEMSIZE) | set(dtypes.ALIASES)
    assert defs["expression"]["maxLength"] == symbolic.MAX_LENGTH
    assert defs["expression"]["pattern"] == symbolic.ALPHABET.pattern
    assert "min(...) and max(...)" in defs["expression"]["description"]


def test_schema_follows_a_changed_limit(monkeypatch):
    monkeypatch.setattr(plan_limits, "MAX_STEPS", 3)
    monkeypatch.setattr(plan_limits, "MAX_PARAMS", 7)
    schema = json_schema()
    assert schema["additionalProperties"]["maxItems"] == 3
    assert schema["allOf"][0]["else"]["else"]["maxProperties"] == 7
    assert "at most 7 parameters" in schema["description"]


def test_write_schema_writes_schema_text(tmp_path):
    path = write_schema(tmp_path / "s.json")
    assert open(path, encoding="utf-8").read() == schema_text()


# ---- the parser and the schema agree ----------------------------------------------------------

STEP = ["shardload.split", [["num_shards", "8 // num_shards", 4], "float16"], 0]

CORPUS_VALID = [
    *PLAN_VALID,
    {"w": [STEP]},
    {"__metadata__": {}, "w": [STEP]},
    {"w": [["f", [["min(num_shards, 2)", "max(1, num_shards) % 3"], "half"], "-num_shards"]]},
    {"w": [["f", [[], "e5m2_float8"], 0.5, -1, False]]},
    {"\U0001f600": [["f", [[1], "uint64"]]]},  # any non-empty name, any Unicode
    {"w": [["f" * 100_000, [[2], "int32"]]]},  # a long name parses (validate refuses)
    {"w": [["f", [["9" * 256], "int32"]]]},  # 256 characters: the longest
    {"w": [["f", [[MAX_DIM], "int8"]]]},  # refused only at bind
    {"__placement__": {"num_shards": 2, "params": {"e0": [0], "e1": [1, 0]}}, "w": [STEP]},
    {"__metadata__": {}, "__placement__": {"num_shards": 1, "params": {}}},
]

CORPUS_INVALID = [
    *PLAN_INVALID,
    {"w": "shardload.split"},  # steps not a list
    {"w": [STEP, None]},  # a step not a list
    {"w": [["f", None]]},  # no output spec
    {"w": [["f", [[2]]]]},  # spec of 1
    {"w": [["f", [None, "int32"]]]},  # shape null
    {"w": [["f", [[2], None]]]},  # dtype null
    {"w": [["f", [[2], "Float16"]]]},  # dtype names are case-sensitive
    {"w": [["f", [[None], "int32"]]]},  # null dim
    {"w": [["f", [[""], "int32"]]]},  # empty expression
    {"w": [["f", [["n" * 257], "int32"]]]},  # 257 characters
    {"w": [["f", [[2], "int32"], ""]]},  # empty expression arg
    {"w": [["f", [[2], "int32"], "num_shards; 1"]]},  # outside the alphabet
    {"w": [["f", [[2], "int32"], [1, 2]]]},  # list arg
    {"w": [[["x"] * 1000, [[2], "int32"]]]},  # from test_plan_hostile
    {"w": [["f", [[2], "int32", "x" * 100_000]]]},
    {"w": [["f", [[2], "d" * 100_000]]]},
    {"w": [["f", [[[1] * 1000], "int32"]]]},
    {"w": [["f", [[2], "int32"], {"k" * 1000: 1}]]},
    {"w": [STEP] * (MAX_STEPS + 1)},
    {"w": [["f", [[1] * (MAX_DIMS + 1), "int32"]]]},
    "a plan",  # not an object
    None,
    {"__placement__": [0]},  # placement not an object
    {"__placement__": {"params": {"e": [0]}}},  # no num_shards
    {"__placement__": {"num_shards": 0, "params": {}}},  # num_shards < 1
    {"__placement__": {"num_shards": 2, "params": {"e": []}}},  # held by nobody
    {"__placement__": {"num_shards": 2, "params": {"e": [0, 0]}}},  # a worker twice
    {"__placement__": {"num_shards": 2, "params": {"e": ["0"]}}},  # not an integer
    {"__placement__": {"num_shards": 2, "params": {"e": [0]}, "x": 1}},  # unknown key
]

#: plans the schema accepts and the parser refuses, because JSON Schema cannot say what the
#: parser checks; each with the reason. Everything else must get the same answer from both.
SCHEMA_CANNOT_SAY = [
    # the grammar of expressions: the schema checks the alphabet and the length only
    ({"w": [["f", [["num_shards +"], "int32"]]]}, "grammar"),
    ({"w": [["f", [["foo"], "int32"]]]}, "grammar: the only name is num_shards"),
    ({"w": [["f", [[2], "int32"], "abs(num_shards)"]]}, "grammar: only min and max"),
    ({"w": [["f", [["   "], "int32"]]]}, "grammar: blank"),
    ({"w": [["f", [["1 / 2"], "int32"]]]}, "grammar: only //"),
    ({"w": [["f", [["2**3"], "int32"]]]}, "grammar: no powers"),
    # JSON Schema's "integer" is a mathematical integer, so 2.0 is one; the parser wants the
    # integer literal 2 (a dim of 2.0 is refused)
    ({"w": [["f", [[2.0], "int32"]]]}, "integer literal"),
    # lone surrogates: a JSON Schema validator sees strings, not their encoding
    ({"\ud800": []}, "lone surrogate"),
    ({"w": [["f\udc00", [[2], "int32"]]]}, "lone surrogate"),
    # a worker beyond the placement's own num_shards, and a placed parameter with steps: the
    # schema sees each value alone
    ({"__placement__": {"num_shards": 2, "params": {"e": [2]}}}, "worker < num_shards"),
    (
        {"__placement__": {"num_shards": 2, "params": {"w": [0]}}, "w": [STEP]},
        "a placed parameter takes no steps",
    ),
]


@pytest.mark.parametrize("plan", CORPUS_VALID, ids=lambda p: repr(p)[:60])
def test_both_accept(plan):
    assert schema_accepts(plan)
    assert parser_accepts(plan)


@pytest.mark.parametrize("plan", CORPUS_INVALID, ids=lambda p: repr(p)[:60])
def test_both_refuse(plan):
    assert not schema_accepts(plan)
    assert not parser_accepts(plan)


@pytest.mark.parametrize("plan, reason", SCHEMA_CANNOT_SAY, ids=[r for _, r in SCHEMA_CANNOT_SAY])
def test_what_only_the_parser_refuses(plan, reason):
    assert schema_accepts(plan), reason
    assert not parser_accepts(plan), reason


def test_distinct_expression_count_is_the_parsers_alone(monkeypatch):
    # a count over the whole plan: no schema keyword can say it
    monkeypatch.setattr(plan_limits, "MAX_EXPRESSIONS", 2)
    plan = {"w": [["f", [["num_shards", "1 + num_shards", "2 + num_shards"], "int32"]]]}
    assert schema_accepts(plan) and not parser_accepts(plan)


@pytest.mark.parametrize(
    "limit, value, at, over",
    [
        ("MAX_PARAMS", 3, {"a": [], "b": [], "c": []}, {"a": [], "b": [], "c": [], "d": []}),
        (
            "MAX_PARAMS",
            3,  # __metadata__ is no parameter
            {"__metadata__": {}, "a": [], "b": [], "c": []},
            {"__metadata__": {}, "a": [], "b": [], "c": [], "d": []},
        ),
        ("MAX_STEPS", 2, {"w": [STEP] * 2}, {"w": [STEP] * 3}),
        (
            "MAX_DIMS",
            3,
            {"w": [["f", [[1, 2, 3], "int8"]]]},
            {"w": [["f", [[1, 2, 3, 4], "int8"]]]},
        ),
        (
            "MAX_EXTRA_ARGS",
            4,
            {"w": [["f", [[1], "int8"], 1, 2, 3, 4]]},
            {"w": [["f", [[1], "int8"], 1, 2, 3, 4, 5]]},
        ),
        ("MAX_DIM", 100, {"w": [["f", [[100], "int8"]]]}, {"w": [["f", [[101], "int8"]]]}),
    ],
)
def test_both_apply_the_same_limits(monkeypatch, limit, value, at, over):
    """Each limit at its value and one over, with the limit made small: the schema is built
    from the limit the parser reads, so both move together."""
    monkeypatch.setattr(plan_limits, limit, value)
    assert schema_accepts(at) and parser_accepts(at)
    assert not schema_accepts(over) and not parser_accepts(over)


def test_int64_edges_agree():
    for arg, ok in (
        (2**63 - 1, True),
        (-(2**63), True),
        (2**63, False),
        (-(2**63) - 1, False),
        (9.3e18, False),
        (-9.2e18, True),
    ):
        plan = {"w": [["f", [[2], "int32"], arg]]}
        assert schema_accepts(plan) is ok and parser_accepts(plan) is ok, arg


def test_planner_plans_and_their_serialisations_match_the_schema(tmp_path):
    from helpers.paths import EXAMPLE
    from helpers.quantized_models import PLAIN, THREE, write_model

    from shardload.planners import plan_for

    info = plan_for(EXAMPLE)
    for plan in (info.to_dict(), json.loads(info.dumps()), info.bind(4).to_dict()):
        assert schema_accepts(plan) and parser_accepts(plan)
    padded = plan_for(write_model(str(tmp_path), THREE, PLAIN[0]).folder, num_shards=2)
    assert padded.metadata and schema_accepts(json.loads(padded.dumps()))


# ---- one serialisation of a step -------------------------------------------------------------


def test_every_plan_form_writes_its_steps_through_step_json(monkeypatch):
    calls = []
    real = plan_steps.step_json
    monkeypatch.setattr(plan_steps, "step_json", lambda *args: calls.append(args[0]) or real(*args))
    info = ShardInfo.from_dict({"__metadata__": {"k": 1}, "w": [STEP], "v": []})
    expected = {"__metadata__": {"k": 1}, "w": [STEP], "v": []}
    assert info.to_dict() == expected and len(calls) == 1
    assert json.loads(info.dumps()) == expected and len(calls) == 2
    plan = info.bind(2)
    bound = ["shardload.split", [[2, 4, 4], "float16"], 0]
    assert plan.to_dict() == {"__metadata__": {"k": 1}, "w": [bound], "v": []}
    assert len(calls) == 3
    assert info.steps["w"][0].to_json() == STEP and plan.params["w"][0].to_json() == bound
    assert len(calls) == 5


def test_step_json():
    assert step_json("f", (1, "num_shards"), "int8", (0, None)) == [
        "f",
        [[1, "num_shards"], "int8"],
        0,
        None,
    ]
    assert step_json("f", [], "bool") == ["f", [[], "bool"]]
