"""Planners write ``shard_info.json`` for known architectures and quantization formats.

``plan_for(checkpoint)`` reads the checkpoint's own metadata (HF ``config.json`` with its
``quantization_config``, GGUF key-values, MLC's ``mlc-chat-config.json``), decides how every
tensor splits, and returns a plan written in expressions of ``num_shards``: one file for every
N the model allows. ``plan_for(checkpoint, num_shards=N)`` also checks that N is one of them
and, if not, says which are.

>>> info = plan_for(open_checkpoint("examples/tiny_llama_q4"), num_shards=4)   # doctest: +SKIP
>>> valid_num_shards(info, open_checkpoint("examples/tiny_llama_q4"))           # doctest: +SKIP
[1, 2, 4, 8]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..errors import PlanError
from ..plan import ShardInfo
from ..readers import Checkpoint, as_checkpoint
from .layouts import Scheme, scheme_from_hf
from .llama import Planned, padding_for, plan_llama
from .model import ModelSpec, spec_from_gguf, spec_from_hf, spec_from_mlc

__all__ = ["plan_for", "describe_plan", "valid_num_shards", "PlanSummary", "MAX_SHARDS_TRIED"]

#: ``valid_num_shards`` tries every N up to this
MAX_SHARDS_TRIED = 64


@dataclass(frozen=True)
class PlanSummary:
    """What the planner saw and decided, for people."""

    spec: ModelSpec
    scheme: Scheme
    sharded: int
    replicated: int
    unknown: tuple[str, ...]
    padded: bool = False

    def __str__(self) -> str:
        s = self.spec
        text = (f"{s.architecture}, {s.num_layers} layers, {s.num_heads} query / "
                f"{s.num_kv_heads} KV heads of {s.head_dim}, {self.scheme.describe()}: "
                f"{self.sharded} tensors sharded, {self.replicated} replicated")
        if self.unknown:
            text += f" ({len(self.unknown)} unrecognised, replicated: {self.unknown[0]}, ...)"
        if self.padded:
            text += "; zero-padded for this N"
        return text


def _detect(ckpt: Checkpoint) -> tuple[ModelSpec, Scheme, bool]:
    """The model's geometry, its quantization, and whether tensors have GGUF names."""
    config = ckpt.config
    source = ckpt.source
    if "general.architecture" in config:
        return spec_from_gguf(config, source), Scheme("gguf"), True
    if "model_config" in config or config.get("quantization", "").startswith("q"):
        quant = str(config.get("quantization", ""))
        if quant not in ("q4f16_1", "q0f16", "q0f32"):
            raise PlanError(f"MLC quantization {quant!r} is not supported: q4f16_1 is (its "
                            "weights are stored NK, out-features first); KN layouts such as "
                            "q4f16_0 would need a transpose", source=source)
        return spec_from_mlc(config, source), Scheme("mlc"), False
    if not config:
        raise PlanError("no plan, and no model config next to the checkpoint (config.json, GGUF "
                        "metadata or mlc-chat-config.json) to write one from: pass a plan "
                        "(--shard-info FILE, or a shard_info.json beside the checkpoint), or add "
                        "the model's config.json", source=source)
    return spec_from_hf(config, source), scheme_from_hf(config, source), False


def describe_plan(params, num_shards: Optional[int] = None, *, vocab_parallel: bool = False,
                  pad: bool = True) -> tuple[ShardInfo, PlanSummary]:
    """The plan for ``params`` (a checkpoint or path) and a summary of it.

    The plan is symbolic in ``num_shards`` when the model's heads and blocks divide among the
    workers. When they do not for the given ``num_shards`` and ``pad`` is on, it is a plan for
    that N alone that zero-pads query heads, KV heads and MLP blocks (exact: padded weights are
    zero), recording each worker's heads under ``__metadata__.tensor_parallel``.
    """
    ckpt = as_checkpoint(params)
    spec, scheme, gguf_names = _detect(ckpt)
    planned: Planned = plan_llama(ckpt, spec, scheme, gguf_names=gguf_names,
                                  vocab_parallel=vocab_parallel)
    info = ShardInfo.from_dict(planned.steps, source=f"<plan for {ckpt.source}>")
    padded = None
    if num_shards is not None and pad and not _fits(info, ckpt, num_shards):
        padding = padding_for(ckpt, spec, scheme, num_shards, gguf_names=gguf_names)
        planned = plan_llama(ckpt, spec, scheme, gguf_names=gguf_names,
                             vocab_parallel=vocab_parallel, padding=padding)
        info = ShardInfo.from_dict(
            {ShardInfo.METADATA_KEY: {"tensor_parallel": padding.metadata(spec)},
             **planned.steps}, source=f"<padded plan for {ckpt.source}>")
        padded = padding
    summary = PlanSummary(spec, scheme, len(planned.steps), len(planned.replicated),
                          tuple(planned.unknown), padded is not None)
    return info, summary


def _fits(info: ShardInfo, ckpt: Checkpoint, num_shards: int) -> bool:
    try:
        info.bind(num_shards).validate(ckpt.metadata())
    except PlanError:
        return False
    return True


def plan_for(params, num_shards: Optional[int] = None, *, vocab_parallel: bool = False,
             pad: bool = True) -> ShardInfo:
    """A plan for ``params`` (a checkpoint or path), symbolic in ``num_shards``.

    With ``num_shards``, also check that this N works: if the model's heads or MLP do not
    divide among N workers, plan zero-padding for that N (``pad``, on by default), and where
    even that cannot be exact, raise ``PlanError`` listing the N that do work.
    ``vocab_parallel`` splits embeddings and lm_head by vocabulary rows instead of replicating.
    """
    ckpt = as_checkpoint(params)
    try:
        info, _ = describe_plan(ckpt, num_shards, vocab_parallel=vocab_parallel, pad=pad)
    except PlanError as padding_failed:
        if num_shards is None:
            raise
        unpadded, _ = describe_plan(ckpt, vocab_parallel=vocab_parallel, pad=False)
        try:
            unpadded.bind(num_shards).validate(ckpt.metadata())
        except PlanError as exc:
            exc.reason = (f"{exc.reason}; and zero-padding cannot help: "
                          f"{padding_failed.reason}")
            _refuse(unpadded, ckpt, num_shards, exc)
        raise
    if num_shards is not None:
        check_num_shards(info, ckpt, num_shards)
    return info


def check_num_shards(info: ShardInfo, params: Union[Checkpoint, str], num_shards: int) -> None:
    """``PlanError`` naming the constraint and the N that work, unless ``num_shards`` does."""
    ckpt = as_checkpoint(params)
    try:
        info.bind(num_shards).validate(ckpt.metadata())
    except PlanError as exc:
        _refuse(info, ckpt, num_shards, exc)


def _refuse(info: ShardInfo, ckpt: Checkpoint, num_shards: int, exc: PlanError):
    valid = valid_num_shards(info, ckpt) if info.is_symbolic else []
    shown = ", ".join(map(str, valid)) if valid else "none"
    raise PlanError(f"{ckpt.source} cannot be split over {num_shards} workers: "
                    f"{exc.reason}. N that work (up to {MAX_SHARDS_TRIED}): "
                    f"{shown}", source=info.source, param=exc.param) from None


def valid_num_shards(info: ShardInfo, params: Union[Checkpoint, str],
                     limit: int = MAX_SHARDS_TRIED) -> list[int]:
    """Every N up to ``limit`` for which the plan binds and validates on this checkpoint."""
    metadata = as_checkpoint(params).metadata()
    valid = []
    for n in range(1, limit + 1):
        try:
            info.bind(n).validate(metadata)
        except PlanError:
            continue
        valid.append(n)
    return valid
