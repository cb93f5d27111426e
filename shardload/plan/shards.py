"""Which N a plan works for, found by binding and validating it: any plan, hand-written or
planned.

``valid_num_shards`` lists the N (up to ``MAX_SHARDS_TRIED``) for which the plan binds and
validates on a checkpoint; ``check_plan_fits`` binds and validates it for one N and, where it
does not fit, says which N do. (The planner knows the N its own plans fit without binding
them: ``planners.fit``.)

>>> info = ShardInfo.load("examples/tiny_llama_q4/shard_info.json")     # doctest: +SKIP
>>> valid_num_shards(info, open_checkpoint("examples/tiny_llama_q4"))    # doctest: +SKIP
[1, 2, 4, 8]
"""

from __future__ import annotations

from ..errors import PlanError, mention
from ..readers import Checkpoint, as_checkpoint
from .parse import ShardInfo
from .validated import ValidatedPlan

__all__ = [
    "MAX_SHARDS_TRIED",
    "MAX_VALIDATION_WORK",
    "ValidNumShards",
    "check_plan_fits",
    "valid_num_shards",
]

#: ``valid_num_shards`` tries every N up to this
MAX_SHARDS_TRIED = 64
#: ``valid_num_shards`` binds and validates at most this many shape dims and step args in all
#: (summed over the N tried): a huge hand-written plan gets a shorter list, or none, not minutes
MAX_VALIDATION_WORK = 4_000_000


class ValidNumShards(list):
    """The N that work, in order (a list), and how far they were looked for: ``tried`` is the
    largest N tried (every N from 1 to it was), ``limit`` the N asked for. ``complete`` is
    false when the plan was too large to try every N up to ``limit`` (``MAX_VALIDATION_WORK``).
    """

    def __init__(self, valid=(), *, tried: int, limit: int = MAX_SHARDS_TRIED):
        super().__init__(valid)
        self.tried = tried
        self.limit = limit

    @property
    def complete(self) -> bool:
        return self.tried >= self.limit

    def describe(self) -> str:
        """``N that work (up to 64): 1, 2, 4``, or what could not be computed."""
        shown = ", ".join(map(str, self)) if self else "none"
        if self.complete:
            return f"N that work (up to {self.limit}): {shown}"
        if self.tried == 0:
            return (
                "the N that work were not computed: the plan is too large to validate "
                f"for each N (over {MAX_VALIDATION_WORK} shape dims and step args)"
            )
        return (
            f"N that work (up to {self.tried}; the plan is too large to try every N up to "
            f"{self.limit}): {shown}"
        )


def check_plan_fits(info: ShardInfo, params: Checkpoint | str, num_shards: int) -> ValidatedPlan:
    """The plan bound to ``num_shards`` and validated against the checkpoint; where it does not
    fit, ``PlanError`` naming the constraint and the N that work.

    >>> check_plan_fits(info, "examples/tiny_llama_q4", 4).num_shards    # doctest: +SKIP
    4
    """
    ckpt = as_checkpoint(params)
    try:
        return info.bind(num_shards).validate(ckpt.metadata())
    except PlanError as exc:
        _refuse(info, ckpt, num_shards, exc)
        raise  # _refuse raises


def _refuse(info: ShardInfo, ckpt: Checkpoint, num_shards: int, exc: PlanError):
    valid = valid_num_shards(info, ckpt)
    if not valid and valid.complete:
        raise exc  # no N fits: the problem is not the number of workers
    error = PlanError(
        f"{ckpt.source} cannot be split over {num_shards} workers: {exc.constraint.rstrip('.')}",
        source=info.source,
        param=exc.param,
        working=valid,
    )
    raise mention(error, *getattr(exc, "settings", ())) from None


def _distinct_params(info: ShardInfo, metadata) -> tuple[ShardInfo, dict, int] | None:
    """The plan reduced to one parameter per distinct (stored shape, dtype, steps), with the
    metadata of those, and the work one bind+validate of it costs; ``None`` if the plan names
    a tensor the checkpoint lacks (then no N works).

    ``Plan.validate`` judges each parameter on its own stored shape, dtype and steps, so a
    parameter that repeats another's (every layer of a model does) is valid for exactly the
    same N. Taking the first of each in checkpoint order, the reduced plan fails for an N at
    the very parameter the whole plan would.
    """
    if any(name not in metadata for name in info.steps):
        return None
    steps, metas, seen, work = {}, {}, set(), 0
    for name, meta in metadata.items():
        raw = info.steps.get(name)
        if not raw:
            continue
        # typed: an arg True must not stand in for an arg 1, nor 1.0 for 1
        key = (
            meta.shape,
            meta.dtype,
            tuple(
                (s.func, s.out_shape, s.dtype, tuple((type(a), a) for a in s.extra)) for s in raw
            ),
        )
        if key in seen:
            continue
        seen.add(key)
        steps[name], metas[name] = raw, meta
        work += sum(1 + len(s.out_shape) + len(s.extra) for s in raw)
    return ShardInfo(steps, info.source, info.metadata), metas, max(work, 1)


def valid_num_shards(
    info: ShardInfo, params: Checkpoint | str, limit: int = MAX_SHARDS_TRIED
) -> ValidNumShards:
    """Every N up to ``limit`` for which the plan binds and validates on this checkpoint.

    Cheap even for a large plan: each distinct parameter (shape, dtype and steps) is validated
    once per N, stopping at the first that fails, and the work is capped at
    ``MAX_VALIDATION_WORK`` (beyond it, fewer N are tried: ``ValidNumShards.tried`` says).
    """
    metadata = as_checkpoint(params).metadata()
    planned = info.planned_num_shards
    if planned is not None:  # plain integers, or a placement: that one N, if it validates
        n = planned
        try:
            info.bind(n).validate(metadata)
        except PlanError:
            return ValidNumShards([], tried=limit, limit=limit)
        return ValidNumShards([n] if n <= limit else [], tried=limit, limit=limit)
    reduced = _distinct_params(info, metadata)
    if reduced is None:
        return ValidNumShards([], tried=limit, limit=limit)
    plan, metas, work = reduced
    tried = max(0, min(limit, MAX_VALIDATION_WORK // work))
    valid = []
    for n in range(1, tried + 1):
        try:
            plan.bind(n).validate(metas)
        except PlanError:
            continue
        valid.append(n)
    return ValidNumShards(valid, tried=tried, limit=limit)
