"""Which plan a load uses: one policy for every caller.

``resolve_plan(checkpoint, num_shards, shard_info)`` decides, in this order:

1. ``shard_info`` is ``REPLICATE``: every tensor whole on every worker (the format's rule for a
   parameter without steps, chosen explicitly);
2. ``shard_info`` is given (a path, a dict, a ``ShardInfo``, a bound ``Plan`` or a
   ``ValidatedPlan``): that plan, as it is;
3. a ``shard_info.json`` beside the checkpoint (in the folder the reader resolved: a Hugging
   Face cache folder resolves to its snapshot); one that shardload's planner wrote (it records
   the model, ``__metadata__.model``) and that does not fit N gives way to step 4 where the
   planner zero-pads for N: it is the planner's own work for every N it fits, kept, and the
   planner would write the padded plan for this N from the same config (``ResolvedPlan.note``
   says so, in one line, for the caller to show);
4. a plan made from the checkpoint's config (``planners.plan_decision``: zero-padded where N
   does not divide the heads or the MLP, refused with the N that work where even that cannot
   be exact);
5. nothing to plan from (no plan and no config: an in-memory mapping of arrays): the planner's
   ``PlanError``, saying to pass a plan or ``REPLICATE``.

The plan is bound to N and validated against the checkpoint once, here; the loader runs the
``ValidatedPlan`` without validating it again. A plan that does not fit N says which N do,
where that is the problem. The planner's options (``experts``, ``vocab_parallel``, ``pad``)
apply to step 4 only: with a plan of one's own they are refused, not ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import EXPERTS_EP, PlanError, Setting, mention, quote
from ..plan import Plan, ShardInfo, ValidatedPlan, check_plan_fits, valid_num_shards
from ..readers import Checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from ..planners.decision import PlanDecision

__all__ = [
    "PLAN_FILE",
    "REPLICATE",
    "ResolvedPlan",
    "plan_beside",
    "planned_fits",
    "resolve_plan",
]

#: the name of a plan beside its checkpoint
PLAN_FILE = "shard_info.json"


class _Replicate:
    """Every tensor whole on every worker: ``load_sharded(params, REPLICATE, session)``."""

    def __repr__(self) -> str:
        return "shardload.REPLICATE"


REPLICATE: Any = _Replicate()


@dataclass(frozen=True)
class ResolvedPlan:
    """The plan a load uses, validated for its N, and where it came from.

    ``origin``: ``"replicate"``, ``"given"``, ``"beside"`` (``shard_info.json`` next to the
    checkpoint) or ``"planned"`` (from the config; ``decision`` is the planner's); ``source``
    names it for people (the file, or ``<plan for CKPT>``). ``note``: one line saying why this
    is not the plan beside the checkpoint, where there is one and it did not fit N (step 3);
    empty otherwise.
    """

    validated: ValidatedPlan
    origin: str
    source: str
    decision: Any = None
    note: str = ""

    @property
    def plan(self) -> Plan:
        return self.validated.plan


def plan_beside(checkpoint: Checkpoint) -> str | None:
    """The ``shard_info.json`` beside the checkpoint, if there is one. "Beside" is the folder
    the reader resolved (``checkpoint.path``: a Hugging Face cache folder resolves to its
    snapshot), or a file checkpoint's folder. Anything there by that name is taken as the plan,
    so a directory or a dangling link is reported rather than silently ignored."""
    base = getattr(checkpoint, "path", None) or checkpoint.source
    if not isinstance(base, str) or not os.path.exists(base):
        return None
    folder = base if os.path.isdir(base) else os.path.dirname(base)
    candidate = os.path.join(folder, PLAN_FILE)
    return candidate if os.path.lexists(candidate) else None


def _for_n(info: ShardInfo, checkpoint: Checkpoint, num_shards: int) -> ValidatedPlan:
    """``info`` bound to N and validated; a refusal of a symbolic plan lists the N that work,
    where other N do (a plan that fits no N says only what is wrong)."""
    if info.is_symbolic:
        return check_plan_fits(info, checkpoint, num_shards)
    return info.bind(num_shards).validate(checkpoint.metadata())


def _given(shard_info: Any, checkpoint: Checkpoint, num_shards: int) -> ValidatedPlan:
    if isinstance(shard_info, (ValidatedPlan, Plan)):  # already bound to an N
        from ..loader import validated_for

        return validated_for(shard_info, num_shards, checkpoint)
    return _for_n(ShardInfo.coerce(shard_info), checkpoint, num_shards)


def _label(shard_info: Any) -> str:
    if isinstance(shard_info, (str, os.PathLike)):
        return os.fspath(shard_info)
    source = getattr(shard_info, "source", None) or getattr(
        getattr(shard_info, "plan", None), "source", None
    )
    return source or "<plan given>"


def resolve_plan(
    checkpoint: Checkpoint,
    num_shards: int,
    shard_info: Any = None,
    *,
    experts: str = "tp",
    vocab_parallel: bool = False,
    pad: bool = True,
) -> ResolvedPlan:
    """The plan for loading ``checkpoint`` onto ``num_shards`` workers, by the policy above.

    >>> resolved = resolve_plan(open_checkpoint("examples/tiny_llama_q4"), 4)  # doctest: +SKIP
    >>> resolved.origin, resolved.source
    ('beside', 'examples/tiny_llama_q4/shard_info.json')
    """
    if shard_info is REPLICATE:
        _no_planner_options(experts, vocab_parallel, pad, "REPLICATE")
        source = "<every tensor replicated>"
        plan = ShardInfo.from_dict({}, source=source)
        return ResolvedPlan(
            plan.bind(num_shards).validate(checkpoint.metadata()), "replicate", source
        )
    origin = "given"
    if shard_info is None:
        shard_info = plan_beside(checkpoint)
        origin = "beside"
    if shard_info is not None:
        _no_planner_options(experts, vocab_parallel, pad, quote(_label(shard_info)))
        if origin == "beside":
            shard_info = ShardInfo.load(shard_info, checkpoint.name_of(shard_info))
        try:
            validated = _given(shard_info, checkpoint, num_shards)
        except PlanError:
            padded = (
                _padded_instead(shard_info, checkpoint, num_shards) if origin == "beside" else None
            )
            if padded is None:
                raise
            return padded
        return ResolvedPlan(validated, origin, _label(shard_info))
    from ..planners.decision import plan_decision

    decision = plan_decision(
        checkpoint, num_shards, vocab_parallel=vocab_parallel, pad=pad, experts=experts
    )
    return _planned(decision)


def _padded_instead(
    beside: ShardInfo, checkpoint: Checkpoint, num_shards: int
) -> ResolvedPlan | None:
    """The planner's zero-padded plan for N, where the plan beside the checkpoint is the
    planner's own symbolic plan (it records the model) and does not fit N; else None (the
    refusal of the plan beside stands)."""
    from ..geometry import MODEL_KEY
    from ..planners.decision import PlanKind, plan_decision

    if not beside.is_symbolic or MODEL_KEY not in beside.metadata:
        return None
    try:
        decision = plan_decision(checkpoint, num_shards)
    except PlanError:
        return None
    if decision.kind is not PlanKind.PADDED:
        return None
    fits = valid_num_shards(beside, checkpoint).describe()
    note = (
        f"{beside.source} does not fit {num_shards} workers ({fits}): using the planner's "
        f"zero-padded plan for {num_shards} instead"
    )
    return _planned(decision, note)


def _planned(decision: PlanDecision, note: str = "") -> ResolvedPlan:
    """The planner's plan for N as the load uses it; its refusal raised."""
    info = decision.shard_info()  # raises a refusal
    # a decision for an N that is not refused holds its plan validated, and the planner names
    # its plans (``<plan for CKPT>``)
    assert decision.validated is not None and info.source is not None
    return ResolvedPlan(decision.validated, "planned", info.source, decision, note)


def planned_fits(checkpoint: Checkpoint) -> list[int]:
    """The N (up to the planner's ``MAX_SHARDS_TRIED``) for which the plan ``resolve_plan``
    makes from the checkpoint's config fits as it is, unpadded: decided from the planner's
    constraints in one pass, nothing bound or validated per N. Empty where the plan would not be
    the planner's (a ``shard_info.json`` beside the checkpoint) or it cannot plan.

    >>> planned_fits(open_checkpoint("SmolLM2-135M/"))                         # doctest: +SKIP
    [1, 3, 9, ...]
    """
    from ..planners.decision import plan_decision

    if plan_beside(checkpoint) is not None:
        return []
    try:
        return list(plan_decision(checkpoint).valid)
    except PlanError:
        return []


def _no_planner_options(experts: str, vocab_parallel: bool, pad: bool, plan: str) -> None:
    if experts != "tp":
        setting = (
            EXPERTS_EP
            if experts == "ep"
            else Setting(f"experts={experts!r}", f"--experts {experts}")
        )
        replan = Setting(
            f"plan_for(checkpoint, num_shards, experts={experts!r})",
            f"shardload plan --experts {experts}",
        )
        error = PlanError(
            f"{setting.python} chooses how shardload plans, but the plan {plan} "
            f"is used as it is: write a plan with `{replan.python}`, or leave "
            f"{setting.python} out"
        )
        raise mention(error, replan, setting)  # the longer first: it holds the shorter
    if vocab_parallel or not pad:
        raise PlanError(
            f"vocab_parallel and pad choose how shardload plans, but the plan {plan} "
            "is used as it is: write the plan you want with plan_for, or leave "
            "them out"
        )
