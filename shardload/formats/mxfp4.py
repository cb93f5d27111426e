"""MXFP4: E2M1 codes with one E8M0 exponent per 32 elements, in two layouts.

* compressed-tensors ``mxfp4-pack-quantized`` (MXFP4, MXFP4A16): ``weight_packed`` uint8
  ``[N, K/2]`` and ``weight_scale`` uint8 ``[N, K/32]``, like NVFP4 without a global scale;
* gpt-oss (transformers' ``quant_method: mxfp4``, as openai/gpt-oss-20b is published): each
  layer's routed experts fused, ``*_blocks`` ``[E, rows, K/32, 16]`` bytes and ``*_scales``
  ``[E, rows, K/32]`` (their axes are gpt-oss's own, in ``planners/architectures.py``); the
  rest of the model is stored unquantized. They come out as transformers holds them, ``[E, K,
  rows]``.

``W = fp4 * 2^(e - 127)``. K splits only at 32-element groups; zero-padding is exact (FP4 code 0
is +0, whatever the scale).
"""

from __future__ import annotations

from .base import QuantFormat, check_parts, need
from .nvfp4 import fp4_reader, packed_fp4_axes
from .scheme import Scheme

#: gpt-oss's fused experts (``mlp.experts.<name>_blocks`` ...)
GPT_OSS_EXPERTS = ("gate_up_proj", "down_proj")


def read_gpt_oss(quant) -> Scheme:
    # transformers' Mxfp4Config (gpt-oss): the fused experts' *_blocks / *_scales, one E8M0
    # scale per 32 of K; everything else is stored unquantized
    return Scheme("mxfp4", 4, 32, file=quant.file_label)


class MXFP4(QuantFormat):
    name = "mxfp4"
    description = (
        "compressed-tensors mxfp4-pack-quantized (MXFP4, MXFP4A16); gpt-oss MXFP4 "
        "(quant_method: mxfp4)"
    )
    parts = ("weight_packed", "weight_scale")
    quantized_parts = ("weight_packed", "weight_scale", "gate_up_proj_blocks", "down_proj_blocks")
    configs = {
        "compressed-tensors/mxfp4-pack-quantized": fp4_reader("mxfp4", "mxfp4-pack-quantized", 32),
        "mxfp4": read_gpt_oss,
    }

    def tensor_axes(self, scheme, suffix, meta, fmt):
        return packed_fp4_axes(scheme, suffix)

    def dequantize(self, parts, scheme, dtype, ggml_types=None) -> dict:
        if any(name.startswith(GPT_OSS_EXPERTS) for name in parts):
            return _gpt_oss_experts(parts, dtype)
        return super().dequantize(parts, scheme, dtype, ggml_types)

    def dense(self, parts, scheme, ggml_types):
        from .packing import mxfp4

        return mxfp4(need(parts, "weight_packed"), need(parts, "weight_scale"))


def _gpt_oss_experts(parts, dtype) -> dict:
    """gpt-oss's fused MXFP4 experts -> transformers' in-memory ``[E, K, rows]`` (``x @ W``):
    ``gate_up_proj`` ``[E, H, 2I]`` (gate and up interleaved, as stored), ``down_proj``
    ``[E, I, H]``; biases (``[E, rows]``) pass through."""
    from .packing import mxfp4

    check_parts(
        "mxfp4",
        parts,
        [p + s for p in GPT_OSS_EXPERTS for s in ("", "_blocks", "_scales", "_bias")],
    )
    out = {}
    for p in GPT_OSS_EXPERTS:
        if f"{p}_blocks" in parts:
            blocks, scales = parts[f"{p}_blocks"], need(parts, f"{p}_scales")
            if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
                raise ValueError(
                    f"{p}_blocks {list(blocks.shape)} and {p}_scales "
                    f"{list(scales.shape)} are not [E, rows, K/32, 16] and "
                    "[E, rows, K/32]"
                )
            w = mxfp4(blocks.flatten(-2), scales)  # [E, rows, K]
            out[p] = w.transpose(-1, -2).to(dtype).contiguous()  # [E, K, rows]
        elif p in parts:  # the bf16 experts of an unquantized gpt-oss
            out[p] = parts[p].to(dtype)
        if f"{p}_bias" in parts:
            out[f"{p}_bias"] = parts[f"{p}_bias"].to(dtype)
    return out


FORMAT = MXFP4()
