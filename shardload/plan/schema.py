"""The JSON Schema of ``shard_info.json``, built from the very limits and names the parser checks.

``json_schema()`` builds it from the ``MAX_*`` limits (``limits``), ``dtypes``' names and
aliases, and ``symbolic``'s expression alphabet and grammar;
``shardload/schemas/shard_info.schema.json`` is its output, shipped for other tools. The parser
stays the runtime check (it is linear and fast on 100 MB plans; jsonschema is never run at
runtime); ``tests/test_plan_schema.py`` checks that the shipped file is ``json_schema()`` and
that the parser and the schema accept and refuse the same plans. After changing a limit,
regenerate the file with::

    python -c "from shardload.plan import write_schema; write_schema()"

(or run ``SHARDLOAD_WRITE_SCHEMA=1 python -m pytest tests/test_plan_schema.py``).
"""

from __future__ import annotations

import json
import os

from .. import dtypes, symbolic
from . import limits
from .placement import Placement
from .steps import METADATA_KEY

__all__ = ["SCHEMA_FILE", "json_schema", "schema_text", "write_schema"]

#: the shipped schema, inside the package: ``json_schema()`` written by ``write_schema()``
SCHEMA_FILE = "schemas/shard_info.schema.json"
#: how ``symbolic`` spells its operators (an operator it gains must be named here too)
_OPERATOR_TEXT = {"Add": "+", "Sub": "-", "Mult": "*", "FloorDiv": "//", "Mod": "%"}


def _expression_grammar() -> str:
    """The grammar of ``num_shards`` expressions in words, from ``symbolic``'s own tables."""
    ops = " ".join(_OPERATOR_TEXT[op.__name__] for op in symbolic.BINOPS)
    calls = " and ".join(f"{name}(...)" for name in symbolic.FUNCS)
    return (
        f"An integer expression of {symbolic.NAME}: integer literals, {symbolic.NAME}, "
        f"{ops}, unary minus, parentheses, {calls}."
    )


def _power(value: int) -> str:
    """``2**53`` for a power of two, the number otherwise: how limits read best."""
    return f"2**{value.bit_length() - 1}" if value > 1 and value & (value - 1) == 0 else str(value)


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of ``shard_info.json``, built from the limits and names
    the parser checks, read when called: ``MAX_PARAMS``, ``MAX_STEPS``, ``MAX_DIMS``,
    ``MAX_DIM``, ``MAX_EXTRA_ARGS`` (and, in its description, ``MAX_PLAN_BYTES`` and
    ``MAX_EXPRESSIONS``), ``dtypes``' names and aliases, ``symbolic``'s alphabet, length limit
    and grammar. ``shardload/schemas/shard_info.schema.json`` is this (``write_schema``).

    It describes the structure; what JSON Schema cannot say (the file's size and encoding,
    duplicate keys, the grammar of expressions beyond their alphabet, integer literals as
    opposed to ``2.0``, the count of distinct expressions) the parser checks, and the
    function-specific rules ``Plan.validate`` does.

    >>> json_schema()["additionalProperties"]["maxItems"] == limits.MAX_STEPS
    True
    """
    lo, hi = limits.INT64_RANGE
    grammar = _expression_grammar()
    description = (
        "Parameter name -> ordered list of steps [func_name, [out_shape, dtype], *extra_args]. "
        "Steps run serially; the last step's output has num_shards on axis 0 and worker i keeps "
        "output[i]. A parameter with no entry (or an empty list) is replicated. Any integer in "
        "out_shape or extra_args may be a string holding an integer expression of num_shards. "
        "The format of Apache TVM's Disco loader. "
        f"Limits (shardload.plan): at most {limits.MAX_PARAMS} parameters, "
        f"{limits.MAX_STEPS} steps per parameter, {limits.MAX_DIMS} dims per out_shape, each dim "
        f"at most {_power(limits.MAX_DIM)}, {limits.MAX_EXTRA_ARGS} extra args per step, "
        "numbers within the int64 range. "
        "Checked by the parser but not expressible here: the file is UTF-8 JSON of at most "
        f"{limits.MAX_PLAN_BYTES} bytes ({limits.MAX_PLAN_BYTES / (1 << 20):g} MiB), without "
        "duplicate keys, "
        "NaN/Infinity, numbers overflowing a float64, or strings holding lone surrogates; dims "
        "are integer literals (2, not 2.0); expressions follow the grammar (not only the "
        f"alphabet), and a plan holds at most {limits.MAX_EXPRESSIONS} distinct ones."
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://shardload.invalid/schemas/shard_info.schema.json",
        "title": "shardload plan (shard_info.json)",
        "description": description,
        "type": "object",
        "propertyNames": {"minLength": 1},
        # the reserved keys are no parameters: one more key is allowed for each that is there
        "maxProperties": limits.MAX_PARAMS + 2,
        "allOf": [
            {
                "if": {"required": [METADATA_KEY, Placement.KEY]},
                "then": {"maxProperties": limits.MAX_PARAMS + 2},
                "else": {
                    "if": {"anyOf": [{"required": [METADATA_KEY]}, {"required": [Placement.KEY]}]},
                    "then": {"maxProperties": limits.MAX_PARAMS + 1},
                    "else": {"maxProperties": limits.MAX_PARAMS},
                },
            }
        ],
        "properties": {
            METADATA_KEY: {
                "description": "Not a parameter: what the planner recorded for engines, e.g. "
                "tensor_parallel (each worker's heads when padding), experts "
                "(each worker's experts under expert parallelism).",
                "type": "object",
            },
            Placement.KEY: {
                "description": "Not a parameter: whole parameters held by some workers only "
                "(expert parallelism), for the one num_shards the plan was "
                "written for. A placed parameter takes no steps.",
                "type": "object",
                "required": ["num_shards", "params"],
                "additionalProperties": False,
                "properties": {
                    "num_shards": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": limits.MAX_NUM_SHARDS,
                    },
                    "params": {
                        "type": "object",
                        "maxProperties": limits.MAX_PARAMS,
                        "propertyNames": {"minLength": 1},
                        "additionalProperties": {
                            "type": "array",
                            "minItems": 1,
                            "uniqueItems": True,
                            "items": {
                                "type": "integer",
                                "minimum": 0,
                                "maximum": limits.MAX_NUM_SHARDS - 1,
                            },
                        },
                    },
                },
            },
        },
        "additionalProperties": {
            "type": "array",
            "maxItems": limits.MAX_STEPS,
            "items": {"$ref": "#/$defs/step"},
        },
        "$defs": {
            "step": {
                "type": "array",
                "minItems": 2,
                "maxItems": limits.MAX_EXTRA_ARGS + 2,
                "prefixItems": [{"$ref": "#/$defs/funcName"}, {"$ref": "#/$defs/outSpec"}],
                "items": {"$ref": "#/$defs/extraArg"},
            },
            "funcName": {"type": "string", "minLength": 1},
            "outSpec": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "prefixItems": [
                    {
                        "type": "array",
                        "maxItems": limits.MAX_DIMS,
                        "items": {"$ref": "#/$defs/dim"},
                    },
                    {"$ref": "#/$defs/dtype"},
                ],
            },
            "dim": {
                "oneOf": [
                    {"type": "integer", "minimum": 0, "maximum": limits.MAX_DIM},
                    {"$ref": "#/$defs/expression"},
                ],
            },
            "extraArg": {
                "oneOf": [
                    {"type": "number", "minimum": lo, "maximum": hi},
                    {"type": "boolean"},
                    {"type": "null"},
                    {"$ref": "#/$defs/expression"},
                ],
            },
            "expression": {
                "description": grammar,
                "type": "string",
                "minLength": 1,
                "maxLength": symbolic.MAX_LENGTH,
                "pattern": symbolic.ALPHABET.pattern,
            },
            "dtype": {"enum": [*dtypes.ITEMSIZE, *dtypes.ALIASES]},
        },
    }


def schema_text() -> str:
    """``json_schema()`` as the shipped file holds it (indented, one trailing newline)."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def write_schema(path: str | os.PathLike | None = None) -> str:
    """Write ``schema_text()`` to ``path`` (default: the package's own ``SCHEMA_FILE``, in a
    source checkout); returns the path written."""
    if path is None:
        from importlib.resources import files as package_files

        path = str(package_files("shardload").joinpath(SCHEMA_FILE))
    with open(path, "w", encoding="utf-8") as f:
        f.write(schema_text())
    return os.fsdecode(path)
