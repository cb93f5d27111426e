"""compressed-tensors ``pack-quantized`` (W4A16, W8A16; llmcompressor's GPTQ/AWQ output).

Stored: ``weight_packed`` int32 ``[N, K*b/32]`` (codes along K, stored plus ``2^(b-1)``),
``weight_scale`` ``[N, K/G]``, ``weight_zero_point`` int32 ``[N*b/32, K/G]`` (asymmetric only;
packed along **N**), ``weight_g_idx`` ``[K]`` (act-order), ``weight_shape`` ``[2]`` (the true
``[N, K]``: the last word may be part padding). ``W = (q - zp) * s``.

Split rules: a column split takes rows of ``weight_packed`` and ``weight_scale`` and zero-point
rows in whole words; a row split takes columns in whole words and scale columns in whole groups.
``weight_shape`` is rewritten per worker. Act-order as for GPTQ.
"""

from __future__ import annotations

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .scheme import Scheme

#: compressed-tensors' activation orderings that reorder a weight's input rows (g_idx)
ACT_ORDERS = (True, "group", "dynamic")
ACT_ORDER_CHOICES = (False, True, "group", "weight", "static", "dynamic")


def read_config(quant, weights) -> Scheme:
    bits = weights.int("num_bits", min=1, max=8)
    strategy = weights.str("strategy", default="", nullable=True)
    group = weights.int("group_size", min=1, max=MAX_GROUP) if strategy == "group" else -1
    act = weights.one_of("actorder", ACT_ORDER_CHOICES, default=None, nullable=True) in ACT_ORDERS
    if bits not in (2, 4, 8):
        raise PlanError(
            f"key {weights.name('num_bits')!r} is {bits}: pack-quantized weights "
            "of 2, 4 or 8 bits are supported (they fill 32-bit words exactly)",
            source=quant.file,
        )
    return Scheme(
        "pack-quantized",
        bits,
        group,
        act,
        file=quant.file_label,
        keys=keys_of(weights, bits="num_bits", group_size="group_size"),
    )


class PackQuantized(QuantFormat):
    name = "pack-quantized"
    description = "compressed-tensors pack-quantized (W4A16, W8A16)"
    parts = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
    quantized_parts = ("weight_packed", "weight_scale")
    configs = {"compressed-tensors/pack-quantized": read_config}
    g_idx_part = "weight_g_idx"

    def tensor_axes(self, scheme, suffix, meta, fmt):
        pack = 32 // scheme.bits
        group = Axis(1, scheme.group_size) if scheme.group_size != -1 else None
        if suffix == "weight_packed":
            return TensorAxes(Axis(0), Axis(1, pack))
        if suffix == "weight_scale":
            return TensorAxes(Axis(0), group, grouped=True, act_order=True)
        if suffix == "weight_zero_point":
            return TensorAxes(Axis(0, pack), group, grouped=True, act_order=True)
        if suffix == "weight_g_idx":
            return TensorAxes(None, Axis(0), special="g_idx")
        if suffix == "weight_shape":
            return TensorAxes(None, None, special="shape")
        return None

    def zero_weight_fill(self, scheme, parts, read):
        # codes stored + 2^(b-1): a zero weight is the stored offset, or the zero point
        from .packing import fill_word, one_code, unpack_int32

        code = 1 << (scheme.bits - 1)
        if "weight_zero_point" in parts:  # asymmetric: stored with the same offset
            code = one_code(
                unpack_int32(
                    read("weight_zero_point"),
                    scheme.bits,
                    dim=0,
                    count=read("weight_scale").shape[0],
                )
            )
        return None if code is None else fill_word(code, scheme.bits)

    def dense(self, parts, scheme, ggml_types):
        from .packing import columns, unpack_int32

        bits, group_size = scheme.bits, scheme.group_size
        offset = 1 << (bits - 1)  # codes (and zero points) are stored + 2^(b-1), as unsigned
        packed, s = need(parts, "weight_packed"), need(parts, "weight_scale").float()
        n, k = packed.shape[0], packed.shape[1] * 32 // bits
        if "weight_shape" in parts:  # the true K: the last word may be part padding
            shape = [int(v) for v in parts["weight_shape"].tolist()]
            if len(shape) != 2 or shape[0] != n:
                raise ValueError(
                    f"weight_shape {shape} does not fit weight_packed {list(packed.shape)}"
                )
            k = shape[1]
        g_idx = parts.get("weight_g_idx")
        q = unpack_int32(packed, bits, dim=1, count=k) - offset
        if "weight_zero_point" in parts:  # asymmetric
            zp = unpack_int32(parts["weight_zero_point"], bits, dim=0, count=n) - offset
            q = q - columns(zp, k, group_size, g_idx)
        return q.float() * columns(s, k, group_size, g_idx)


FORMAT = PackQuantized()
