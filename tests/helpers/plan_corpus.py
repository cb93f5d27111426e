"""Plans the JSON Schema and the parser must agree on: ``VALID`` (both accept) and ``INVALID``
(both refuse), shared by the plan tests and the schema's corpus; ``SPLIT_W`` splits an [8, 4]
float16 ``w`` along dim 0."""

from __future__ import annotations

SPLIT_W = {"w": [["shardload.split", [["num_shards", "8 // num_shards", 4], "float16"], 0]]}

VALID = [
    {},
    {"w": []},
    SPLIT_W,
    {"x_0": [["tests.disco.shard_dim_1", [[4, 64, 64], "float16"], 4]]},
    {"w": [["f", [[2, "num_shards * 2"], "e4m3_float8"], 0, 1.5, True, None, "num_shards"]]},
    {"w": [["a", [[], "float32"]], ["b", [[0, 3], "bool"]]]},
    {"__metadata__": {"tensor_parallel": {"q_heads": [[0, -1]]}}, "w": []},
    {"w": [["f", [[1] * 64, "int32"]]]},  # torch's 64 dims
    {"w": [["f", [[2**53, 0], "int32"], 2**63 - 1, -(2**63), -9.2e18, 1e-300]]},  # at the limits
    {"w": [["f", [["99999999999999999999"], "int32"]]]},  # grammatical; refused at bind
    {"w": [["f", [[2], "int32"]]] * 16},  # 16 steps
]
INVALID = [
    [],  # not an object
    {"w": {}},  # steps not a list
    {"w": ["shardload.split"]},  # step not a list
    {"w": [["f"]]},  # no output spec
    {"w": [[1, [[2], "int32"]]]},  # name not a string
    {"w": [["", [[2], "int32"]]]},  # empty name
    {"w": [["f", [[2], "int32", 0]]]},  # spec of 3
    {"w": [["f", [2, "int32"]]]},  # shape not a list
    {"w": [["f", [[2.5], "int32"]]]},  # float dim
    {"w": [["f", [[-2], "int32"]]]},  # negative dim
    {"w": [["f", [[True], "int32"]]]},  # bool dim
    {"w": [["f", [[2], "int4"]]]},  # unknown dtype
    {"w": [["f", [[2], "int32"], [0]]]},  # list arg
    {"w": [["f", [[2], "int32"], {"a": 1}]]},  # object arg
    {"w": [["f", [["num_shards.real"], "int32"]]]},  # outside the expression alphabet
    {"w": [["f", [["a" * 300], "int32"]]]},  # over-long expression
    {"": []},  # empty parameter name
    {"__metadata__": [1]},  # metadata not an object
    {"w": [["f", [[1] * 65, "int32"]]]},  # more dims than torch allows
    {"w": [["f", [[2**53 + 1], "int32"]]]},  # a dim beyond 2**53
    {"w": [["f", [[2], "int32"], 2**63]]},  # an arg beyond int64
    {"w": [["f", [[2], "int32"], -(2**63) - 1]]},
    {"w": [["f", [[2], "int32"], 1e19]]},
    {"w": [["f", [[2], "int32"]]] * 17},  # more than 16 steps
]
