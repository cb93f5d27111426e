"""The planner's decision for one N: the plan as it is, a zero-padded plan for N, or a refusal.

``plan_decision`` classifies the checkpoint's tensors once (``tensors.walk``: role, MLP kind,
axes, each kind of tensor once) and plans them symbolic in ``num_shards``, recording which N
each tensor group allows (``fit.Constraint``). For a given N it decides from those constraints
alone: every one allows N (``"unpadded"``); or, where zero-padding is exact, the padded plan for
N alone (``"padded"``: the same tensors stepped again, since padding changes their steps); or a
refusal naming the constraint N breaks and the N that work (``"refused"``). The plan it returns
for N is validated once, as a safety check, and kept for the load. ``PlanKind`` names the
outcomes (a ``str`` enum: each is its word in JSON and text).

>>> decision = plan_decision("examples/tiny_llama_q4", 3)                # doctest: +SKIP
>>> decision.kind is PlanKind.PADDED, list(decision.valid)
(True, [1, 2, 4, 8])
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..errors import EXPERTS_TP, PlanError, mention
from ..formats import Scheme
from ..gc_pause import gc_paused
from ..geometry import MODEL_KEY
from ..limits import num_shards_problem
from ..plan import MAX_SHARDS_TRIED, Placement, ShardInfo, ValidatedPlan, ValidNumShards
from ..readers import Checkpoint, as_checkpoint
from .checks import check_shapes, vocab_from_tensors
from .decoder import ActOrder, Planned, plan_decoder
from .experts import MODES, ExpertParallel
from .fit import Constraint
from .kinds import detect
from .padding import CannotPad, Padding, padding_layout
from .record import model_record
from .spec import ModelSpec
from .tensors import Walk, walk

__all__ = ["PlanDecision", "PlanKind", "PlanSummary", "plan_decision", "plan_for"]


class PlanKind(str, Enum):
    """What the planner decided for N (``PlanDecision.kind``); equal to its word, and written
    as it (``str``, ``format``, JSON)."""

    #: the plan, symbolic in num_shards, fits N as it is
    UNPADDED = "unpadded"
    #: a plan for N alone that zero-pads query heads, KV heads and MLP blocks
    PADDED = "padded"
    #: N breaks a constraint padding cannot lift (``PlanDecision.error`` says which)
    REFUSED = "refused"
    #: no N was asked: the plan, symbolic in num_shards
    SYMBOLIC = "symbolic"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class PlanSummary:
    """What the planner saw and decided, for people."""

    spec: ModelSpec
    scheme: Scheme
    sharded: int
    replicated: int
    unknown: tuple[str, ...]
    padded: bool = False
    #: expert parallelism: tensors of experts held whole by one worker
    placed: int = 0
    experts: str = "tp"

    def __str__(self) -> str:
        s = self.spec
        attention = (
            f"{s.num_heads} MLA heads of {s.head_dim} (values {s.v_head_dim})"
            if s.mla
            else f"{s.num_heads} query / {s.num_kv_heads} KV heads of {s.head_dim}"
        )
        text = (
            f"{s.architecture}, {s.num_layers} layers, {attention}, "
            f"{self.scheme.describe()}: {self.sharded} tensors sharded, "
            f"{self.replicated} replicated"
        )
        if self.experts == "ep":
            text += f", {self.placed} placed whole on one worker (expert parallel)"
        if self.unknown:
            text += f" ({len(self.unknown)} unrecognised, replicated: {self.unknown[0]}, ...)"
        if self.padded:
            text += "; zero-padded for this N"
        return text


@dataclass(frozen=True)
class PlanDecision:
    """What the planner decided for one N, in one pass (``plan_decision``).

    ``kind``: a ``PlanKind`` (``REFUSED``: ``error`` names the constraint N breaks and
    carries the N that work). ``valid``: the N (up to ``MAX_SHARDS_TRIED``) the unpadded plan
    fits, from the same constraints.
    """

    num_shards: int | None
    kind: PlanKind
    summary: PlanSummary
    valid: ValidNumShards
    info: ShardInfo | None = None
    error: PlanError | None = None
    #: the plan bound to N and validated against the checkpoint (None when refused or no N)
    validated: ValidatedPlan | None = None

    def shard_info(self) -> ShardInfo:
        """The plan as a plan file holds it (symbolic, or for this N alone when padded), or the
        refusal raised."""
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


def plan_decision(
    params,
    num_shards: int | None = None,
    *,
    vocab_parallel: bool = False,
    pad: bool = True,
    experts: str = "tp",
) -> PlanDecision:
    """Plan ``params`` (a checkpoint or path) and decide, once, what to do for ``num_shards``.

    The plan is symbolic in ``num_shards``; planning it records which N each tensor group
    allows (``Planned.constraints``). For the given N: when every constraint allows it, that
    plan is the answer (``"unpadded"``); else, with ``pad``, where zero-padding can be exact
    (``padding.padding_layout``) and every broken constraint is one padding lifts, a plan for N
    alone that zero-pads heads and MLP blocks (``"padded"``); else a refusal naming the first
    broken constraint (and why padding cannot help) and the N that work. Every plan records
    the model for integrations (``__metadata__.model``, read by ``shardload.geometry``). Errors
    in the checkpoint's metadata are raised; a refusal is returned (``PlanDecision.shard_info()``
    raises it).

    ``experts``: ``"tp"`` splits every routed expert across the workers; ``"ep"`` gives each
    worker whole experts (``experts.py``), for the one ``num_shards`` it needs.

    >>> plan_decision("examples/tiny_llama_q4", 4).kind                    # doctest: +SKIP
    <PlanKind.UNPADDED: 'unpadded'>
    """
    if experts not in MODES:
        raise PlanError(f"experts must be one of {', '.join(map(repr, MODES))}, got {experts!r}")
    if experts == "ep" and num_shards is None:
        raise PlanError(
            "expert parallelism assigns whole experts to workers, so its plan is "
            "for one number of workers: give num_shards"
        )
    problem = None if num_shards is None else num_shards_problem(num_shards)
    if problem is not None:
        raise PlanError(f"num_shards {problem}")
    ckpt = as_checkpoint(params)
    with gc_paused():  # each pass makes a list or a dict of every tensor, all kept
        return _decide(ckpt, num_shards, vocab_parallel, pad, experts)


def _decide(
    ckpt: Checkpoint, num_shards: int | None, vocab_parallel: bool, pad: bool, experts: str
) -> PlanDecision:
    """``plan_decision``'s work, its arguments checked."""
    kind, spec, scheme = detect(ckpt)
    spec = vocab_from_tensors(ckpt, spec)
    walked = walk(ckpt, spec, scheme)  # every pass below reads this one walk
    act_order = ActOrder(ckpt, scheme)
    check_shapes(ckpt, spec, scheme, walked)
    # the assignment of experts depends on N alone, so a padded plan for N reuses it
    ep = (
        None
        if experts == "tp" or num_shards is None  # (plan_decision asks N of "ep")
        else ExpertParallel(num_shards, spec.rules.naming.count_experts(ckpt.metadata()))
    )
    planned = plan_decoder(
        ckpt, spec, scheme, walked, act_order, vocab_parallel=vocab_parallel, experts=ep
    )
    if ep is not None and not ep.layouts:
        error = PlanError(
            f"{ckpt.source} has no routed experts ({spec.architecture}): expert "
            "parallelism needs a mixture-of-experts model; plan with "
            f"{EXPERTS_TP.python}",
            source=ckpt.source,
        )
        raise mention(error, EXPERTS_TP)
    constraints = planned.constraints
    # with expert parallelism, the N an EP plan can be made for (its experts put no constraint)
    valid = ValidNumShards(
        [n for n in range(1, MAX_SHARDS_TRIED + 1) if constraints.allows(n)], tried=MAX_SHARDS_TRIED
    )
    record = {MODEL_KEY: model_record(ckpt, spec, scheme, kind, walked, ep)}
    source = f"<plan for {ckpt.source}>"
    if num_shards is None:
        return PlanDecision(
            None,
            PlanKind.SYMBOLIC,
            _summary(planned, spec, scheme, experts),
            valid,
            _plan_info(planned.steps, record, ep, source),
        )
    broken = constraints.broken(num_shards)
    if not broken:
        decided = PlanKind.UNPADDED
    else:
        padding = _padding(
            ckpt, spec, scheme, walked, act_order, num_shards, broken, pad, ep is not None
        )
        if isinstance(padding, PaddingRefused):
            reason = padding.constraint.why_not(num_shards)
            if padding.why:
                reason += f"; and zero-padding cannot help: {padding.why}"
            error = PlanError(
                f"{ckpt.source} cannot be split over {num_shards} workers: {reason}",
                source=source,
                param=padding.constraint.tensor,
                working=valid,
            )
            return PlanDecision(
                num_shards,
                PlanKind.REFUSED,
                _summary(planned, spec, scheme, experts),
                valid,
                error=error,
            )
        decided = PlanKind.PADDED
        planned = plan_decoder(
            ckpt,
            spec,
            scheme,
            walked,
            act_order,
            vocab_parallel=vocab_parallel,
            padding=padding,
            experts=ep,
        )
        record = {**record, "tensor_parallel": padding.metadata(spec)}
        source = f"<padded plan for {ckpt.source}>"
    info = _plan_info(planned.steps, record, ep, source)
    # decided from the constraints alone; the plan for N is validated once, as a safety check,
    # and kept: the caller loads with it rather than validating it again
    validated = info.bind(num_shards).validate(ckpt.metadata())
    return PlanDecision(
        num_shards,
        decided,
        _summary(planned, spec, scheme, experts, padded=decided is PlanKind.PADDED),
        valid,
        info,
        validated=validated,
    )


def plan_for(
    params,
    num_shards: int | None = None,
    *,
    vocab_parallel: bool = False,
    pad: bool = True,
    experts: str = "tp",
) -> ShardInfo:
    """A plan for ``params`` (a checkpoint or path), symbolic in ``num_shards``.

    With ``num_shards``, also check that this N works: if the model's heads or MLP do not
    divide among N workers, plan zero-padding for that N (``pad``, on by default), and where
    even that cannot be exact, raise ``PlanError`` naming the constraint N breaks and listing
    the N that do work (``plan_decision`` decides, in one pass).
    ``vocab_parallel`` splits embeddings and lm_head by vocabulary rows instead of replicating.
    ``experts="ep"`` gives each worker whole routed experts (expert parallelism, for one N).

    >>> info = plan_for(open_checkpoint("examples/tiny_llama_q4"), num_shards=4)  # doctest: +SKIP
    >>> info.is_symbolic
    True
    """
    return plan_decision(
        params, num_shards, vocab_parallel=vocab_parallel, pad=pad, experts=experts
    ).shard_info()


def _summary(
    planned: Planned, spec: ModelSpec, scheme: Scheme, experts: str, *, padded: bool = False
) -> PlanSummary:
    return PlanSummary(
        spec,
        scheme,
        len(planned.steps),
        len(planned.replicated),
        tuple(planned.unknown),
        padded=padded,
        placed=len(planned.placed),
        experts=experts,
    )


def _plan_info(steps: dict, metadata: dict, ep: ExpertParallel | None, source: str) -> ShardInfo:
    """The plan: its steps, what it records for engines, and, for expert parallelism, the
    assignment of experts (``__metadata__.experts``) and the placement of experts stored one
    per tensor (for its one N)."""
    data: dict = dict(steps)
    if ep is not None:
        metadata = {**metadata, "experts": ep.metadata()}
        data[Placement.KEY] = {"num_shards": ep.num_shards, "params": ep.placement}
    if metadata:
        data[ShardInfo.METADATA_KEY] = metadata
    return ShardInfo.from_dict(data, source=source)


def _padding(
    ckpt: Checkpoint,
    spec: ModelSpec,
    scheme: Scheme,
    walked: Walk,
    act_order: ActOrder,
    num_shards: int,
    broken: list[Constraint],
    pad: bool,
    whole_experts: bool = False,
) -> Padding | PaddingRefused:
    """For an N that breaks the ``broken`` constraints: the zero-padded layout that lifts them,
    or the constraint to name in the refusal and why padding cannot help."""
    if not pad:
        return PaddingRefused(broken[0])
    unpaddable = [c for c in broken if not c.paddable]
    if unpaddable:
        return PaddingRefused(
            unpaddable[0],
            "the vocabulary is split evenly, never padded (split embeddings "
            "and lm_head only for an N that divides it)",
        )
    try:
        return padding_layout(
            ckpt, spec, scheme, num_shards, walked, act_order, whole_experts=whole_experts
        )
    except CannotPad as exc:
        return PaddingRefused(broken[0], str(exc))


@dataclass(frozen=True)
class PaddingRefused:
    """Why N gets no zero-padded plan: the broken ``constraint`` the refusal names, and why
    padding cannot help (``why``; "" when padding is off)."""

    constraint: Constraint
    why: str = ""
