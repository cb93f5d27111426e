"""1. Parse: ``shard_info.json`` (a file, its text or a dict) into a ``ShardInfo``.

A plan file is a regular file of at most ``MAX_PLAN_BYTES``, strict UTF-8 JSON (see
``strict_json``: no duplicate keys, NaN/Infinity, numbers overflowing to infinity or lone
surrogates); the structure of each step is checked by ``_parse_step`` within the stated limits
(``limits``). Shapes and extra args may still be expressions of ``num_shards``: each distinct
one is parsed once, and a step repeated for every layer is parsed once. ``ShardInfo.bind``
makes the ``Plan`` for one N (``bound``).

>>> info = ShardInfo.loads('{"w": [["shardload.split", [[2, 3], "int32"], 0]]}')
>>> info.steps["w"][0].out_shape
(2, 3)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .. import dtypes, files, strict_json, symbolic
from ..errors import PlanError, quote
from ..gc_pause import gc_paused
from . import bound, limits
from .messages import brief, cut
from .placement import Placement, check_placed
from .steps import METADATA_KEY, RawStep, plan_json

__all__ = ["ShardInfo"]


Expressions = dict[str, symbolic.Evaluator]


def _expression(text: str, what: str, exprs: Expressions, where: dict, hint: str = "") -> None:
    """Check the expression ``text`` once per plan (``exprs`` holds those already seen)."""
    if text in exprs:
        return
    if len(exprs) >= limits.MAX_EXPRESSIONS:
        raise PlanError(
            f"{what}: the plan holds more than {limits.MAX_EXPRESSIONS} distinct "
            "num_shards expressions; real plans repeat a few per tensor shape",
            **where,
        )
    try:
        exprs[text] = symbolic.compile(text)
    except symbolic.ExpressionError as exc:
        raise PlanError(f"{what}: {exc}{hint}", **where) from None


def _parse_step(raw: Any, where: dict, exprs: Expressions) -> RawStep:
    if not isinstance(raw, list) or len(raw) < 2:
        raise PlanError(
            "a step must be a list [func_name, [out_shape, dtype], *extra_args]", **where
        )
    if len(raw) - 2 > limits.MAX_EXTRA_ARGS:
        raise PlanError(
            f"the step has {len(raw) - 2} extra args, more than the "
            f"{limits.MAX_EXTRA_ARGS} a step may have",
            **where,
        )
    func, out, extra = raw[0], raw[1], raw[2:]
    if not isinstance(func, str) or not func:
        raise PlanError(f"the function name must be a non-empty string, got {brief(func)}", **where)
    if not strict_json.is_text(func):
        raise PlanError(
            f"the function name {quote(func)} is not valid Unicode (it holds a lone surrogate)",
            **where,
        )
    if not isinstance(out, list) or len(out) != 2 or not isinstance(out[0], list):
        raise PlanError(f"the output spec must be [out_shape, dtype], got {brief(out)}", **where)
    shape, dtype = out
    if len(shape) > limits.MAX_DIMS:
        raise PlanError(
            f"out_shape has {len(shape)} dims, more than the {limits.MAX_DIMS} a tensor may have",
            **where,
        )
    dims: list[int | str] = []
    for k, d in enumerate(shape):
        if isinstance(d, str):
            d = str(d)
            _expression(d, f"out_shape[{k}]", exprs, where)
        elif type(d) is not int:
            raise PlanError(
                f"out_shape[{k}] is {brief(d)}: dims must be non-negative integers "
                f"or integer expressions of num_shards",
                **where,
            )
        elif d < 0:
            raise PlanError(f"out_shape[{k}] is {d}: dims must be non-negative", **where)
        elif d > limits.MAX_DIM:
            raise PlanError(
                f"out_shape[{k}] is {quote(d)}, beyond the {limits.MAX_DIM} (2**53) "
                "any dim may have",
                **where,
            )
        dims.append(d)
    try:
        dtype = dtypes.canonical(dtype)
    except ValueError as exc:
        raise PlanError(str(exc), **where) from None
    lo, hi = limits.INT64_RANGE
    for k, arg in enumerate(extra):
        if isinstance(arg, str):
            if type(arg) is not str:
                extra[k] = arg = str(arg)
            _expression(
                arg,
                f"extra arg {k}",
                exprs,
                where,
                " (string args are integer expressions of num_shards)",
            )
        elif arg is None or isinstance(arg, bool):
            pass
        elif isinstance(arg, (int, float)):
            if not lo <= arg <= hi:  # false for NaN too
                raise PlanError(
                    f"extra arg {k} is {quote(arg, 40)}: numbers in a plan lie "
                    "within the int64 range",
                    **where,
                )
        else:
            raise PlanError(
                f"extra arg {k} is {brief(arg)}: extra args must be JSON scalars", **where
            )
    return RawStep(func, tuple(dims), dtype, tuple(extra))


def _step_key(raw: Any) -> tuple | None:
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


def _check_metadata(metadata: Mapping, source: str | None) -> None:
    """``__metadata__`` travels to worker processes as JSON: only JSON values, finite numbers,
    string keys and valid Unicode (a plan from ``strict_json`` already is; a Python dict may not
    be)."""
    stack: list[tuple[Any, str]] = [(metadata, METADATA_KEY)]
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
                    bad = f"a key {brief(key)}: keys must be strings of valid Unicode"
                    break
                stack.append((item, path if len(path) > 200 else f"{path}.{key}"))
        elif isinstance(value, (list, tuple)):
            stack.extend(
                (item, path if len(path) > 200 else f"{path}[{k}]") for k, item in enumerate(value)
            )
        elif isinstance(value, str):
            if not strict_json.is_text(value):
                bad = f"the string {quote(value)}, which is not valid Unicode (a lone surrogate)"
        elif isinstance(value, float):
            if not math.isfinite(value):
                bad = f"{value}, which is not a JSON number"
        elif not (value is None or isinstance(value, (bool, int))):
            bad = f"a {type(value).__name__}, which is not a JSON value"
        if bad:
            raise PlanError(f"{cut(path, 200)} holds {bad}", source=source)


class ShardInfo:
    """A parsed ``shard_info.json``, not yet bound to a number of shards.

    >>> info = ShardInfo.loads('{"w": [["shardload.split", [[2, 3], "int32"], 0]]}')
    >>> info.is_symbolic, info.planned_num_shards
    (False, 2)
    """

    #: the reserved key for information about the plan itself (not a parameter)
    METADATA_KEY = METADATA_KEY

    def __init__(
        self,
        steps: Mapping[str, tuple[RawStep, ...]],
        source: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        placement: Placement | None = None,
    ):
        self.steps: Mapping[str, tuple[RawStep, ...]] = MappingProxyType(dict(steps))
        self.source = source
        #: what the planner recorded for engines (e.g. ``tensor_parallel``: heads per worker)
        self.metadata: dict[str, Any] = dict(metadata or {})
        #: whole parameters held by some workers only (expert parallelism), or None
        self.placement = placement
        if placement is not None:
            check_placed(placement, self.steps, source)
        # the plan's expressions, each compiled once (filled by from_dict, or on first bind)
        self._exprs: Expressions = {}
        self._symbolic: bool | None = None

    # -- constructors
    @classmethod
    def from_dict(
        cls, data: Any, source: str | None = None, *, _strict_json: bool = False
    ) -> ShardInfo:
        if not isinstance(data, Mapping):
            raise PlanError(
                "a plan must be a JSON object {parameter: [steps...]}, got "
                f"{type(data).__name__}",
                source=source,
            )
        count = len(data) - (cls.METADATA_KEY in data) - (Placement.KEY in data)
        if count > limits.MAX_PARAMS:
            raise PlanError(
                f"the plan names {count} parameters, more than the "
                f"{limits.MAX_PARAMS} a plan may have",
                source=source,
            )
        steps: dict[str, tuple[RawStep, ...]] = {}
        metadata = data.get(cls.METADATA_KEY, {})
        if not isinstance(metadata, Mapping):
            raise PlanError(
                f"{cls.METADATA_KEY} must be a JSON object, got {type(metadata).__name__}",
                source=source,
            )
        if not _strict_json:
            _check_metadata(metadata, source)
        placement = (
            Placement.from_json(data[Placement.KEY], source) if Placement.KEY in data else None
        )
        exprs: Expressions = {}
        # real plans repeat each step for every layer: a step already parsed is reused, and
        # a list of steps a planner shares among its parameters is parsed once (``data``
        # holds every list while this runs, so an id names one list)
        seen: dict[tuple, RawStep] = {}
        shared: dict[int, tuple[RawStep, ...]] = {}
        # and parameters with the same steps share one tuple of them, which binding,
        # validating and read planning then work out once (they key on the tuple)
        chains: dict[tuple[int, ...], tuple[RawStep, ...]] = {}
        for name, raw_steps in data.items():
            if name == cls.METADATA_KEY or name == Placement.KEY:
                continue
            if not isinstance(name, str) or not name:
                raise PlanError(
                    f"parameter names must be non-empty strings, got {brief(name)}", source=source
                )
            if not (name.isascii() or strict_json.is_text(name)):
                raise PlanError(
                    f"the parameter name {quote(name)} is not valid Unicode (it "
                    "holds a lone surrogate)",
                    source=source,
                )
            parsed_before = shared.get(id(raw_steps))
            if parsed_before is not None:
                steps[name] = parsed_before
                continue
            if not isinstance(raw_steps, list):
                raise PlanError("the value must be a list of steps", source=source, param=name)
            if len(raw_steps) > limits.MAX_STEPS:
                raise PlanError(
                    f"{len(raw_steps)} steps, more than the {limits.MAX_STEPS} a "
                    "parameter may have",
                    source=source,
                    param=name,
                )
            parsed = []
            for k, raw in enumerate(raw_steps):
                key = _step_key(raw)
                step = seen.get(key) if key is not None else None
                if step is None:
                    step = _parse_step(raw, dict(source=source, param=name, step=k), exprs)
                    if key is not None:
                        seen[key] = step
                parsed.append(step)
            chain = tuple(parsed)
            chain = chains.setdefault(tuple(map(id, chain)), chain)
            steps[name] = shared[id(raw_steps)] = chain
        info = cls(steps, source, metadata, placement)
        info._exprs = exprs
        return info

    @classmethod
    def loads(cls, text: str | bytes, source: str | None = None) -> ShardInfo:
        """Parse plan text: UTF-8 JSON (bytes are decoded as UTF-8 and nothing else)."""
        if len(text) > limits.MAX_PLAN_BYTES:
            raise PlanError(
                f"the plan is {len(text)} bytes, over the "
                f"{limits.MAX_PLAN_BYTES}-byte limit for a plan",
                source=source,
            )
        try:
            data = strict_json.loads(text)
        except ValueError as exc:
            raise PlanError(f"not valid JSON: {cut(str(exc))}", source=source) from None
        with gc_paused():
            return cls.from_dict(data, source, _strict_json=True)

    @classmethod
    def load(cls, path: str | os.PathLike, source: str | None = None) -> ShardInfo:
        """Read and parse a plan file. It must be a regular file (a FIFO, a device, a directory
        or a symlink loop is a ``PlanError``) of at most ``MAX_PLAN_BYTES``, or an object in
        object storage (``s3://...``) of at most that size, checked before it is fetched.
        ``source``: what messages call it (default: the path)."""
        from ..sources import is_object_url

        if is_object_url(path):
            from ..sources.store import default_client

            url = os.fsdecode(path)  # (an object URL is a string)

            def too_big(size: int) -> PlanError:
                return PlanError(
                    f"the plan is {size} bytes, over the {limits.MAX_PLAN_BYTES}"
                    f"-byte limit for a plan",
                    source=source or url,
                )

            text = default_client().read_capped(url, limits.MAX_PLAN_BYTES, too_big)
            return cls.loads(text, source=source or url)
        path = os.fsdecode(path)
        source = path if source is None else source
        text = files.read_capped(
            path, limits.MAX_PLAN_BYTES, "the plan", error=lambda m: PlanError(m, source=source)
        )
        return cls.loads(text, source=source)

    @classmethod
    def coerce(cls, obj: Any) -> ShardInfo:
        """A ``ShardInfo`` from a ShardInfo, a dict, a path, or ``None`` (replicate all)."""
        if isinstance(obj, ShardInfo):
            return obj
        if obj is None:
            return cls({})
        if isinstance(obj, (str, os.PathLike)):
            return cls.load(obj)
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        raise TypeError(
            f"shard_info must be a ShardInfo, a dict, a path or None, not {type(obj).__name__}"
        )

    # -- inspection
    @property
    def is_symbolic(self) -> bool:
        """True when some shape or arg is an expression of ``num_shards``."""
        if self._symbolic is None:
            self._symbolic = any(s.is_symbolic for steps in self.chains() for s in steps)
        return self._symbolic

    def chains(self) -> list[tuple[RawStep, ...]]:
        """Each distinct tuple of steps once (parameters with the same steps share one:
        ``from_dict``), for what is asked of every parameter's steps."""
        return list({id(steps): steps for steps in self.steps.values()}.values())

    @property
    def planned_num_shards(self) -> int | None:
        """For a plan of plain integers, the N it was written for (axis 0 of last outputs);
        for a plan with a placement, its N."""
        if self.placement is not None:
            return self.placement.num_shards
        if self.is_symbolic:
            return None
        ns = {steps[-1].out_shape[0] for steps in self.chains() if steps and steps[-1].out_shape}
        n = ns.pop() if len(ns) == 1 else None
        return n if isinstance(n, int) else None  # (not symbolic: no dim is an expression)

    def to_dict(self) -> dict:
        """The plan in ``shard_info.json`` form, expressions kept."""
        return plan_json(self.metadata, self.steps, self.placement)

    def dumps(self) -> str:
        """JSON text with one parameter per line: diffable and still small."""
        lines = [
            f" {json.dumps(name)}: {json.dumps(steps)}" for name, steps in self.to_dict().items()
        ]
        return "{\n" + ",\n".join(lines) + "\n}\n" if lines else "{}\n"

    def dump(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        kind = "symbolic" if self.is_symbolic else f"num_shards={self.planned_num_shards}"
        return f"ShardInfo({len(self)} params, {kind}, source={self.source!r})"

    # -- 2. bind

    # -- 2. bind
    def bind(self, num_shards: int) -> bound.Plan:
        """Evaluate every expression for ``num_shards``; refuse a plan written for another N."""
        return bound.bind(self, num_shards, self._exprs)
