"""3. Validate: a ``Plan`` checked against a checkpoint is a ``ValidatedPlan``, what the loader
runs.

``Plan.validate(metadata)`` checks the plan against the checkpoint's names, shapes and dtypes,
before any tensor data is read: every parameter it names exists, each step's function is
registered and takes its args, each step's declared output agrees with the function's shape
rule, the last output has N on axis 0, and no intermediate is absurdly larger than the stored
tensor (``MAX_GROWTH``). Each function is looked up once, and a step shared by many parameters
is checked once for each input it meets.

>>> from shardload.plan import ShardInfo
>>> from shardload.readers.base import TensorMeta
>>> meta = {"w": TensorMeta("w", (8, 4), "float16"), "b": TensorMeta("b", (4,), "float16")}
>>> plan = ShardInfo.from_dict({"w": [["shardload.split", [[2, 4, 4], "float16"], 0]]}).bind(2)
>>> checked = plan.validate(meta)
>>> checked.params["w"].piece_shape, checked.params["b"].replicated
((4, 4), True)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from .. import dtypes
from ..errors import PlanError, UnknownShardFunctionError, quote
from ..gc_pause import gc_paused
from ..readers.base import TensorMeta
from . import limits
from .messages import brief, close_match, cut, known_names
from .steps import Step

if TYPE_CHECKING:  # pragma: no cover
    from .bound import Plan

__all__ = ["ParamPlan", "ValidatedPlan", "validate"]


def validate(plan: Plan, metadata: Mapping[str, TensorMeta]) -> ValidatedPlan:
    """``plan`` checked against a checkpoint's metadata (``Plan.validate``); no tensor data is
    read."""
    placed = plan.placement.params if plan.placement is not None else {}
    missing = [name for name in plan.params if name not in metadata]
    missing += [name for name in placed if name not in metadata]
    if missing:
        first = missing[0]
        hint = close_match(first, metadata)
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise PlanError(
            f"the checkpoint has no tensor named {quote(first)}{hint}{more}; the "
            "plan does not match this checkpoint",
            source=plan.source,
            param=first,
        )
    with gc_paused():
        return ValidatedPlan(plan, MappingProxyType(_validate(plan, metadata)))


def _validate(plan: Plan, metadata: Mapping[str, TensorMeta]) -> dict[str, ParamPlan]:
    from ..registry import get_shard_func

    n = plan.num_shards
    placed = plan.placement.params if plan.placement is not None else {}
    found: dict[str, Any] = {}  # one registry lookup per function name
    # a step shared by many parameters (every layer's), met with the same input again,
    # passes again: checked once
    passed: set[tuple] = set()
    # a tuple of steps shared by many parameters, met with the same stored shape and dtype
    # again, passes again: its functions are found once
    chains: dict[tuple, tuple] = {}
    out = {}
    get, new = plan.params.get, tuple.__new__  # ParamPlan's own __new__ is Python's
    for name, meta in metadata.items():
        steps = get(name, ())
        if not steps:
            out[name] = new(ParamPlan, (meta, (), (), placed.get(name)))
            continue
        chain_key = (id(steps), meta.shape, meta.dtype)
        funcs_before = chains.get(chain_key)
        if funcs_before is not None:
            out[name] = new(ParamPlan, (meta, steps, funcs_before, None))
            continue
        if len(steps) > limits.MAX_STEPS:
            raise PlanError(
                f"{len(steps)} steps, more than the {limits.MAX_STEPS} a parameter may have",
                source=plan.source,
                param=name,
            )
        funcs = []
        shape, dtype, stored = meta.shape, meta.dtype, meta.nbytes
        # every intermediate, not only each step against its own input: chains stay bounded
        limit = limits.MAX_GROWTH * n * stored + limits.GROWTH_SLACK_BYTES
        for step in steps:
            func = found.get(step.func)
            key = (id(step), shape, dtype, stored)
            if func is None or key not in passed:
                func = _check_step(
                    plan, name, step, shape, dtype, stored, limit, found, get_shard_func
                )
                passed.add(key)
            funcs.append(func)
            shape, dtype = step.out_shape, step.dtype
        if not shape or shape[0] != n:
            got = shape[0] if shape else "a 0-d output"
            raise PlanError(
                f"the last step's output must have num_shards={n} on axis 0, "
                f"got {got} (shape {brief(shape)})",
                source=plan.source,
                param=name,
                step=steps[-1].index,
            )
        out[name] = ParamPlan(meta, steps, chains.setdefault(chain_key, tuple(funcs)))
    return out


class _Where(TypedDict):
    """Where a step's problem is, as ``PlanError`` takes it."""

    source: str | None
    param: str
    step: int


def _check_step(
    plan: Plan,
    name: str,
    step: Step,
    shape: tuple,
    dtype: str,
    stored: int,
    limit: int,
    found: dict,
    get_shard_func,
) -> Any:
    """One step against its input: the function exists, takes the args, and its shape rule
    agrees with the declared output, which stays within the growth limit."""
    n = plan.num_shards
    where: _Where = {"source": plan.source, "param": name, "step": step.index}
    func = found.get(step.func)
    if func is None:
        try:
            func = found[step.func] = get_shard_func(step.func)
        except UnknownShardFunctionError:
            raise UnknownShardFunctionError(step.func, known_names(), **where) from None
    if not func.accepts(len(step.extra)):
        raise PlanError(
            f"{quote(step.func)} takes {func.arity_text()} extra arg(s), the "
            f"step gives {len(step.extra)}: {brief(step.extra)}",
            **where,
        )
    _check_array_dtypes(func, dtype, step.dtype, where)
    if func.shape_rule is not None:
        rule_shape, rule_dtype = _apply_rule(func, shape, dtype, step, n, where)
        if rule_shape != step.out_shape or rule_dtype != step.dtype:
            raise PlanError(
                f"declared output {brief(step.out_shape)} {step.dtype} disagrees with "
                f"{quote(step.func)}, which makes {brief(rule_shape)} {rule_dtype} from "
                f"input {brief(shape)} {dtype} with num_shards={n}",
                **where,
            )
    if step.nbytes > limit:
        raise PlanError(
            f"declared output {brief(step.out_shape)} {step.dtype} is {step.nbytes} bytes "
            f"from a {stored}-byte stored tensor, more than {limits.MAX_GROWTH} x num_shards "
            f"times larger (+ {limits.GROWTH_SLACK_BYTES} bytes); refusing to allocate it",
            **where,
        )
    return func


def _apply_rule(
    func, shape: tuple, dtype: str, step: Step, n: int, where: _Where
) -> tuple[tuple[int, ...], str]:
    """``func``'s shape rule applied to the step; its refusal as a ``PlanError``."""
    try:
        rule_shape, rule_dtype = func.shape_rule(shape, dtype, *step.extra, num_shards=n)
        return tuple(rule_shape), dtypes.canonical(rule_dtype)
    except (ValueError, TypeError, ArithmeticError, LookupError) as exc:
        raise PlanError(
            f"{quote(step.func)} cannot apply to input {brief(shape)} {dtype} with "
            f"args {brief(step.extra)}: {cut(str(exc))}",
            **where,
        ) from None


_NOT_NUMPY = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def _check_array_dtypes(func, in_dtype: str, out_dtype: str, where: _Where) -> None:
    if func.array == "numpy" and (in_dtype in _NOT_NUMPY or out_dtype in _NOT_NUMPY):
        raise PlanError(
            f"{func.name} takes numpy arrays, and numpy has no "
            f"{in_dtype if in_dtype in _NOT_NUMPY else out_dtype}; register it "
            "with array='torch'",
            **where,
        )


#: the steps that take whole units of a tensor, ``-1`` a zero unit (``shard_functions.builtin``)
_TAKE_UNITS = ("shardload.take_units", "shardload.take_units_fill")


class ParamPlan(NamedTuple):
    """What the loader does with one parameter (a named tuple, as ``readplan.PieceRead``: a plan
    may hold a million, and a tuple is made several times faster than a frozen dataclass)."""

    meta: TensorMeta
    steps: tuple[Step, ...]
    funcs: tuple  # ShardFunc per step
    #: the workers holding it whole (``__placement__``); None: every worker holds its piece
    workers: tuple[int, ...] | None = None

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

    @property
    def padding_bytes(self) -> int:
        """Bytes of zero units a padded plan adds for this parameter, over all workers: the
        ``-1`` indices of its ``take_units`` steps (written only by the planners' padding),
        each a unit of the stored tensor along ``dim``.

        >>> from shardload.plan import ShardInfo
        >>> from shardload.readers.base import TensorMeta
        >>> meta = {"w": TensorMeta("w", (3, 4), "float32")}
        >>> take = ["shardload.take_units", [[2, 2, 4], "float32"], 0, 1, 0, 1, 2, -1]
        >>> ShardInfo.from_dict({"w": [take]}).bind(2).validate(meta).params["w"].padding_bytes
        16
        """
        total = 0
        for step in self.steps:
            if step.func in _TAKE_UNITS:
                dim, unit, *indices = step.extra
                if step.func == "shardload.take_units_fill":
                    indices = indices[1:]  # after the fill
                per_unit = self.meta.nbytes // max(self.meta.shape[dim], 1) * unit
                total += indices.count(-1) * per_unit
        return total


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

    @property
    def padding_bytes(self) -> int:
        """Bytes of zero units the plan adds, over all parameters and workers."""
        return sum(p.padding_bytes for p in self)

    def bytes_per_worker(self, worker: int | None = None) -> int:
        """The bytes of the pieces one worker keeps: worker ``worker``'s, or (``None``) the
        most any worker keeps."""
        if worker is not None:
            return _piece_bytes(self.held_by(worker))
        if self.plan.placement is None:
            return _piece_bytes(self)
        return max(self.bytes_per_worker(w) for w in range(self.num_shards))


def _piece_bytes(params: Iterable[ParamPlan]) -> int:
    """The bytes of the pieces of ``params``, each kind of piece sized once: parameters with the
    same steps share one tuple of them (``ShardInfo.from_dict``), replicated ones their shape."""
    sizes: dict[Any, int] = {}
    total = 0
    for p in params:
        key = id(p.steps) if p.steps else (p.meta.shape, p.meta.dtype)
        size = sizes.get(key)
        if size is None:
            size = sizes[key] = p.piece_nbytes
        total += size
    return total
