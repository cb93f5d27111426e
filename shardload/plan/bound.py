"""2. Bind: a ``ShardInfo`` bound to one ``num_shards`` is a ``Plan``.

``ShardInfo.bind(N)`` evaluates every expression for N (at most ``MAX_NUM_SHARDS``), each
distinct one once, giving an immutable ``Plan`` of ``Step``s. A plan written with plain integers
for another N is refused here, with the way to re-plan, and so is a plan placed for another N
and a shape no tensor can have (a dim beyond 2**53, a byte span beyond int64).
``Plan.validate`` checks it against a checkpoint (``validated``).

>>> from shardload.plan import ShardInfo
>>> plan = ShardInfo.from_dict({"w": [["shardload.split", [["num_shards", "8 // num_shards"],
...                                                       "float16"], 0]]}).bind(2)
>>> plan.params["w"][0].out_shape, plan.params["w"][0].nbytes
((2, 4), 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .. import dtypes, symbolic
from ..errors import PlanError, Setting, mention, quote
from ..gc_pause import gc_paused
from ..limits import num_shards_problem
from ..readers.base import TensorMeta
from . import limits, validated
from .messages import brief
from .placement import Placement, check_placed
from .steps import RawStep, Step, plan_json

if TYPE_CHECKING:  # pragma: no cover
    from .parse import Expressions, ShardInfo

__all__ = ["Plan", "bind", "check_worker_count"]


def check_worker_count(num_shards: Any, source: str | None) -> None:
    """A ``PlanError`` unless ``num_shards`` is a number of workers shardload runs."""
    problem = num_shards_problem(num_shards)
    if problem is not None:
        raise PlanError(f"num_shards {problem}", source=source)


def bind(info: ShardInfo, num_shards: int, exprs: Expressions) -> Plan:
    """``info`` bound to ``num_shards`` (``ShardInfo.bind``): every expression evaluated, each
    distinct one once (``exprs`` holds those the plan compiled, and gains those it had not);
    a plan written for another N is refused with the way to re-plan."""
    check_worker_count(num_shards, info.source)
    if info.placement is not None and info.placement.num_shards != num_shards:
        replan = Setting(
            f"plan_for(checkpoint, num_shards={num_shards}, experts='ep')",
            f"shardload plan --shards {num_shards} --experts ep",
        )
        raise mention(
            PlanError(
                f"this plan places whole parameters on the workers of "
                f"num_shards={info.placement.num_shards} ({Placement.KEY}), but "
                f"num_shards={num_shards} was asked for. Re-plan for {num_shards} workers with "
                f"`{replan.python}`.",
                source=info.source,
            ),
            replan,
        )
    if not info.is_symbolic:
        written = {
            steps[-1].out_shape[0] for steps in info.chains() if steps and steps[-1].out_shape
        }
        if written and written != {num_shards}:
            planned = ", ".join(str(n) for n in sorted(written)[:8])
            if len(written) > 8:
                planned += f", ... ({len(written)} values)"
            first = next(
                name
                for name, steps in info.steps.items()
                if steps and steps[-1].out_shape and steps[-1].out_shape[0] != num_shards
            )
            replan = Setting(
                f"plan_for(checkpoint, num_shards={num_shards})",
                f"shardload plan --shards {num_shards}",
            )
            raise mention(
                PlanError(
                    f"this plan was written for num_shards={planned} with plain integer shapes, "
                    f"but num_shards={num_shards} was asked for. Re-plan with "
                    f"`{replan.python}` (it writes expressions of num_shards, so one plan "
                    f"serves every N), or write the shapes as expressions such as "
                    f'"4096 // num_shards".',
                    source=info.source,
                    param=first,
                ),
                replan,
            )
    values: dict[str, int] = {}  # each distinct expression evaluated once for this N
    bound: dict[tuple[int, int], Step] = {}  # a step shared by many parameters, bound once
    chains: dict[int, tuple[Step, ...]] = {}  # and a tuple of steps shared by them
    params = {}
    with gc_paused():
        for name, raw_steps in info.steps.items():
            chain = chains.get(id(raw_steps))
            if chain is not None:
                params[name] = chain
                continue
            steps = []
            for k, raw in enumerate(raw_steps):
                step = bound.get((id(raw), k))
                if step is None:
                    step = bound[id(raw), k] = _bind_step(
                        info.source, name, k, raw, num_shards, values, exprs
                    )
                steps.append(step)
            params[name] = chains[id(raw_steps)] = tuple(steps)
    return Plan(num_shards, params, info.source, info.metadata, info.placement)


def _bind_step(
    source: str | None,
    name: str,
    index: int,
    raw: RawStep,
    n: int,
    values: dict[str, int],
    exprs: Expressions,
) -> Step:
    if raw.symbolic_shape:
        shape = _evaluate(source, raw.out_shape, "out_shape[{}]", n, values, name, index, exprs)
    else:
        shape = raw.out_shape
    if len(shape) > limits.MAX_DIMS:
        raise PlanError(
            f"out_shape has {len(shape)} dims, more than the {limits.MAX_DIMS} a tensor may have",
            source=source,
            param=name,
            step=index,
        )
    problem = None
    for k, d in enumerate(shape):
        if d < 0:
            problem = (
                f"out_shape[{k}] = {quote(raw.out_shape[k])} is {d} for "
                f"num_shards={n}; dims must be non-negative"
            )
            break
    else:
        why = dtypes.shape_problem(shape, raw.dtype)
        if why:
            problem = f"out_shape {brief(shape)} {raw.dtype} for num_shards={n}: {why}"
    if problem:
        raise PlanError(problem, source=source, param=name, step=index)
    if raw.symbolic_extra:
        extra = _evaluate(source, raw.extra, "extra arg {}", n, values, name, index, exprs)
    else:
        extra = raw.extra
    return Step(index, raw.func, shape, raw.dtype, extra)


def _evaluate(
    source: str | None,
    items: tuple,
    what: str,
    n: int,
    values: dict[str, int],
    name: str,
    index: int,
    exprs: Expressions,
) -> tuple:
    """``items`` with every expression evaluated for ``n`` (each text once per bind)."""
    out = list(items)
    for k, v in enumerate(items):
        if type(v) is not str:
            continue
        got = values.get(v)
        if got is None:
            try:
                evaluator = exprs.get(v)
                if evaluator is None:
                    evaluator = exprs[v] = symbolic.compile(v)
                got = values[v] = evaluator(n)
            except symbolic.ExpressionError as exc:
                raise PlanError(
                    f"{what.format(k)}: {exc}", source=source, param=name, step=index
                ) from None
        out[k] = got
    return tuple(out)


class Plan:
    """A plan bound to one ``num_shards``; immutable. Build it with ``ShardInfo.bind``."""

    def __init__(
        self,
        num_shards: int,
        params: Mapping[str, tuple[Step, ...]],
        source: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        placement: Placement | None = None,
    ):
        check_worker_count(num_shards, source)
        if placement is not None:
            if placement.num_shards != num_shards:
                raise PlanError(
                    f"{Placement.KEY} is for num_shards={placement.num_shards}, "
                    f"the plan is bound to {num_shards}",
                    source=source,
                )
            check_placed(placement, params, source)
        self.num_shards = num_shards
        self.params: Mapping[str, tuple[Step, ...]] = MappingProxyType(dict(params))
        self.source = source
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.placement = placement

    def __repr__(self) -> str:
        return (
            f"Plan(num_shards={self.num_shards}, {len(self.params)} params, source={self.source!r})"
        )

    def to_dict(self) -> dict:
        """The plan in ``shard_info.json`` form, every expression evaluated for this N."""
        return plan_json(self.metadata, self.params, self.placement)

    # -- 3. validate (``validated``)
    def validate(self, metadata: Mapping[str, TensorMeta]) -> validated.ValidatedPlan:
        """Check the plan against a checkpoint's metadata; no tensor data is read.

        Every parameter of the checkpoint appears in the result: those the plan names with their
        steps, the others replicated (or held whole by the workers ``__placement__`` names).
        """
        return validated.validate(self, metadata)
