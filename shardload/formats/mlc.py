"""MLC-LLM ``q4f16_1``: 4-bit codes in the NK layout (out-features first), groups of 32.

Stored: ``q_weight`` uint32 ``[N, K/8]``, ``q_scale`` fp16 ``[N, K/32]``; ``W = (q - 7) * s``
(symmetric around ``2^(4-1) - 1``, MLC's ``max_int_value``). Rows split anywhere, K in whole
groups. KN layouts (``q4f16_0``) would need a transpose and are refused.
"""

from __future__ import annotations

from .base import Axis, QuantFormat, TensorAxes, need


class MLC(QuantFormat):
    name = "mlc"
    description = "MLC q4f16_1"
    recognised_by = "an MLC folder's quantization q4f16_1"
    parts = ("q_weight", "q_scale")
    quantized_parts = ("q_weight",)
    hf_style = False

    def describe(self, scheme) -> str:
        return "mlc"

    def tensor_axes(self, scheme, suffix, meta, fmt):
        if suffix == "q_weight":
            return TensorAxes(Axis(0), Axis(1, 8, 1))
        if suffix == "q_scale":
            return TensorAxes(Axis(0), Axis(1, 32, 1))
        if suffix == "weight":
            return TensorAxes(Axis(0), Axis(1))
        return None

    def dense(self, parts, scheme, ggml_types):
        from .packing import scale_groups, unpack_int32

        q = unpack_int32(need(parts, "q_weight"), 4, dim=-1)
        s = need(parts, "q_scale").float()
        return scale_groups((q - 7).float(), s, 32)


FORMAT = MLC()
