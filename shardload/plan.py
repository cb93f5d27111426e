"""``shard_info.json``: parse, bind to one ``num_shards``, validate against a checkpoint.

The lifecycle of a plan:

1. **Parse** (``ShardInfo.load`` / ``loads`` / ``from_dict``): a regular file of at most
   ``MAX_PLAN_BYTES``, strict UTF-8 JSON (see ``strict_json``: no duplicate keys, NaN/Infinity,
   numbers overflowing to infinity or lone surrogates), structure checked by ``_parse_step``
   with the stated limits below. Shapes and extra args may still be expressions of
   ``num_shards``; each distinct one is parsed once.
2. **Bind** (``ShardInfo.bind(N)``): every expression evaluated for N (at most
   ``MAX_NUM_SHARDS``), giving an immutable ``Plan``. A plan written with plain integers for
   another N is refused here, and so is a shape no tensor can have (a dim beyond 2**53, a byte
   span beyond int64).
3. **Validate** (``Plan.validate(metadata)``): against the checkpoint's names, shapes and dtypes,
   before any tensor data is read: functions exist, arity, each step's declared output agrees
   with the function's shape rule, the last output has N on axis 0, no intermediate is
   absurdly larger than the stored tensor. The result, a ``ValidatedPlan``, is what the loader
   runs.

Every pass is linear in the plan's size, and a hostile plan gets one ``PlanError`` naming the
file, the parameter and the step, what was found and the limit, with every name and value in
it cut short (``errors.quote``).

**The JSON Schema.** ``json_schema()`` builds the schema of ``shard_info.json`` from the very
limits and names the parser checks (the ``MAX_*`` constants, ``dtypes``' names and aliases,
``symbolic``'s expression alphabet and grammar), and ``shardload/schemas/shard_info.schema.json``
is its output, shipped for other tools. The parser stays the runtime check (it is linear and
fast on 100 MB plans; jsonschema is never run at runtime); ``tests/test_plan_schema.py`` checks
that the shipped file is ``json_schema()`` and that the parser and the schema accept and refuse
the same plans. After changing a limit, regenerate the file with::

    python -c "from shardload.plan import write_schema; write_schema()"

(or run ``SHARDLOAD_WRITE_SCHEMA=1 python -m pytest tests/test_plan_schema.py``).

**Placement.** A plan may hold whole parameters on some workers only (expert parallelism: each
worker holds whole experts): ``"__placement__": {"num_shards": N, "params": {name: [worker,
...]}}``. A placed parameter takes no steps (each of its workers keeps it whole), the plan is for
that N alone (binding it to another is refused with the way to re-plan), and a worker not named
neither reads nor keeps it (``ParamPlan.workers``, ``ValidatedPlan.held_by``).

**One serialisation.** ``step_json`` writes a step as ``shard_info.json`` has it; ``RawStep``,
``Step``, ``ShardInfo.to_dict``/``dumps``, ``Plan.to_dict`` and the planners all go through it.

>>> info = ShardInfo.from_dict({"w": [["shardload.split", [["num_shards", "8 // num_shards"],
...                                                       "float16"], 0]]})
>>> plan = info.bind(2)
>>> plan.params["w"][0].out_shape
(2, 4)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional, Union

from . import dtypes, files, strict_json, symbolic
from .errors import PlanError, Setting, UnknownShardFunctionError, mention, quote
from .limits import MAX_NUM_SHARDS
from .readers.base import TensorMeta

__all__ = ["ShardInfo", "Plan", "Step", "ValidatedPlan", "ParamPlan", "MAX_PLAN_BYTES",
           "MAX_GROWTH", "MAX_NUM_SHARDS", "MAX_PARAMS", "MAX_STEPS", "MAX_DIMS",
           "MAX_EXTRA_ARGS", "MAX_EXPRESSIONS", "MAX_DIM", "json_schema", "write_schema",
           "schema_text", "step_json", "SCHEMA_FILE", "Placement"]

# ---- limits --------------------------------------------------------------------------------------
# Every limit is far beyond what a real plan needs, and each refusal says which one was hit.

#: the plan file's size: a symbolic plan for a 671B-parameter MoE model (about 100k tensors) is
#: a few MB, but a zero-padded plan lists every unit a worker takes (for bf16 one unit is one
#: row: Llama-3.1-405B at N=3 is 137 MB); parsing is linear, so the cap only stops absurd files
MAX_PLAN_BYTES = 256 << 20
#: parameters in one plan: the largest MoE checkpoints hold a few hundred thousand tensors
MAX_PARAMS = 1 << 20
#: steps per parameter: real plans use one or two (expand per-part scales, then split)
MAX_STEPS = 16
#: dims of one out_shape: torch's own limit
MAX_DIMS = 64
#: extra args of one step: ``shardload.take_units`` lists every worker's unit indices (4096
#: workers x a few padded heads or MLP blocks each is tens of thousands); 2**20 leaves a wide margin
MAX_EXTRA_ARGS = 1 << 20
#: distinct expression strings in one plan: planners write a handful per distinct tensor shape
#: (``"4096 // num_shards"``), repeated for every layer
MAX_EXPRESSIONS = 1 << 16
#: the largest dimension a declared shape may have (see ``dtypes.MAX_DIM``)
MAX_DIM = dtypes.MAX_DIM
#: every intermediate of a parameter's steps may be at most MAX_GROWTH * num_shards times the
#: *stored* tensor (+ slack): replication legitimately makes N copies, padding a little more;
#: beyond that is a memory bomb. Bounding each step against the stored tensor (not only its own
#: input) also bounds chains: k ``replicate`` steps would otherwise grow N**k.
MAX_GROWTH = 2
#: slack for tiny metadata tensors that a step legitimately expands: three per-part scales made
#: into one float32 scale per row of a fused qkv weight (``shardload.repeat_segments``; 40 KiB
#: for a 70B model's 10240 rows). Small enough that a chain of replicates of a tiny tensor is
#: still refused within a few steps.
_GROWTH_SLACK_BYTES = 64 << 10
_INT64 = (-2**63, 2**63 - 1)
#: longest shape-rule message repeated in a PlanError
_REASON_LIMIT = 400

Scalar = Union[int, float, bool, None, str]


def _brief(value: Any, items: int = 8, depth: int = 0) -> str:
    """A short rendering of a (possibly huge, possibly nested) JSON value for messages: at most
    ``items`` entries of a list, each string cut by ``quote``."""
    if isinstance(value, (list, tuple)):
        if depth >= 2:
            return f"[... ({len(value)} items)]"
        shown = ", ".join(_brief(v, items, depth + 1) for v in value[:items])
        more = f", ... ({len(value)} items)" if len(value) > items else ""
        return f"[{shown}{more}]"
    if isinstance(value, Mapping):
        return f"{{...}} (an object of {len(value)} keys)"
    if isinstance(value, str):
        return quote(value)
    return quote(value, 40)


def _cut(text: str, limit: int = _REASON_LIMIT) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# ---- the JSON Schema, built from the limits above ------------------------------------------------

#: the shipped schema, inside the package: ``json_schema()`` written by ``write_schema()``
SCHEMA_FILE = "schemas/shard_info.schema.json"
#: how ``symbolic`` spells its operators (an operator it gains must be named here too)
_OPERATOR_TEXT = {"Add": "+", "Sub": "-", "Mult": "*", "FloorDiv": "//", "Mod": "%"}


def _expression_grammar() -> str:
    """The grammar of ``num_shards`` expressions in words, from ``symbolic``'s own tables."""
    ops = " ".join(_OPERATOR_TEXT[op.__name__] for op in symbolic.BINOPS)
    calls = " and ".join(f"{name}(...)" for name in symbolic.FUNCS)
    return (f"An integer expression of {symbolic.NAME}: integer literals, {symbolic.NAME}, "
            f"{ops}, unary minus, parentheses, {calls}.")


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

    >>> json_schema()["additionalProperties"]["maxItems"] == MAX_STEPS
    True
    """
    lo, hi = _INT64
    grammar = _expression_grammar()
    description = (
        "Parameter name -> ordered list of steps [func_name, [out_shape, dtype], *extra_args]. "
        "Steps run serially; the last step's output has num_shards on axis 0 and worker i keeps "
        "output[i]. A parameter with no entry (or an empty list) is replicated. Any integer in "
        "out_shape or extra_args may be a string holding an integer expression of num_shards. "
        "The format of Apache TVM's Disco loader. "
        f"Limits (shardload.plan): at most {MAX_PARAMS} parameters, {MAX_STEPS} steps per "
        f"parameter, {MAX_DIMS} dims per out_shape, each dim at most {_power(MAX_DIM)}, "
        f"{MAX_EXTRA_ARGS} extra args per step, numbers within the int64 range. "
        "Checked by the parser but not expressible here: the file is UTF-8 JSON of at most "
        f"{MAX_PLAN_BYTES} bytes ({MAX_PLAN_BYTES / (1 << 20):g} MiB), without duplicate keys, "
        "NaN/Infinity, numbers overflowing a float64, or strings holding lone surrogates; dims "
        "are integer literals (2, not 2.0); expressions follow the grammar (not only the "
        f"alphabet), and a plan holds at most {MAX_EXPRESSIONS} distinct ones.")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://shardload.invalid/schemas/shard_info.schema.json",
        "title": "shardload plan (shard_info.json)",
        "description": description,
        "type": "object",
        "propertyNames": {"minLength": 1},
        # the reserved keys are no parameters: one more key is allowed for each that is there
        "maxProperties": MAX_PARAMS + 2,
        "allOf": [{"if": {"required": [ShardInfo.METADATA_KEY, Placement.KEY]},
                   "then": {"maxProperties": MAX_PARAMS + 2},
                   "else": {"if": {"anyOf": [{"required": [ShardInfo.METADATA_KEY]},
                                             {"required": [Placement.KEY]}]},
                            "then": {"maxProperties": MAX_PARAMS + 1},
                            "else": {"maxProperties": MAX_PARAMS}}}],
        "properties": {
            ShardInfo.METADATA_KEY: {
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
                    "num_shards": {"type": "integer", "minimum": 1,
                                   "maximum": MAX_NUM_SHARDS},
                    "params": {
                        "type": "object",
                        "maxProperties": MAX_PARAMS,
                        "propertyNames": {"minLength": 1},
                        "additionalProperties": {
                            "type": "array", "minItems": 1, "uniqueItems": True,
                            "items": {"type": "integer", "minimum": 0,
                                      "maximum": MAX_NUM_SHARDS - 1}},
                    },
                },
            },
        },
        "additionalProperties": {
            "type": "array",
            "maxItems": MAX_STEPS,
            "items": {"$ref": "#/$defs/step"},
        },
        "$defs": {
            "step": {
                "type": "array",
                "minItems": 2,
                "maxItems": MAX_EXTRA_ARGS + 2,
                "prefixItems": [{"$ref": "#/$defs/funcName"}, {"$ref": "#/$defs/outSpec"}],
                "items": {"$ref": "#/$defs/extraArg"},
            },
            "funcName": {"type": "string", "minLength": 1},
            "outSpec": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "prefixItems": [
                    {"type": "array", "maxItems": MAX_DIMS, "items": {"$ref": "#/$defs/dim"}},
                    {"$ref": "#/$defs/dtype"},
                ],
            },
            "dim": {
                "oneOf": [
                    {"type": "integer", "minimum": 0, "maximum": MAX_DIM},
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


def write_schema(path: Union[str, os.PathLike, None] = None) -> str:
    """Write ``schema_text()`` to ``path`` (default: the package's own ``SCHEMA_FILE``, in a
    source checkout); returns the path written."""
    if path is None:
        from importlib.resources import files as package_files

        path = str(package_files("shardload").joinpath(SCHEMA_FILE))
    with open(path, "w", encoding="utf-8") as f:
        f.write(schema_text())
    return os.fsdecode(path)


# ---- 1. parse ----------------------------------------------------------------------------------

def step_json(func: str, out_shape: Any, dtype: str, extra: Any = ()) -> list:
    """One step as ``shard_info.json`` writes it: ``[func, [out_shape, dtype], *extra]``.

    The one serialisation of a step: ``RawStep.to_json``, ``Step.to_json``,
    ``ShardInfo.to_dict`` (and so ``dumps``), ``Plan.to_dict`` and the planners all use it.

    >>> step_json("shardload.split", ("num_shards", "8 // num_shards"), "float16", (0,))
    ['shardload.split', [['num_shards', '8 // num_shards'], 'float16'], 0]
    """
    return [func, [list(out_shape), dtype], *extra]


@dataclass(frozen=True)
class RawStep:
    """One step as written: shapes and args may still be ``num_shards`` expressions."""

    func: str
    out_shape: tuple[Union[int, str], ...]
    dtype: str
    extra: tuple[Scalar, ...]

    def __post_init__(self) -> None:
        # computed once (C-speed scans): bind and is_symbolic ask for every step
        object.__setattr__(self, "symbolic_shape", str in map(type, self.out_shape))
        object.__setattr__(self, "symbolic_extra", str in map(type, self.extra))

    @property
    def is_symbolic(self) -> bool:
        return self.symbolic_shape or self.symbolic_extra  # type: ignore[attr-defined]

    def to_json(self) -> list:
        return step_json(self.func, self.out_shape, self.dtype, self.extra)


Expressions = dict[str, symbolic.Evaluator]


def _expression(text: str, what: str, exprs: Expressions, where: dict, hint: str = "") -> None:
    """Check the expression ``text`` once per plan (``exprs`` holds those already seen)."""
    if text in exprs:
        return
    if len(exprs) >= MAX_EXPRESSIONS:
        raise PlanError(f"{what}: the plan holds more than {MAX_EXPRESSIONS} distinct "
                        "num_shards expressions; real plans repeat a few per tensor shape",
                        **where)
    try:
        exprs[text] = symbolic.compile(text)
    except symbolic.ExpressionError as exc:
        raise PlanError(f"{what}: {exc}{hint}", **where) from None


def _parse_step(raw: Any, where: dict, exprs: Expressions) -> RawStep:
    if not isinstance(raw, list) or len(raw) < 2:
        raise PlanError("a step must be a list [func_name, [out_shape, dtype], *extra_args]",
                        **where)
    if len(raw) - 2 > MAX_EXTRA_ARGS:
        raise PlanError(f"the step has {len(raw) - 2} extra args, more than the "
                        f"{MAX_EXTRA_ARGS} a step may have", **where)
    func, out, extra = raw[0], raw[1], raw[2:]
    if not isinstance(func, str) or not func:
        raise PlanError(f"the function name must be a non-empty string, got {_brief(func)}",
                        **where)
    if not strict_json.is_text(func):
        raise PlanError(f"the function name {quote(func)} is not valid Unicode (it holds a "
                        "lone surrogate)", **where)
    if not isinstance(out, list) or len(out) != 2 or not isinstance(out[0], list):
        raise PlanError(f"the output spec must be [out_shape, dtype], got {_brief(out)}",
                        **where)
    shape, dtype = out
    if len(shape) > MAX_DIMS:
        raise PlanError(f"out_shape has {len(shape)} dims, more than the {MAX_DIMS} a tensor "
                        "may have", **where)
    dims: list[Union[int, str]] = []
    for k, d in enumerate(shape):
        if isinstance(d, str):
            d = str(d)
            _expression(d, f"out_shape[{k}]", exprs, where)
        elif type(d) is not int:
            raise PlanError(f"out_shape[{k}] is {_brief(d)}: dims must be non-negative integers "
                            f"or integer expressions of num_shards", **where)
        elif d < 0:
            raise PlanError(f"out_shape[{k}] is {d}: dims must be non-negative", **where)
        elif d > MAX_DIM:
            raise PlanError(f"out_shape[{k}] is {quote(d)}, beyond the {MAX_DIM} (2**53) any "
                            "dim may have", **where)
        dims.append(d)
    try:
        dtype = dtypes.canonical(dtype)
    except ValueError as exc:
        raise PlanError(str(exc), **where) from None
    lo, hi = _INT64
    for k, arg in enumerate(extra):
        if isinstance(arg, str):
            if type(arg) is not str:
                extra[k] = arg = str(arg)
            _expression(arg, f"extra arg {k}", exprs, where,
                        " (string args are integer expressions of num_shards)")
        elif arg is None or isinstance(arg, bool):
            pass
        elif isinstance(arg, (int, float)):
            if not lo <= arg <= hi:  # false for NaN too
                raise PlanError(f"extra arg {k} is {quote(arg, 40)}: numbers in a plan lie "
                                "within the int64 range", **where)
        else:
            raise PlanError(f"extra arg {k} is {_brief(arg)}: extra args must be JSON scalars",
                            **where)
    return RawStep(func, tuple(dims), dtype, tuple(extra))


def _plan_json(metadata: Mapping[str, Any], params: Mapping[str, tuple],
               placement: Optional[Placement] = None) -> dict:
    """``{"__metadata__": ..., "__placement__": ..., name: [step, ...]}``: a plan's steps
    (``RawStep`` or ``Step``, each written by ``step_json``) as ``shard_info.json`` holds them."""
    out: dict[str, Any] = {ShardInfo.METADATA_KEY: metadata} if metadata else {}
    if placement is not None:
        out[Placement.KEY] = placement.to_json()
    out.update({name: [s.to_json() for s in steps] for name, steps in params.items()})
    return out


def _step_key(raw: Any) -> Optional[tuple]:
    """A hashable key that determines a step's JSON exactly (value *and* type of every item, as
    ``1``, ``1.0`` and ``true`` are equal in Python), or None where there is none cheaply."""
    if type(raw) is not list or len(raw) < 2:
        return None
    out = raw[1]
    if type(out) is not list or len(out) != 2 or type(out[0]) is not list:
        return None
    shape, extra = tuple(out[0]), tuple(raw[2:])
    types = (*map(type, shape), None, *map(type, extra))
    if float in types:  # 0.0 == -0.0
        return None
    key = (raw[0], out[1], shape, extra, types)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _check_placed(placement: Placement, steps: Mapping[str, tuple], source: Optional[str]):
    """A placed parameter is held whole by its workers: it takes no steps."""
    for name in placement.params:
        if steps.get(name):
            raise PlanError(f"is placed on workers {list(placement.params[name])} "
                            f"({Placement.KEY}) and has steps: a placed parameter is held "
                            "whole by its workers, so it takes none", source=source, param=name)


def _check_metadata(metadata: Mapping, source: Optional[str]) -> None:
    """``__metadata__`` travels to worker processes as JSON: only JSON values, finite numbers,
    string keys and valid Unicode (a plan from ``strict_json`` already is; a Python dict may not
    be)."""
    stack: list[tuple[Any, str]] = [(metadata, ShardInfo.METADATA_KEY)]
    visited: set[int] = set()  # a container met twice (shared, or a cycle) is checked once
    while stack:
        value, path = stack.pop()
        bad = None
        if isinstance(value, (Mapping, list, tuple)):
            if id(value) in visited:
                continue
            visited.add(id(value))
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str) or not strict_json.is_text(key):
                    bad = f"a key {_brief(key)}: keys must be strings of valid Unicode"
                    break
                stack.append((item, path if len(path) > 200 else f"{path}.{key}"))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, path if len(path) > 200 else f"{path}[{k}]")
                         for k, item in enumerate(value))
        elif isinstance(value, str):
            if not strict_json.is_text(value):
                bad = f"the string {quote(value)}, which is not valid Unicode (a lone surrogate)"
        elif isinstance(value, float):
            if not math.isfinite(value):
                bad = f"{value}, which is not a JSON number"
        elif not (value is None or isinstance(value, (bool, int))):
            bad = f"a {type(value).__name__}, which is not a JSON value"
        if bad:
            raise PlanError(f"{_cut(path, 200)} holds {bad}", source=source)


@dataclass(frozen=True)
class Placement:
    """Which workers hold which whole parameters (the plan's ``__placement__``), for the one
    ``num_shards`` it was written for.

    >>> Placement.from_json({"num_shards": 2, "params": {"experts.1.w": [1]}}).params
    mappingproxy({'experts.1.w': (1,)})
    """

    num_shards: int
    params: Mapping[str, tuple[int, ...]]

    KEY = "__placement__"

    @classmethod
    def from_json(cls, data: Any, source: Optional[str] = None) -> "Placement":
        def refuse(what: str) -> PlanError:
            return PlanError(f"{cls.KEY} {what}", source=source)

        if not isinstance(data, Mapping) or set(data) != {"num_shards", "params"}:
            raise refuse('must be an object {"num_shards": N, "params": {name: [worker, ...]}}'
                         f", got {_brief(data)}")
        n, params = data["num_shards"], data["params"]
        if type(n) is not int or not 1 <= n <= MAX_NUM_SHARDS:
            raise refuse(f"num_shards is {quote(n, 40)}: an integer from 1 to {MAX_NUM_SHARDS}")
        if not isinstance(params, Mapping) or len(params) > MAX_PARAMS:
            raise refuse(f"params must be an object of at most {MAX_PARAMS} names, got "
                         f"{_brief(params)}")
        out: dict[str, tuple[int, ...]] = {}
        for name, workers in params.items():
            if not isinstance(name, str) or not name or not strict_json.is_text(name):
                raise refuse(f"names a parameter {_brief(name)}: names are non-empty strings")
            if (not isinstance(workers, list) or not workers
                    or any(type(w) is not int or not 0 <= w < n for w in workers)
                    or len(set(workers)) != len(workers)):
                raise PlanError(f"{cls.KEY}: the workers holding it must be a non-empty list "
                                f"of distinct workers 0..{n - 1} (num_shards={n}), got "
                                f"{_brief(workers)}", source=source, param=name)
            held = tuple(sorted(workers))
            out[name] = held
        return cls(n, MappingProxyType(out))

    def to_json(self) -> dict:
        return {"num_shards": self.num_shards,
                "params": {name: list(workers) for name, workers in self.params.items()}}


class ShardInfo:
    """A parsed ``shard_info.json``, not yet bound to a number of shards.

    >>> info = ShardInfo.loads('{"w": [["shardload.split", [[2, 3], "int32"], 0]]}')
    >>> info.is_symbolic, info.planned_num_shards
    (False, 2)
    """

    #: the reserved key for information about the plan itself (not a parameter)
    METADATA_KEY = "__metadata__"

    def __init__(self, steps: Mapping[str, tuple[RawStep, ...]], source: Optional[str] = None,
                 metadata: Optional[Mapping[str, Any]] = None,
                 placement: Optional[Placement] = None):
        self.steps: Mapping[str, tuple[RawStep, ...]] = MappingProxyType(dict(steps))
        self.source = source
        #: what the planner recorded for engines (e.g. ``tensor_parallel``: heads per worker)
        self.metadata: dict[str, Any] = dict(metadata or {})
        #: whole parameters held by some workers only (expert parallelism), or None
        self.placement = placement
        if placement is not None:
            _check_placed(placement, self.steps, source)
        # the plan's expressions, each compiled once (filled by from_dict, or on first bind)
        self._exprs: Expressions = {}
        self._symbolic: Optional[bool] = None

    # -- constructors
    @classmethod
    def from_dict(cls, data: Any, source: Optional[str] = None, *,
                  _strict_json: bool = False) -> "ShardInfo":
        if not isinstance(data, Mapping):
            raise PlanError("a plan must be a JSON object {parameter: [steps...]}, got "
                            f"{type(data).__name__}", source=source)
        count = len(data) - (cls.METADATA_KEY in data) - (Placement.KEY in data)
        if count > MAX_PARAMS:
            raise PlanError(f"the plan names {count} parameters, more than the {MAX_PARAMS} a "
                            "plan may have", source=source)
        steps: dict[str, tuple[RawStep, ...]] = {}
        metadata = data.get(cls.METADATA_KEY, {})
        if not isinstance(metadata, Mapping):
            raise PlanError(f"{cls.METADATA_KEY} must be a JSON object, got "
                            f"{type(metadata).__name__}", source=source)
        if not _strict_json:
            _check_metadata(metadata, source)
        placement = (Placement.from_json(data[Placement.KEY], source)
                     if Placement.KEY in data else None)
        exprs: Expressions = {}
        # real plans repeat each step for every layer: a step already parsed is reused
        seen: dict[tuple, RawStep] = {}
        for name, raw_steps in data.items():
            if name == cls.METADATA_KEY or name == Placement.KEY:
                continue
            if not isinstance(name, str) or not name:
                raise PlanError(f"parameter names must be non-empty strings, got {_brief(name)}",
                                source=source)
            if not strict_json.is_text(name):
                raise PlanError(f"the parameter name {quote(name)} is not valid Unicode (it "
                                "holds a lone surrogate)", source=source)
            if not isinstance(raw_steps, list):
                raise PlanError("the value must be a list of steps", source=source, param=name)
            if len(raw_steps) > MAX_STEPS:
                raise PlanError(f"{len(raw_steps)} steps, more than the {MAX_STEPS} a parameter "
                                "may have", source=source, param=name)
            parsed = []
            for k, raw in enumerate(raw_steps):
                key = _step_key(raw)
                step = seen.get(key) if key is not None else None
                if step is None:
                    step = _parse_step(raw, dict(source=source, param=name, step=k), exprs)
                    if key is not None:
                        seen[key] = step
                parsed.append(step)
            steps[name] = tuple(parsed)
        info = cls(steps, source, metadata, placement)
        info._exprs = exprs
        return info

    @classmethod
    def loads(cls, text: Union[str, bytes], source: Optional[str] = None) -> "ShardInfo":
        """Parse plan text: UTF-8 JSON (bytes are decoded as UTF-8 and nothing else)."""
        if len(text) > MAX_PLAN_BYTES:
            raise PlanError(f"the plan is {len(text)} bytes, over the {MAX_PLAN_BYTES}-byte "
                            "limit for a plan", source=source)
        try:
            data = strict_json.loads(text)
        except ValueError as exc:
            raise PlanError(f"not valid JSON: {_cut(str(exc))}", source=source) from None
        with strict_json.gc_paused():
            return cls.from_dict(data, source, _strict_json=True)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "ShardInfo":
        """Read and parse a plan file. It must be a regular file (a FIFO, a device, a directory
        or a symlink loop is a ``PlanError``) of at most ``MAX_PLAN_BYTES``."""
        path = os.fsdecode(path)
        text = files.read_capped(path, MAX_PLAN_BYTES, "the plan",
                                 error=lambda m: PlanError(m, source=path))
        return cls.loads(text, source=path)

    @classmethod
    def coerce(cls, obj: Any) -> "ShardInfo":
        """A ``ShardInfo`` from a ShardInfo, a dict, a path, or ``None`` (replicate all)."""
        if isinstance(obj, ShardInfo):
            return obj
        if obj is None:
            return cls({})
        if isinstance(obj, (str, os.PathLike)):
            return cls.load(obj)
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        raise TypeError(f"shard_info must be a ShardInfo, a dict, a path or None, not "
                        f"{type(obj).__name__}")

    # -- inspection
    @property
    def is_symbolic(self) -> bool:
        """True when some shape or arg is an expression of ``num_shards``."""
        if self._symbolic is None:
            self._symbolic = any(s.is_symbolic for steps in self.steps.values() for s in steps)
        return self._symbolic

    @property
    def planned_num_shards(self) -> Optional[int]:
        """For a plan of plain integers, the N it was written for (axis 0 of last outputs);
        for a plan with a placement, its N."""
        if self.placement is not None:
            return self.placement.num_shards
        if self.is_symbolic:
            return None
        ns = {steps[-1].out_shape[0] for steps in self.steps.values()
              if steps and steps[-1].out_shape}
        return ns.pop() if len(ns) == 1 else None

    def to_dict(self) -> dict:
        """The plan in ``shard_info.json`` form, expressions kept."""
        return _plan_json(self.metadata, self.steps, self.placement)

    def dumps(self) -> str:
        """JSON text with one parameter per line: diffable and still small."""
        lines = [f" {json.dumps(name)}: {json.dumps(steps)}"
                 for name, steps in self.to_dict().items()]
        return "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"

    def dump(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        kind = "symbolic" if self.is_symbolic else f"num_shards={self.planned_num_shards}"
        return f"ShardInfo({len(self)} params, {kind}, source={self.source!r})"

    # -- 2. bind
    def bind(self, num_shards: int) -> "Plan":
        """Evaluate every expression for ``num_shards``; refuse a plan written for another N."""
        _check_num_shards(num_shards, self.source)
        if self.placement is not None and self.placement.num_shards != num_shards:
            replan = Setting(f"plan_for(checkpoint, num_shards={num_shards}, experts='ep')",
                             f"shardload plan --shards {num_shards} --experts ep")
            raise mention(PlanError(
                f"this plan places whole parameters on the workers of "
                f"num_shards={self.placement.num_shards} ({Placement.KEY}), but "
                f"num_shards={num_shards} was asked for. Re-plan for {num_shards} workers with "
                f"`{replan.python}`.", source=self.source), replan)
        if not self.is_symbolic:
            written = {steps[-1].out_shape[0] for steps in self.steps.values()
                       if steps and steps[-1].out_shape}
            if written and written != {num_shards}:
                planned = ", ".join(str(n) for n in sorted(written)[:8])
                if len(written) > 8:
                    planned += f", ... ({len(written)} values)"
                first = next(name for name, steps in self.steps.items()
                             if steps and steps[-1].out_shape
                             and steps[-1].out_shape[0] != num_shards)
                replan = Setting(f"plan_for(checkpoint, num_shards={num_shards})",
                                 f"shardload plan --shards {num_shards}")
                raise mention(PlanError(
                    f"this plan was written for num_shards={planned} with plain integer shapes, "
                    f"but num_shards={num_shards} was asked for. Re-plan with "
                    f"`{replan.python}` (it writes expressions of num_shards, so one plan "
                    f"serves every N), or write the shapes as expressions such as "
                    f"\"4096 // num_shards\".",
                    source=self.source, param=first), replan)
        values: dict[str, int] = {}  # each distinct expression evaluated once for this N
        bound: dict[tuple[int, int], Step] = {}  # a step shared by many parameters, bound once
        params = {}
        with strict_json.gc_paused():
            for name, raw_steps in self.steps.items():
                steps = []
                for k, raw in enumerate(raw_steps):
                    step = bound.get((id(raw), k))
                    if step is None:
                        step = bound[id(raw), k] = self._bind_step(name, k, raw, num_shards,
                                                                    values)
                    steps.append(step)
                params[name] = tuple(steps)
        return Plan(num_shards, params, self.source, self.metadata, self.placement)

    def _bind_step(self, name: str, index: int, raw: RawStep, n: int,
                   values: dict[str, int]) -> "Step":
        if raw.symbolic_shape:  # type: ignore[attr-defined]
            shape = self._evaluate(raw.out_shape, "out_shape[{}]", n, values, name, index)
        else:
            shape = raw.out_shape
        if len(shape) > MAX_DIMS:
            raise PlanError(f"out_shape has {len(shape)} dims, more than the {MAX_DIMS} a tensor "
                            "may have", source=self.source, param=name, step=index)
        problem = None
        for k, d in enumerate(shape):
            if d < 0:
                problem = (f"out_shape[{k}] = {quote(raw.out_shape[k])} is {d} for "
                           f"num_shards={n}; dims must be non-negative")
                break
        else:
            why = dtypes.shape_problem(shape, raw.dtype)
            if why:
                problem = f"out_shape {_brief(shape)} {raw.dtype} for num_shards={n}: {why}"
        if problem:
            raise PlanError(problem, source=self.source, param=name, step=index)
        if raw.symbolic_extra:  # type: ignore[attr-defined]
            extra = self._evaluate(raw.extra, "extra arg {}", n, values, name, index)
        else:
            extra = raw.extra
        return Step(index, raw.func, shape, raw.dtype, extra)

    def _evaluate(self, items: tuple, what: str, n: int, values: dict[str, int], name: str,
                  index: int) -> tuple:
        """``items`` with every expression evaluated for ``n`` (each text once per bind)."""
        out = list(items)
        for k, v in enumerate(items):
            if type(v) is not str:
                continue
            got = values.get(v)
            if got is None:
                try:
                    evaluator = self._exprs.get(v)
                    if evaluator is None:
                        evaluator = self._exprs[v] = symbolic.compile(v)
                    got = values[v] = evaluator(n)
                except symbolic.ExpressionError as exc:
                    raise PlanError(f"{what.format(k)}: {exc}", source=self.source, param=name,
                                    step=index) from None
            out[k] = got
        return tuple(out)


def _check_num_shards(num_shards: Any, source: Optional[str]) -> None:
    if type(num_shards) is not int or num_shards < 1:
        raise PlanError(f"num_shards must be a positive integer, got {quote(num_shards, 40)}",
                        source=source)
    if num_shards > MAX_NUM_SHARDS:
        raise PlanError(f"num_shards={num_shards} is more than the {MAX_NUM_SHARDS} workers "
                        "shardload runs in one session (each is a thread or a process)",
                        source=source)


# ---- 2. the bound plan -------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One step with every expression evaluated."""

    index: int
    func: str
    out_shape: tuple[int, ...]
    dtype: str
    extra: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.out_shape) * dtypes.itemsize(self.dtype)

    def to_json(self) -> list:
        return step_json(self.func, self.out_shape, self.dtype, self.extra)


class Plan:
    """A plan bound to one ``num_shards``; immutable. Build it with ``ShardInfo.bind``."""

    def __init__(self, num_shards: int, params: Mapping[str, tuple[Step, ...]],
                 source: Optional[str] = None, metadata: Optional[Mapping[str, Any]] = None,
                 placement: Optional[Placement] = None):
        _check_num_shards(num_shards, source)
        if placement is not None:
            if placement.num_shards != num_shards:
                raise PlanError(f"{Placement.KEY} is for num_shards={placement.num_shards}, "
                                f"the plan is bound to {num_shards}", source=source)
            _check_placed(placement, params, source)
        self.num_shards = num_shards
        self.params: Mapping[str, tuple[Step, ...]] = MappingProxyType(dict(params))
        self.source = source
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.placement = placement

    def __repr__(self) -> str:
        return (f"Plan(num_shards={self.num_shards}, {len(self.params)} params, "
                f"source={self.source!r})")

    def to_dict(self) -> dict:
        """The plan in ``shard_info.json`` form, every expression evaluated for this N."""
        return _plan_json(self.metadata, self.params, self.placement)

    # -- 3. validate
    def validate(self, metadata: Mapping[str, TensorMeta]) -> "ValidatedPlan":
        """Check the plan against a checkpoint's metadata; no tensor data is read.

        Every parameter of the checkpoint appears in the result: those the plan names with their
        steps, the others replicated (or held whole by the workers ``__placement__`` names).
        """
        placed = self.placement.params if self.placement is not None else {}
        missing = [name for name in self.params if name not in metadata]
        missing += [name for name in placed if name not in metadata]
        if missing:
            first = missing[0]
            hint = _close_match(first, metadata)
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise PlanError(f"the checkpoint has no tensor named {quote(first)}{hint}{more}; the "
                            "plan does not match this checkpoint", source=self.source, param=first)
        with strict_json.gc_paused():
            return ValidatedPlan(self, MappingProxyType(self._validate(metadata)))

    def _validate(self, metadata: Mapping[str, TensorMeta]) -> dict[str, "ParamPlan"]:
        from .registry import get_shard_func

        n = self.num_shards
        placed = self.placement.params if self.placement is not None else {}
        found: dict[str, Any] = {}  # one registry lookup per function name
        # a step shared by many parameters (every layer's), met with the same input again,
        # passes again: checked once
        passed: set[tuple] = set()
        out = {}
        for name, meta in metadata.items():
            steps = self.params.get(name, ())
            if not steps:
                out[name] = ParamPlan(meta, (), (), placed.get(name))
                continue
            if len(steps) > MAX_STEPS:
                raise PlanError(f"{len(steps)} steps, more than the {MAX_STEPS} a parameter may "
                                "have", source=self.source, param=name)
            funcs = []
            shape, dtype, stored = meta.shape, meta.dtype, meta.nbytes
            # every intermediate, not only each step against its own input: chains stay bounded
            limit = MAX_GROWTH * n * stored + _GROWTH_SLACK_BYTES
            for step in steps:
                func = found.get(step.func)
                key = (id(step), shape, dtype, stored)
                if func is None or key not in passed:
                    func = self._check_step(name, step, shape, dtype, stored, limit, found,
                                            get_shard_func)
                    passed.add(key)
                funcs.append(func)
                shape, dtype = step.out_shape, step.dtype
            if not shape or shape[0] != n:
                got = shape[0] if shape else "a 0-d output"
                raise PlanError(f"the last step's output must have num_shards={n} on axis 0, "
                                f"got {got} (shape {_brief(shape)})",
                                source=self.source, param=name, step=steps[-1].index)
            out[name] = ParamPlan(meta, steps, tuple(funcs))
        return out

    def _check_step(self, name: str, step: "Step", shape: tuple, dtype: str, stored: int,
                    limit: int, found: dict, get_shard_func) -> Any:
        """One step against its input: the function exists, takes the args, and its shape rule
        agrees with the declared output, which stays within the growth limit."""
        n = self.num_shards
        where = dict(source=self.source, param=name, step=step.index)
        func = found.get(step.func)
        if func is None:
            try:
                func = found[step.func] = get_shard_func(step.func)
            except UnknownShardFunctionError:
                raise UnknownShardFunctionError(step.func, _known_names(), **where) from None
        if not func.accepts(len(step.extra)):
            raise PlanError(f"{quote(step.func)} takes {func.arity_text()} extra arg(s), the "
                            f"step gives {len(step.extra)}: {_brief(step.extra)}", **where)
        _check_array_dtypes(func, dtype, step.dtype, where)
        if func.shape_rule is not None:
            rule_shape, rule_dtype = _apply_rule(func, shape, dtype, step, n, where)
            if rule_shape != step.out_shape or rule_dtype != step.dtype:
                raise PlanError(
                    f"declared output {_brief(step.out_shape)} {step.dtype} disagrees with "
                    f"{quote(step.func)}, which makes {_brief(rule_shape)} {rule_dtype} from "
                    f"input {_brief(shape)} {dtype} with num_shards={n}", **where)
        if step.nbytes > limit:
            raise PlanError(
                f"declared output {_brief(step.out_shape)} {step.dtype} is {step.nbytes} bytes "
                f"from a {stored}-byte stored tensor, more than {MAX_GROWTH} x num_shards times "
                f"larger (+ {_GROWTH_SLACK_BYTES} bytes); refusing to allocate it", **where)
        return func


#: names longer than this get no "did you mean" (difflib is quadratic in the name's length)
_MATCH_LIMIT = 256
#: difflib compares the name with at most this many checkpoint names (it takes a few ms each
#: for names alike: a 47k-tensor MoE checkpoint would take 12 s); the rest are ranked first by
#: how many dotted components they share with the name
_MATCH_CANDIDATES = 500


def _close_match(name: str, metadata: Mapping[str, Any]) -> str:
    """`` (did you mean 'x'?)`` for the checkpoint name closest to ``name``, or ``""``."""
    if len(name) > _MATCH_LIMIT:
        return ""
    import difflib
    import heapq

    # difflib's ratio is at most 2 * min(a, b) / (a + b): names of a length that cannot reach
    # its 0.6 cutoff are left out here, in one cheap pass
    lo, hi = 3 * len(name) / 7, 7 * len(name) / 3
    candidates = [k for k in metadata if isinstance(k, str) and lo <= len(k) <= hi]
    if len(candidates) > _MATCH_CANDIDATES:
        parts = set(name.split("."))
        candidates = heapq.nlargest(_MATCH_CANDIDATES, candidates,
                                    key=lambda k: len(parts.intersection(k.split("."))))
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {quote(close[0])}?)" if close else ""


def _apply_rule(func, shape: tuple, dtype: str, step: "Step", n: int,
                where: dict) -> tuple[tuple[int, ...], str]:
    """``func``'s shape rule applied to the step; its refusal as a ``PlanError``."""
    try:
        rule_shape, rule_dtype = func.shape_rule(shape, dtype, *step.extra, num_shards=n)
        return tuple(rule_shape), dtypes.canonical(rule_dtype)
    except (ValueError, TypeError, ArithmeticError, LookupError) as exc:
        raise PlanError(f"{quote(step.func)} cannot apply to input {_brief(shape)} {dtype} with "
                        f"args {_brief(step.extra)}: {_cut(str(exc))}", **where) from None


def _known_names() -> list[str]:
    from .registry import list_shard_funcs

    return [f.name for f in list_shard_funcs()]


_NOT_NUMPY = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def _check_array_dtypes(func, in_dtype: str, out_dtype: str, where: dict) -> None:
    if func.array == "numpy" and (in_dtype in _NOT_NUMPY or out_dtype in _NOT_NUMPY):
        raise PlanError(f"{func.name} takes numpy arrays, and numpy has no "
                        f"{in_dtype if in_dtype in _NOT_NUMPY else out_dtype}; register it "
                        "with array='torch'", **where)


# ---- 3. the validated plan ---------------------------------------------------------------------

@dataclass(frozen=True)
class ParamPlan:
    """What the loader does with one parameter."""

    meta: TensorMeta
    steps: tuple[Step, ...]
    funcs: tuple  # ShardFunc per step
    #: the workers holding it whole (``__placement__``); None: every worker holds its piece
    workers: Optional[tuple[int, ...]] = None

    @property
    def name(self) -> str:
        return self.meta.name

    def held_by(self, worker: int) -> bool:
        """Whether worker ``worker`` keeps a piece of this parameter."""
        return self.workers is None or worker in self.workers

    @property
    def replicated(self) -> bool:
        return not self.steps

    @property
    def piece_shape(self) -> tuple[int, ...]:
        """The shape each worker keeps."""
        return self.steps[-1].out_shape[1:] if self.steps else self.meta.shape

    @property
    def piece_dtype(self) -> str:
        return self.steps[-1].dtype if self.steps else self.meta.dtype

    @property
    def piece_nbytes(self) -> int:
        return math.prod(self.piece_shape) * dtypes.itemsize(self.piece_dtype)



@dataclass(frozen=True)
class ValidatedPlan:
    """A plan checked against one checkpoint: the loader's input."""

    plan: Plan
    params: Mapping[str, ParamPlan]

    @property
    def num_shards(self) -> int:
        return self.plan.num_shards

    def __iter__(self) -> Iterator[ParamPlan]:
        return iter(self.params.values())

    def held_by(self, worker: int) -> Iterator[ParamPlan]:
        """The parameters worker ``worker`` keeps a piece of (all but those placed elsewhere)."""
        return (p for p in self.params.values() if p.held_by(worker))

    def bytes_per_worker(self, worker: Optional[int] = None) -> int:
        """The bytes of the pieces one worker keeps: worker ``worker``'s, or (``None``) the
        most any worker keeps."""
        if worker is not None:
            return sum(p.piece_nbytes for p in self.held_by(worker))
        if self.plan.placement is None:
            return sum(p.piece_nbytes for p in self)
        return max(self.bytes_per_worker(w) for w in range(self.num_shards))
