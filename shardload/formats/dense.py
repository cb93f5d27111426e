"""Unquantized checkpoints (fp16 / bf16 / fp32): ``weight [N, K]`` and ``bias`` as stored."""

from __future__ import annotations

from .base import QuantFormat


class Dense(QuantFormat):
    name = "none"
    description = "fp16 / bf16 / fp32"
    recognised_by = "no quantization_config"
    parts = ("weight",)

    def describe(self, scheme) -> str:
        return "none"

    def is_quantized(self, parts) -> bool:
        return False

    def dequantize(self, parts, scheme, dtype, ggml_types=None) -> dict:
        return {name: t.to(dtype) if t.is_floating_point() else t for name, t in parts.items()}


FORMAT = Dense()
