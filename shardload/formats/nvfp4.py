"""compressed-tensors ``nvfp4-pack-quantized`` (NVFP4, NVFP4A16): FP4 codes, FP8 group scales.

Stored: ``weight_packed`` uint8 ``[N, K/2]`` (two E2M1 codes per byte, the even element in the
low nibble), ``weight_scale`` E4M3 ``[N, K/16]``, ``weight_global_scale`` ``[1]`` (a
reciprocal, per module: replicated, never narrowed, as a fused ``qkv_proj`` has one) and the
activations' ``input_global_scale``. ``W = fp4 * (s / g)``, the division first in float32 as
compressed-tensors computes it. K splits only at 16-element scale groups.
"""

from __future__ import annotations

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .scheme import Scheme


def fp4_reader(method: str, fmt: str, want: int):
    """The reader of a packed FP4 (E2M1) compressed-tensors format: ``method``'s scheme, one
    scale per ``want`` elements of K (the only group compressed-tensors' compressor packs)."""

    def read_config(quant, weights) -> Scheme:
        bits = weights.int("num_bits", min=1, max=64)
        kind = weights.str("type", default="float", nullable=True)
        group = weights.int("group_size", min=1, max=MAX_GROUP)
        symmetric = weights.bool("symmetric", default=True, nullable=True)
        if bits != 4 or kind != "float":
            raise PlanError(
                f"key {weights.name('num_bits')!r} is {bits} and "
                f"{weights.name('type')!r} is {kind!r}: {fmt} holds 4-bit float "
                "(E2M1) weights",
                source=quant.file,
            )
        if group != want:
            raise PlanError(
                f"key {weights.name('group_size')!r} is {group}: {fmt} stores one "
                f"scale per {want} weights (compressed-tensors packs no other group "
                "size in this format)",
                source=quant.file,
            )
        if not symmetric:
            raise PlanError(
                f"key {weights.name('symmetric')!r} is false: asymmetric FP4 "
                "weights are not supported (compressed-tensors does not produce "
                "them)",
                source=quant.file,
            )
        return Scheme(
            method,
            4,
            group,
            file=quant.file_label,
            keys=keys_of(weights, bits="num_bits", group_size="group_size"),
        )

    return read_config


def packed_fp4_axes(scheme, suffix) -> TensorAxes | None:
    """compressed-tensors' packed FP4 tensors (NVFP4 and MXFP4 store them alike)."""
    if suffix == "weight_packed":
        return TensorAxes(Axis(0), Axis(1, 2))  # two FP4 codes per byte along K
    if suffix == "weight_scale":
        return TensorAxes(Axis(0), Axis(1, scheme.group_size), grouped=True)
    if suffix in ("weight_global_scale", "input_global_scale"):
        return TensorAxes(None, None)  # per tensor (per module): replicated
    return None


class NVFP4(QuantFormat):
    name = "nvfp4"
    description = "compressed-tensors nvfp4-pack-quantized (NVFP4, NVFP4A16)"
    parts = ("weight_packed", "weight_scale", "weight_global_scale")
    quantized_parts = ("weight_packed", "weight_scale")
    configs = {
        "compressed-tensors/nvfp4-pack-quantized": fp4_reader("nvfp4", "nvfp4-pack-quantized", 16)
    }

    def tensor_axes(self, scheme, suffix, meta, fmt):
        return packed_fp4_axes(scheme, suffix)

    def dense(self, parts, scheme, ggml_types):
        from .packing import fp4_values, scale_groups

        # compressed-tensors' order: the E4M3 scale divided by the (reciprocal) global scale in
        # float32 first, then the codes times that; so results match it bit for bit
        global_scale = need(parts, "weight_global_scale").float()
        if global_scale.numel() != 1:
            raise ValueError(
                f"weight_global_scale has {global_scale.numel()} values; one per module is stored"
            )
        scale = need(parts, "weight_scale").float() / global_scale.reshape(())
        return scale_groups(fp4_values(need(parts, "weight_packed")), scale, 16)


FORMAT = NVFP4()
