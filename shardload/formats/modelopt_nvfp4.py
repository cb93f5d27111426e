"""NVIDIA ModelOpt NVFP4 (``quant_method: modelopt`` / ``hf_quant_config.json``, ``quant_algo:
NVFP4``).

Stored: ``weight`` uint8 ``[N, K/2]`` (two E2M1 codes per byte), ``weight_scale`` E4M3 ``[N,
K/16]``, and the per-module scalars ``weight_scale_2`` and ``input_scale`` (replicated).
``W = fp4 * (s * s2)``, in that order (``NVFP4QTensor.dequantize``). K splits only at
16-element groups. Unquantized lm_head and embeddings are plain float weights.
"""

from __future__ import annotations

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .scheme import Scheme


def read_config(quant) -> Scheme:
    group = quant.int("group_size", min=1, max=MAX_GROUP, default=16, nullable=True)
    if group != 16:
        raise PlanError(
            f"key {quant.name('group_size')!r} is {group}: NVFP4 stores one scale per 16 weights",
            source=quant.file,
        )
    return Scheme(
        "modelopt-nvfp4",
        4,
        group,
        file=quant.file_label,
        keys=keys_of(quant, group_size="group_size") if quant.has("group_size") else {},
    )


class ModelOptNVFP4(QuantFormat):
    name = "modelopt-nvfp4"
    description = "NVIDIA ModelOpt NVFP4"
    parts = ("weight", "weight_scale", "weight_scale_2")
    quantized_parts = ("weight_scale",)
    configs = {"modelopt/NVFP4": read_config}

    def tensor_axes(self, scheme, suffix, meta, fmt):
        if suffix == "weight" and meta.dtype == "uint8":  # (lm_head, embeddings: unquantized)
            return TensorAxes(Axis(0), Axis(1, 2))  # two FP4 codes per byte along K
        if suffix == "weight_scale":
            return TensorAxes(Axis(0), Axis(1, scheme.group_size), grouped=True)
        if suffix in ("weight_scale_2", "input_scale"):
            return TensorAxes(None, None)  # per module: replicated
        return None

    def dense(self, parts, scheme, ggml_types):
        from .packing import fp4_values, scale_groups

        # ModelOpt's order (NVFP4QTensor.dequantize): E4M3 scale times weight_scale_2, then codes
        scale_2 = need(parts, "weight_scale_2").float()
        scale = need(parts, "weight_scale").float() * scale_2.reshape(())
        return scale_groups(fp4_values(need(parts, "weight")), scale, 16)


FORMAT = ModelOptNVFP4()
