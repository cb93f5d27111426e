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

import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

from ..config_fields import Fields
from ..errors import SHARD_INFO, PlanError, mention
from ..limits import MAX_NUM_SHARDS
from ..plan import Placement, ShardInfo, ValidatedPlan
from ..readers import Checkpoint, as_checkpoint
from .layouts import Scheme, scheme_from_hf
from .experts import MODES, ExpertParallel, count_experts
from .fit import Constraint
from .llama import Padding, check_shapes, padding_layout, plan_llama, vocab_from_tensors
from .model import ModelSpec, spec_from_gguf, spec_from_hf, spec_from_mlc

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


# ---- which metadata, from which file -----------------------------------------------------------

def _folder(source: str) -> str:
    return source if os.path.isdir(source) else os.path.dirname(source)


class _QuantizationFile:
    """Which file an HF checkpoint's ``quantization_config`` came from: ``config.json``'s own,
    or a side file the reader merges in when the config has none (``quantize_config.json``,
    AutoGPTQ; ``hf_quant_config.json``, ModelOpt). Decided only when a message needs it (it
    re-reads the small config.json)."""

    def __init__(self, folder: str):
        from ..readers.safetensors import QUANT_SIDE_FILES

        self.config = os.path.join(folder, "config.json")
        self.sides = [os.path.join(folder, side) for side in QUANT_SIDE_FILES]
        self._label: Optional[str] = None

    def __call__(self) -> str:
        if self._label is None:
            self._label = self._find()
        return self._label

    def _find(self) -> str:
        sides = [side for side in self.sides if os.path.isfile(side)]
        if not sides:
            return self.config
        try:
            from ..files import MAX_SIDE_FILE_BYTES, read_json

            own = read_json(self.config, MAX_SIDE_FILE_BYTES)
        except Exception:  # noqa: BLE001 - only a label: say both
            return (f"{self.config} (or {sides[0]}, merged in as quantization_config)")
        if isinstance(own, dict) and "quantization_config" in own:
            return self.config
        return sides[0]


def _kind(ckpt: Checkpoint, config: dict) -> str:
    """``gguf``, ``mlc`` or ``hf``: by the reader that opened the checkpoint; for other
    checkpoints (in memory, user subclasses), by the config's own marks."""
    from ..readers.gguf import GGUFCheckpoint
    from ..readers.mlc import MLCCheckpoint
    from ..readers.safetensors import SafetensorsCheckpoint

    if isinstance(ckpt, GGUFCheckpoint):
        return "gguf"
    if isinstance(ckpt, MLCCheckpoint):
        return "mlc"
    if isinstance(ckpt, SafetensorsCheckpoint):
        return "hf"
    if "general.architecture" in config:
        return "gguf"
    if "model_config" in config and isinstance(config.get("quantization"), str):
        return "mlc"
    return "hf"


def _no_config(source: str, what: str) -> PlanError:
    error = PlanError(f"no plan, and no model config next to the checkpoint ({what}) to write "
                      f"one from: pass a plan ({SHARD_INFO.python}, or a shard_info.json beside "
                      "the checkpoint), or add the model's config", source=source)
    mention(error, SHARD_INFO)
    return error


def _detect(ckpt: Checkpoint) -> tuple[ModelSpec, Scheme, bool]:
    """The model's geometry, its quantization, and whether tensors have GGUF names."""
    config = ckpt.config
    source = ckpt.source
    kind = _kind(ckpt, config)
    if kind == "gguf":
        return spec_from_gguf(Fields(config, file=source)), Scheme("gguf", file=source), True
    if kind == "mlc":
        if not set(config) - {"tensor_cache_metadata"}:
            raise _no_config(source, "mlc-chat-config.json")
        label = (os.path.join(source, "mlc-chat-config.json") if os.path.isdir(source)
                 else source)
        cfg = Fields(config, file=label)
        quant = cfg.str("quantization")
        if quant not in ("q4f16_1", "q0f16", "q0f32"):
            raise PlanError(f"key 'quantization' is {quant!r}: that MLC quantization is not "
                            "supported: q4f16_1 is (its weights are stored NK, out-features "
                            "first); KN layouts such as q4f16_0 would need a transpose",
                            source=label)
        return spec_from_mlc(cfg), Scheme("mlc", file=label), False
    if not config:
        raise _no_config(source, "config.json, GGUF metadata or mlc-chat-config.json")
    quant_file: Union[str, Callable[[], str]]
    if isinstance(source, str) and os.path.exists(source):
        folder = _folder(source)
        label = os.path.join(folder, "config.json")
        quant_file = _QuantizationFile(folder)
    else:  # a checkpoint not read from files: its config has no file to name
        label = quant_file = f"{source} (its config)"
    cfg = Fields(config, file=label)
    return spec_from_hf(cfg), scheme_from_hf(cfg, quant_file=quant_file), False


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
    (``llama.padding_layout``) and every broken constraint is one padding lifts, a plan for N
    alone that zero-pads heads and MLP blocks (``"padded"``); else a refusal naming the first
    broken constraint (and why padding cannot help) and the N that work. Errors in the
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
    if num_shards is not None and (type(num_shards) is not int or num_shards < 1):
        raise PlanError(f"num_shards must be a positive integer, got {num_shards!r}")
    if num_shards is not None and num_shards > MAX_NUM_SHARDS:
        raise PlanError(f"num_shards={num_shards} is more than the {MAX_NUM_SHARDS} workers "
                        "shardload runs in one session (each is a thread or a process)")
    ckpt = as_checkpoint(params)
    spec, scheme, gguf_names = _detect(ckpt)
    spec = vocab_from_tensors(ckpt, spec, gguf_names=gguf_names)
    check_shapes(ckpt, spec, scheme, gguf_names=gguf_names)

    def parallel_experts() -> Optional[ExpertParallel]:
        if experts == "tp":
            return None
        assert num_shards is not None
        return ExpertParallel(num_shards, count_experts(ckpt.metadata(), gguf_names))

    ep = parallel_experts()
    planned = plan_llama(ckpt, spec, scheme, gguf_names=gguf_names,
                         vocab_parallel=vocab_parallel, experts=ep)
    if ep is not None and not ep.layouts:
        raise PlanError(f"{ckpt.source} has no routed experts ({spec.architecture}): expert "
                        "parallelism needs a mixture-of-experts model; plan with experts='tp'",
                        source=ckpt.source)
    constraints = planned.constraints
    # with expert parallelism, the N an EP plan can be made for (its experts put no constraint)
    valid = ValidNumShards([n for n in range(1, MAX_SHARDS_TRIED + 1) if constraints.allows(n)],
                           tried=MAX_SHARDS_TRIED)
    summary = PlanSummary(spec, scheme, len(planned.steps), len(planned.replicated),
                          tuple(planned.unknown), placed=len(planned.placed), experts=experts)
    source = f"<plan for {ckpt.source}>"
    if num_shards is None:
        return PlanDecision(None, "symbolic", summary, valid,
                            ShardInfo.from_dict(planned.steps, source=source))
    broken = constraints.broken(num_shards)
    if not broken:
        decision = PlanDecision(num_shards, "unpadded", summary, valid,
                                _plan_info(planned.steps, {}, ep, source))
    else:
        padding = _padding(ckpt, spec, scheme, num_shards, broken, pad, gguf_names,
                           ep is not None)
        if not isinstance(padding, Padding):
            first, why = padding
            reason = first.why_not(num_shards)
            if why:
                reason += f"; and zero-padding cannot help: {why}"
            error = PlanError(f"{ckpt.source} cannot be split over {num_shards} workers: "
                              f"{reason}. {valid.describe()}", source=source, param=first.tensor)
            return PlanDecision(num_shards, "refused", summary, valid, error=error)
        ep = parallel_experts()
        padded = plan_llama(ckpt, spec, scheme, gguf_names=gguf_names,
                            vocab_parallel=vocab_parallel, padding=padding, experts=ep)
        info = _plan_info(padded.steps, {"tensor_parallel": padding.metadata(spec)}, ep,
                          f"<padded plan for {ckpt.source}>")
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
             broken: list[Constraint], pad: bool, gguf_names: bool,
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
    padding = padding_layout(ckpt, spec, scheme, num_shards, gguf_names=gguf_names,
                             whole_experts=whole_experts)
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
