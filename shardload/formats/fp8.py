"""FP8 (float8_e4m3fn weights): per tensor, per channel or in blocks.

Read from four configs: compressed-tensors ``float-quantized``, transformers' ``fp8``
(FineGrainedFP8: DeepSeek's ``weight_scale_inv`` per 128x128 block), and ModelOpt's ``FP8``.
Stored: ``weight`` e4m3 ``[N, K]`` split like a dense one; ``weight_scale`` or
``weight_scale_inv`` (both mean ``W = w * s``) per tensor ``[]``/``[1]`` (replicated), per
channel ``[N, 1]`` (rows split with the weight) or per block ``[N/bn, K/bk]`` (splits only at
block boundaries; heads that straddle blocks split in the fewest whole heads that fill whole
blocks, else refused). A fused layer's per-part scales become per-channel, exactly: every row
keeps the scale it was quantized with, nothing is re-quantized.
"""

from __future__ import annotations

import re

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .scheme import Scheme


def read_hf_config(quant) -> Scheme:
    block = quant.int_list(
        "weight_block_size", length=2, min=1, max=MAX_GROUP, default=[128, 128], nullable=True
    )
    # transformers' FineGrainedFP8 (DeepSeek's format): always 128 x 128 blocks or as given
    return Scheme(
        "fp8",
        8,
        block=(block[0], block[1]),
        strategy="block",
        file=quant.file_label,
        keys=keys_of(quant, block="weight_block_size"),
    )


def read_compressed_tensors(quant, weights) -> Scheme:
    bits = weights.int("num_bits", min=1, max=64, default=8)  # every field read before judged
    block = _block_structure(weights)
    strategy = weights.str("strategy", default="", nullable=True)
    if bits != 8:
        raise PlanError(
            f"key {weights.name('num_bits')!r} is {bits}: only 8-bit float "
            "(FP8) weights are supported by the planner",
            source=quant.file,
        )
    return Scheme(
        "fp8",
        8,
        block=(block[0], block[1]),
        strategy=strategy if strategy in ("tensor", "channel", "block") else "",
        file=quant.file_label,
        keys=keys_of(weights, block="block_structure"),
    )


def read_modelopt(quant) -> Scheme:
    return Scheme("fp8", 8, strategy="tensor", file=quant.file_label)


def _block_structure(weights) -> list[int]:
    """FP8 scale blocks ``[rows, cols]``: a list, or compressed-tensors' older ``"RxC"``."""
    raw = weights.raw.get("block_structure")
    if not isinstance(raw, str):
        return weights.int_list(
            "block_structure", length=2, min=1, max=MAX_GROUP, default=[128, 128], nullable=True
        )
    match = re.fullmatch(r"([0-9]{1,9})x([0-9]{1,9})", raw)
    block = [int(v) for v in match.groups()] if match else []
    if not block or not all(1 <= v <= MAX_GROUP for v in block):
        raise weights.refuse(
            "block_structure",
            raw,
            f"a list of 2 integers from 1 to {MAX_GROUP} (or the string 'RxC')",
        )
    return block


class FP8(QuantFormat):
    name = "fp8"
    description = (
        "FP8 (compressed-tensors float-quantized, HF fp8, DeepSeek's "
        "weight_scale_inv, ModelOpt FP8)"
    )
    parts = ("weight", "weight_scale", "weight_scale_inv")
    quantized_parts = ("weight_scale", "weight_scale_inv")
    configs = {
        "fp8": read_hf_config,
        "compressed-tensors/float-quantized": read_compressed_tensors,
        "modelopt/FP8": read_modelopt,
    }

    def describe(self, scheme) -> str:
        return "fp8"

    def tensor_axes(self, scheme, suffix, meta, fmt):
        if suffix not in ("weight_scale", "weight_scale_inv"):
            return None
        if len(meta.shape) <= 1:  # per tensor (or per part of a fused tensor)
            return TensorAxes(None, None, per_part=True)
        # a block grid of a layer at most one block wide has one column too: the config says
        if len(meta.shape) == 2 and meta.shape[1] == 1 and scheme.strategy != "block":
            return TensorAxes(Axis(0), None)  # per channel
        rows, cols = scheme.block
        return TensorAxes(Axis(0, rows), Axis(1, cols))  # per block

    def dense(self, parts, scheme, ggml_types):
        w = need(parts, "weight").float()
        if ("weight_scale" in parts) == ("weight_scale_inv" in parts):
            raise ValueError(
                "an FP8 weight needs one of weight_scale and weight_scale_inv (both mean W = w * s)"
            )
        s = parts.get("weight_scale", parts.get("weight_scale_inv")).float()
        n, k = w.shape[-2:]
        if s.numel() == 1:  # per tensor
            return w * s.reshape(())
        if s.shape[-2:] == (n, 1):  # per channel
            return w * s
        # per group, else per block
        bn, bk = (1, scheme.group_size) if scheme.group_size > 0 else scheme.block
        if s.shape[-2:] != (-(-n // bn), -(-k // bk)):
            raise ValueError(
                f"FP8 scale {list(s.shape)} is neither per tensor, per channel nor "
                f"per {bn}x{bk} block of a {n}x{k} weight"
            )
        # each scale over its block; edge blocks may be partial, so expand and trim
        return w * s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


FORMAT = FP8()
