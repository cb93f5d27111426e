"""``shard_info.json``: parse, bind to one ``num_shards``, validate against a checkpoint.

The lifecycle of a plan:

1. **Parse** (``ShardInfo.load`` / ``loads`` / ``from_dict``): strict JSON (no duplicate keys,
   no NaN/Infinity), structure checked as ``schemas/shard_info.schema.json`` describes it.
   Shapes and extra args may still be expressions of ``num_shards``.
2. **Bind** (``ShardInfo.bind(N)``): every expression evaluated for N, giving an immutable
   ``Plan``. A plan written with plain integers for another N is refused here.
3. **Validate** (``Plan.validate(metadata)``): against the checkpoint's names, shapes and dtypes,
   before any tensor data is read: functions exist, arity, each step's declared output agrees
   with the function's shape rule, the last output has N on axis 0, no step's output is
   absurdly larger than its input. The result, a ``ValidatedPlan``, is what the loader runs.

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

from . import dtypes, strict_json, symbolic
from .errors import PlanError, UnknownShardFunctionError
from .readers.base import TensorMeta

__all__ = ["ShardInfo", "Plan", "Step", "ValidatedPlan", "ParamPlan", "MAX_PLAN_BYTES",
           "MAX_GROWTH", "json_schema"]

#: plans are small; a bigger file is a mistake or an attack
MAX_PLAN_BYTES = 256 * 1024 * 1024
#: a step's output may be at most MAX_GROWTH * num_shards times its input (+ a little slack):
#: replication legitimately makes N copies, padding a little more; beyond that is a memory bomb
MAX_GROWTH = 2
_GROWTH_SLACK_BYTES = 4096

Scalar = Union[int, float, bool, None, str]


def json_schema() -> dict:
    """The JSON Schema of ``shard_info.json`` shipped with the package (draft 2020-12).

    It describes the structure; the grammar of expressions and the function-specific rules
    are checked by ``ShardInfo`` and ``Plan.validate``.
    """
    from importlib.resources import files

    return json.loads(files("shardload").joinpath("schemas/shard_info.schema.json").read_text())


# ---- 1. parse ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RawStep:
    """One step as written: shapes and args may still be ``num_shards`` expressions."""

    func: str
    out_shape: tuple[Union[int, str], ...]
    dtype: str
    extra: tuple[Scalar, ...]

    @property
    def is_symbolic(self) -> bool:
        return any(isinstance(v, str) for v in (*self.out_shape, *self.extra))

    def to_json(self) -> list:
        return [self.func, [list(self.out_shape), self.dtype], *self.extra]


def _parse_step(raw: Any, where: dict) -> RawStep:
    if not isinstance(raw, list) or len(raw) < 2:
        raise PlanError("a step must be a list [func_name, [out_shape, dtype], *extra_args]",
                        **where)
    func, out, *extra = raw
    if not isinstance(func, str) or not func:
        raise PlanError(f"the function name must be a non-empty string, got {func!r}", **where)
    if not isinstance(out, list) or len(out) != 2 or not isinstance(out[0], list):
        raise PlanError(f"the output spec must be [out_shape, dtype], got {out!r}", **where)
    shape, dtype = out
    dims: list[Union[int, str]] = []
    for k, d in enumerate(shape):
        if isinstance(d, str):
            try:
                symbolic.check_expression(d)
            except symbolic.ExpressionError as exc:
                raise PlanError(f"out_shape[{k}]: {exc}", **where) from None
        elif type(d) is not int:
            raise PlanError(f"out_shape[{k}] is {d!r}: dims must be non-negative integers or "
                            f"integer expressions of num_shards", **where)
        elif d < 0:
            raise PlanError(f"out_shape[{k}] is {d}: dims must be non-negative", **where)
        dims.append(d)
    try:
        dtype = dtypes.canonical(dtype)
    except ValueError as exc:
        raise PlanError(str(exc), **where) from None
    for k, arg in enumerate(extra):
        if isinstance(arg, str):
            try:
                symbolic.check_expression(arg)
            except symbolic.ExpressionError as exc:
                raise PlanError(f"extra arg {k}: {exc} (string args are integer expressions "
                                "of num_shards)", **where) from None
        elif not (arg is None or isinstance(arg, (bool, int, float))):
            raise PlanError(f"extra arg {k} is {arg!r}: extra args must be JSON scalars", **where)
    return RawStep(func, tuple(dims), dtype, tuple(extra))


class ShardInfo:
    """A parsed ``shard_info.json``, not yet bound to a number of shards.

    >>> info = ShardInfo.loads('{"w": [["shardload.split", [[2, 3], "int32"], 0]]}')
    >>> info.is_symbolic, info.planned_num_shards
    (False, 2)
    """

    #: the reserved key for information about the plan itself (not a parameter)
    METADATA_KEY = "__metadata__"

    def __init__(self, steps: Mapping[str, tuple[RawStep, ...]], source: Optional[str] = None,
                 metadata: Optional[Mapping[str, Any]] = None):
        self.steps: Mapping[str, tuple[RawStep, ...]] = MappingProxyType(dict(steps))
        self.source = source
        #: what the planner recorded for engines (e.g. ``tensor_parallel``: heads per worker)
        self.metadata: dict[str, Any] = dict(metadata or {})

    # -- constructors
    @classmethod
    def from_dict(cls, data: Any, source: Optional[str] = None) -> "ShardInfo":
        if not isinstance(data, Mapping):
            raise PlanError("a plan must be a JSON object {parameter: [steps...]}, got "
                            f"{type(data).__name__}", source=source)
        steps: dict[str, tuple[RawStep, ...]] = {}
        metadata = data.get(cls.METADATA_KEY, {})
        if not isinstance(metadata, Mapping):
            raise PlanError(f"{cls.METADATA_KEY} must be a JSON object", source=source)
        for name, raw_steps in data.items():
            if name == cls.METADATA_KEY:
                continue
            if not isinstance(name, str) or not name:
                raise PlanError(f"parameter names must be non-empty strings, got {name!r}",
                                source=source)
            if not isinstance(raw_steps, list):
                raise PlanError("the value must be a list of steps", source=source, param=name)
            steps[name] = tuple(_parse_step(raw, dict(source=source, param=name, step=k))
                                for k, raw in enumerate(raw_steps))
        return cls(steps, source, metadata)

    @classmethod
    def loads(cls, text: Union[str, bytes], source: Optional[str] = None) -> "ShardInfo":
        if len(text) > MAX_PLAN_BYTES:
            raise PlanError(f"plan is larger than {MAX_PLAN_BYTES} bytes", source=source)
        try:
            data = strict_json.loads(text)
        except ValueError as exc:
            raise PlanError(f"not valid JSON: {exc}", source=source) from None
        return cls.from_dict(data, source)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "ShardInfo":
        path = os.fspath(path)
        try:
            size = os.path.getsize(path)
            if size > MAX_PLAN_BYTES:
                raise PlanError(f"plan is {size} bytes, larger than {MAX_PLAN_BYTES}",
                                source=path)
            with open(path, "rb") as f:
                text = f.read()
        except OSError as exc:
            raise PlanError(f"cannot read the plan: {exc.strerror or exc}", source=path) from None
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
        return any(s.is_symbolic for steps in self.steps.values() for s in steps)

    @property
    def planned_num_shards(self) -> Optional[int]:
        """For a plan of plain integers, the N it was written for (axis 0 of last outputs)."""
        if self.is_symbolic:
            return None
        ns = {steps[-1].out_shape[0] for steps in self.steps.values()
              if steps and steps[-1].out_shape}
        return ns.pop() if len(ns) == 1 else None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {self.METADATA_KEY: self.metadata} if self.metadata else {}
        out.update({name: [s.to_json() for s in steps] for name, steps in self.steps.items()})
        return out

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
        if type(num_shards) is not int or num_shards < 1:
            raise PlanError(f"num_shards must be a positive integer, got {num_shards!r}",
                            source=self.source)
        if not self.is_symbolic:
            written = {steps[-1].out_shape[0] for steps in self.steps.values()
                       if steps and steps[-1].out_shape}
            if written and written != {num_shards}:
                planned = ", ".join(str(n) for n in sorted(written))
                raise PlanError(
                    f"this plan was written for num_shards={planned} with plain integer shapes, "
                    f"but num_shards={num_shards} was asked for. Re-plan with `shardload plan "
                    f"--shards {num_shards}` (it writes expressions of num_shards, so one plan "
                    f"serves every N), or write the shapes as expressions such as "
                    f"\"4096 // num_shards\".",
                    source=self.source)
        params = {}
        for name, raw_steps in self.steps.items():
            params[name] = tuple(self._bind_step(name, k, s, num_shards)
                                 for k, s in enumerate(raw_steps))
        return Plan(num_shards, params, self.source, self.metadata)

    def _bind_step(self, name: str, index: int, raw: RawStep, n: int) -> "Step":
        where = dict(source=self.source, param=name, step=index)

        def value(v: Scalar, what: str) -> Scalar:
            if not isinstance(v, str):
                return v
            try:
                return symbolic.evaluate(v, n)
            except symbolic.ExpressionError as exc:
                raise PlanError(f"{what}: {exc}", **where) from None

        shape = tuple(value(d, f"out_shape[{k}]") for k, d in enumerate(raw.out_shape))
        for k, d in enumerate(shape):
            if d < 0:
                raise PlanError(f"out_shape[{k}] = {raw.out_shape[k]!r} is {d} for "
                                f"num_shards={n}; dims must be non-negative", **where)
        extra = tuple(value(a, f"extra arg {k}") for k, a in enumerate(raw.extra))
        return Step(index, raw.func, shape, raw.dtype, extra)


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


class Plan:
    """A plan bound to one ``num_shards``; immutable. Build it with ``ShardInfo.bind``."""

    def __init__(self, num_shards: int, params: Mapping[str, tuple[Step, ...]],
                 source: Optional[str] = None, metadata: Optional[Mapping[str, Any]] = None):
        self.num_shards = num_shards
        self.params: Mapping[str, tuple[Step, ...]] = MappingProxyType(dict(params))
        self.source = source
        self.metadata: dict[str, Any] = dict(metadata or {})

    def __repr__(self) -> str:
        return (f"Plan(num_shards={self.num_shards}, {len(self.params)} params, "
                f"source={self.source!r})")

    def to_dict(self) -> dict:
        """The plan in ``shard_info.json`` form, every expression evaluated for this N."""
        out: dict[str, Any] = {ShardInfo.METADATA_KEY: self.metadata} if self.metadata else {}
        out.update({name: [[s.func, [list(s.out_shape), s.dtype], *s.extra] for s in steps]
                    for name, steps in self.params.items()})
        return out

    # -- 3. validate
    def validate(self, metadata: Mapping[str, TensorMeta]) -> "ValidatedPlan":
        """Check the plan against a checkpoint's metadata; no tensor data is read.

        Every parameter of the checkpoint appears in the result: those the plan names with their
        steps, the others replicated.
        """
        from .registry import get_shard_func

        unknown = [name for name in self.params if name not in metadata]
        if unknown:
            import difflib

            first = unknown[0]
            close = difflib.get_close_matches(first, list(metadata), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
            raise PlanError(f"the checkpoint has no tensor named {first!r}{hint}{more}; the "
                            "plan does not match this checkpoint", source=self.source, param=first)
        out = {}
        for name, meta in metadata.items():
            steps = self.params.get(name, ())
            funcs = []
            shape, dtype, nbytes = meta.shape, meta.dtype, meta.nbytes
            for step in steps:
                where = dict(source=self.source, param=name, step=step.index)
                try:
                    func = get_shard_func(step.func)
                except UnknownShardFunctionError:
                    raise UnknownShardFunctionError(step.func, _known_names(), **where) from None
                if not func.accepts(len(step.extra)):
                    raise PlanError(f"{step.func} takes {func.arity_text()} extra arg(s), the "
                                    f"step gives {len(step.extra)}: {list(step.extra)}", **where)
                _check_array_dtypes(func, dtype, step.dtype, where)
                if func.shape_rule is not None:
                    try:
                        rule_shape, rule_dtype = func.shape_rule(
                            shape, dtype, *step.extra, num_shards=self.num_shards)
                    except (ValueError, TypeError) as exc:
                        raise PlanError(f"{step.func} cannot apply to input {list(shape)} "
                                        f"{dtype} with args {list(step.extra)}: {exc}",
                                        **where) from None
                    rule_shape, rule_dtype = tuple(rule_shape), dtypes.canonical(rule_dtype)
                    if rule_shape != step.out_shape or rule_dtype != step.dtype:
                        raise PlanError(
                            f"declared output {list(step.out_shape)} {step.dtype} disagrees "
                            f"with {step.func}, which makes {list(rule_shape)} {rule_dtype} from "
                            f"input {list(shape)} {dtype} with num_shards={self.num_shards}",
                            **where)
                limit = MAX_GROWTH * self.num_shards * nbytes + _GROWTH_SLACK_BYTES
                if step.nbytes > limit:
                    raise PlanError(
                        f"declared output {list(step.out_shape)} {step.dtype} is {step.nbytes} "
                        f"bytes from a {nbytes}-byte input, more than {MAX_GROWTH} x num_shards "
                        "times larger; refusing to allocate it", **where)
                funcs.append(func)
                shape, dtype, nbytes = step.out_shape, step.dtype, step.nbytes
            if steps and (not shape or shape[0] != self.num_shards):
                got = shape[0] if shape else "a 0-d output"
                raise PlanError(f"the last step's output must have num_shards="
                                f"{self.num_shards} on axis 0, got {got} (shape {list(shape)})",
                                source=self.source, param=name, step=steps[-1].index)
            out[name] = ParamPlan(meta, steps, tuple(funcs))
        return ValidatedPlan(self, MappingProxyType(out))


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

    @property
    def name(self) -> str:
        return self.meta.name

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

    @property
    def staging_nbytes(self) -> int:
        """Bytes the loader holds at once for this parameter: input plus largest output."""
        return self.meta.nbytes + max((s.nbytes for s in self.steps), default=0)


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

    def bytes_per_worker(self) -> int:
        return sum(p.piece_nbytes for p in self)
