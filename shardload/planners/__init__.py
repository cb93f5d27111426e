"""Planners write ``shard_info.json`` for known architectures and quantization formats.

``plan_for(checkpoint)`` reads the checkpoint's own metadata (HF ``config.json`` with its
``quantization_config``, GGUF key-values, MLC's ``mlc-chat-config.json``), decides how every
tensor splits, and returns a plan written in expressions of ``num_shards``: one file for every
N the model allows. While it plans, the planner records which N each tensor group allows (its
heads, KV heads, MLP rows, vocabulary, and the packed words, groups and blocks that store them:
``fit.Constraint``), so for a given N it decides once (``plan_decision``): the plan fits N as
it is, or a plan for N alone zero-pads heads and MLP blocks, or N is refused naming the
constraint it breaks and the N that work. Nothing is bound or validated to find that out; the
plan it returns for N is validated once, as a safety check.

>>> info = plan_for(open_checkpoint("examples/tiny_llama_q4"), num_shards=4)   # doctest: +SKIP
>>> valid_num_shards(info, open_checkpoint("examples/tiny_llama_q4"))           # doctest: +SKIP
[1, 2, 4, 8]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from ..errors import EXPERTS_TP, PlanError, mention
from ..formats import Scheme
from ..geometry import MODEL_KEY
from ..limits import num_shards_problem
from ..plan import Placement, ShardInfo, ValidatedPlan
from ..readers import Checkpoint, as_checkpoint
from .checks import check_shapes, vocab_from_tensors
from .decoder import plan_decoder
from .experts import MODES, ExpertParallel
from .fit import Constraint
from .kinds import detect
from .padding import Padding, padding_layout
from .record import model_record
from .spec import ModelSpec

__all__ = ["plan_for", "plan_decision", "describe_plan", "valid_num_shards", "check_num_shards",
           "PlanDecision", "PlanSummary", "ValidNumShards", "MAX_SHARDS_TRIED",
           "MAX_VALIDATION_WORK"]

#: ``valid_num_shards`` tries every N up to this
MAX_SHARDS_TRIED = 64
#: ``valid_num_shards`` binds and validates at most this many shape dims and step args in all
#: (summed over the N tried): a huge hand-written plan gets a shorter list, or none, not minutes
MAX_VALIDATION_WORK = 4_000_000


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
        attention = (f"{s.num_heads} MLA heads of {s.head_dim} (values {s.v_head_dim})"
                     if s.mla else
                     f"{s.num_heads} query / {s.num_kv_heads} KV heads of {s.head_dim}")
        text = (f"{s.architecture}, {s.num_layers} layers, {attention}, "
                f"{self.scheme.describe()}: {self.sharded} tensors sharded, "
                f"{self.replicated} replicated")
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

    ``kind``: ``"unpadded"`` (the plan, symbolic in num_shards, fits N as it is),
    ``"padded"`` (a plan for N alone that zero-pads query heads, KV heads and MLP blocks),
    ``"refused"`` (``error`` names the constraint N breaks and the N that work), or
    ``"symbolic"`` when no N was asked. ``valid``: the N (up to ``MAX_SHARDS_TRIED``) the
    unpadded plan fits, from the same constraints.
    """

    num_shards: Optional[int]
    kind: str
    summary: PlanSummary
    valid: "ValidNumShards"
    info: Optional[ShardInfo] = None
    error: Optional[PlanError] = None
    #: the plan bound to N and validated against the checkpoint (None when refused or no N)
    validated: Optional[ValidatedPlan] = None

    def plan(self) -> ShardInfo:
        """The plan, or the refusal raised."""
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


def plan_decision(params, num_shards: Optional[int] = None, *, vocab_parallel: bool = False,
                  pad: bool = True, experts: str = "tp") -> PlanDecision:
    """Plan ``params`` (a checkpoint or path) and decide, once, what to do for ``num_shards``.

    The plan is symbolic in ``num_shards``; planning it records which N each tensor group
    allows (``Planned.constraints``). For the given N: when every constraint allows it, that
    plan is the answer (``"unpadded"``); else, with ``pad``, where zero-padding can be exact
    (``padding.padding_layout``) and every broken constraint is one padding lifts, a plan for N
    alone that zero-pads heads and MLP blocks (``"padded"``); else a refusal naming the first
    broken constraint (and why padding cannot help) and the N that work. Every plan records
    the model for integrations (``__metadata__.model``, read by ``shardload.geometry``). Errors in the
    checkpoint's metadata are raised, as ever; a refusal is returned (``PlanDecision.plan()``
    raises it).

    ``experts``: ``"tp"`` splits every routed expert across the workers; ``"ep"`` gives each
    worker whole experts (``experts.py``), for the one ``num_shards`` it needs.
    """
    if experts not in MODES:
        raise PlanError(f"experts must be one of {', '.join(map(repr, MODES))}, got "
                        f"{experts!r}")
    if experts == "ep" and num_shards is None:
        raise PlanError("expert parallelism assigns whole experts to workers, so its plan is "
                        "for one number of workers: give num_shards")
    problem = None if num_shards is None else num_shards_problem(num_shards)
    if problem is not None:
        raise PlanError(f"num_shards {problem}")
    ckpt = as_checkpoint(params)
    kind, spec, scheme = detect(ckpt)
    spec = vocab_from_tensors(ckpt, spec)
    check_shapes(ckpt, spec, scheme)

    def parallel_experts() -> Optional[ExpertParallel]:
        if experts == "tp":
            return None
        assert num_shards is not None
        return ExpertParallel(num_shards, spec.rules.naming.count_experts(ckpt.metadata()))

    ep = parallel_experts()
    planned = plan_decoder(ckpt, spec, scheme, vocab_parallel=vocab_parallel, experts=ep)
    if ep is not None and not ep.layouts:
        error = PlanError(f"{ckpt.source} has no routed experts ({spec.architecture}): expert "
                          "parallelism needs a mixture-of-experts model; plan with "
                          f"{EXPERTS_TP.python}", source=ckpt.source)
        raise mention(error, EXPERTS_TP)
    constraints = planned.constraints
    # with expert parallelism, the N an EP plan can be made for (its experts put no constraint)
    valid = ValidNumShards([n for n in range(1, MAX_SHARDS_TRIED + 1) if constraints.allows(n)],
                           tried=MAX_SHARDS_TRIED)
    summary = PlanSummary(spec, scheme, len(planned.steps), len(planned.replicated),
                          tuple(planned.unknown), placed=len(planned.placed), experts=experts)
    source = f"<plan for {ckpt.source}>"
    record = {MODEL_KEY: model_record(ckpt, spec, scheme, kind, ep)}
    if num_shards is None:
        return PlanDecision(None, "symbolic", summary, valid,
                            _plan_info(planned.steps, record, None, source))
    broken = constraints.broken(num_shards)
    if not broken:
        decision = PlanDecision(num_shards, "unpadded", summary, valid,
                                _plan_info(planned.steps, record, ep, source))
    else:
        padding = _padding(ckpt, spec, scheme, num_shards, broken, pad, ep is not None)
        if not isinstance(padding, Padding):
            first, why = padding
            reason = first.why_not(num_shards)
            if why:
                reason += f"; and zero-padding cannot help: {why}"
            error = PlanError(f"{ckpt.source} cannot be split over {num_shards} workers: "
                              f"{reason}. {valid.describe()}", source=source, param=first.tensor)
            return PlanDecision(num_shards, "refused", summary, valid, error=error)
        ep = parallel_experts()
        padded = plan_decoder(ckpt, spec, scheme, vocab_parallel=vocab_parallel,
                              padding=padding, experts=ep)
        info = _plan_info(padded.steps, {**record, "tensor_parallel": padding.metadata(spec)},
                          ep, f"<padded plan for {ckpt.source}>")
        summary = PlanSummary(spec, scheme, len(padded.steps), len(padded.replicated),
                              tuple(padded.unknown), padded=True, placed=len(padded.placed),
                              experts=experts)
        decision = PlanDecision(num_shards, "padded", summary, valid, info)
    # decided from the constraints alone; the plan for N is validated once, as a safety check,
    # and kept: the caller loads with it rather than validating it again
    validated = decision.plan().bind(num_shards).validate(ckpt.metadata())
    return dataclasses.replace(decision, validated=validated)


def _plan_info(steps: dict, metadata: dict, ep: Optional[ExpertParallel],
               source: str) -> ShardInfo:
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


def _padding(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, num_shards: int,
             broken: list[Constraint], pad: bool,
             whole_experts: bool = False) -> Union[Padding, tuple[Constraint, str]]:
    """For an N that breaks the ``broken`` constraints: the zero-padded layout that lifts them,
    or the constraint to name in the refusal and why padding cannot help ("" when ``pad`` is
    off)."""
    if not pad:
        return broken[0], ""
    unpaddable = [c for c in broken if not c.paddable]
    if unpaddable:
        return unpaddable[0], ("the vocabulary is split evenly, never padded (split embeddings "
                               "and lm_head only for an N that divides it)")
    padding = padding_layout(ckpt, spec, scheme, num_shards, whole_experts=whole_experts)
    return (broken[0], padding.reason) if isinstance(padding, PlanError) else padding


def describe_plan(params, num_shards: Optional[int] = None, *, vocab_parallel: bool = False,
                  pad: bool = True, experts: str = "tp") -> tuple[ShardInfo, PlanSummary]:
    """The plan for ``params`` (a checkpoint or path) and a summary of it.

    The plan is symbolic in ``num_shards`` when the model's heads and blocks divide among the
    workers. When they do not for the given ``num_shards`` and ``pad`` is on, it is a plan for
    that N alone that zero-pads query heads, KV heads and MLP blocks (exact: padded weights are
    zero), recording each worker's heads under ``__metadata__.tensor_parallel``. An N that
    the plan does not fit and padding cannot serve (or ``pad`` is off) is refused
    (``PlanError``), as ``plan_for`` refuses it: see ``plan_decision``.
    """
    decision = plan_decision(params, num_shards, vocab_parallel=vocab_parallel, pad=pad,
                             experts=experts)
    return decision.plan(), decision.summary


def plan_for(params, num_shards: Optional[int] = None, *, vocab_parallel: bool = False,
             pad: bool = True, experts: str = "tp") -> ShardInfo:
    """A plan for ``params`` (a checkpoint or path), symbolic in ``num_shards``.

    With ``num_shards``, also check that this N works: if the model's heads or MLP do not
    divide among N workers, plan zero-padding for that N (``pad``, on by default), and where
    even that cannot be exact, raise ``PlanError`` naming the constraint N breaks and listing
    the N that do work (``plan_decision`` decides, in one pass).
    ``vocab_parallel`` splits embeddings and lm_head by vocabulary rows instead of replicating.
    ``experts="ep"`` gives each worker whole routed experts (expert parallelism, for one N).
    """
    return plan_decision(params, num_shards, vocab_parallel=vocab_parallel, pad=pad,
                         experts=experts).plan()


def check_num_shards(info: ShardInfo, params: Union[Checkpoint, str],
                     num_shards: int) -> ValidatedPlan:
    """The plan bound to ``num_shards`` and validated against the checkpoint; where it does not
    fit, ``PlanError`` naming the constraint and the N that work."""
    ckpt = as_checkpoint(params)
    try:
        return info.bind(num_shards).validate(ckpt.metadata())
    except PlanError as exc:
        _refuse(info, ckpt, num_shards, exc)
        raise  # _refuse raises


def _refuse(info: ShardInfo, ckpt: Checkpoint, num_shards: int, exc: PlanError):
    valid = valid_num_shards(info, ckpt)
    if not valid and valid.complete:
        raise exc       # no N fits: the problem is not the number of workers
    error = PlanError(f"{ckpt.source} cannot be split over {num_shards} workers: "
                      f"{exc.reason.rstrip('.')}. {valid.describe()}", source=info.source,
                      param=exc.param)
    raise mention(error, *getattr(exc, "settings", ())) from None


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
            return ("the N that work were not computed: the plan is too large to validate "
                    f"for each N (over {MAX_VALIDATION_WORK} shape dims and step args)")
        return (f"N that work (up to {self.tried}; the plan is too large to try every N up to "
                f"{self.limit}): {shown}")


def _distinct_params(info: ShardInfo, metadata) -> Optional[tuple[ShardInfo, dict, int]]:
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
        key = (meta.shape, meta.dtype,
               tuple((s.func, s.out_shape, s.dtype, tuple((type(a), a) for a in s.extra))
                     for s in raw))
        if key in seen:
            continue
        seen.add(key)
        steps[name], metas[name] = raw, meta
        work += sum(1 + len(s.out_shape) + len(s.extra) for s in raw)
    return ShardInfo(steps, info.source, info.metadata), metas, max(work, 1)


def valid_num_shards(info: ShardInfo, params: Union[Checkpoint, str],
                     limit: int = MAX_SHARDS_TRIED) -> ValidNumShards:
    """Every N up to ``limit`` for which the plan binds and validates on this checkpoint.

    Cheap even for a large plan: each distinct parameter (shape, dtype and steps) is validated
    once per N, stopping at the first that fails, and the work is capped at
    ``MAX_VALIDATION_WORK`` (beyond it, fewer N are tried: ``ValidNumShards.tried`` says).
    """
    metadata = as_checkpoint(params).metadata()
    planned = info.planned_num_shards
    if planned is not None:    # plain integers, or a placement: that one N, if it validates
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
