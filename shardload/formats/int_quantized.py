"""compressed-tensors ``int-quantized`` (W8A8 / INT8): one int8 element per code.

Stored: ``weight`` int8 ``[N, K]``, split like a dense weight; ``weight_scale`` (and
``weight_zero_point``) per tensor (``[1]``: replicated), per output channel (``[N, 1]``: rows
split with the weight, replicated on a row split) or per group of K (``[N, K/G]``: in whole
groups). Per-tensor and static ``input_scale`` are replicated. ``W = (q - zp) * s``.
"""

from __future__ import annotations

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .pack_quantized import ACT_ORDER_CHOICES, ACT_ORDERS
from .scheme import Scheme


def read_config(quant, weights) -> Scheme:
    bits = weights.int("num_bits", min=1, max=64, default=8)
    kind = weights.str("type", default="int", nullable=True)
    group = weights.int("group_size", min=1, max=MAX_GROUP, also=(-1,), default=None, nullable=True)
    implied = "tensor" if group is None else "channel" if group == -1 else "group"
    strategy = weights.str("strategy", default=implied, nullable=True)
    act = weights.one_of("actorder", ACT_ORDER_CHOICES, default=None, nullable=True)
    if kind != "int" or bits > 8:
        raise PlanError(
            f"key {weights.name('num_bits')!r} is {bits} and "
            f"{weights.name('type')!r} is {kind!r}: int-quantized weights of at "
            "most 8 bits (one int8 element per code) are supported",
            source=quant.file,
        )
    if strategy not in ("tensor", "channel", "group"):
        raise PlanError(
            f"key {weights.name('strategy')!r} is {strategy!r}: int-quantized "
            "weights with one scale per tensor, per channel or per group are "
            "supported (tensor, channel, group)",
            source=quant.file,
        )
    if strategy == "group" and group in (None, -1):
        raise weights.refuse("group_size", group, "a positive group size for strategy 'group'")
    if act in ACT_ORDERS:
        raise PlanError(
            f"key {weights.name('actorder')!r} is {act!r}: act-order int-quantized "
            "weights are not supported by the planner",
            source=quant.file,
        )
    return Scheme(
        "int-quantized",
        bits,
        group if strategy == "group" else -1,
        strategy=strategy,
        file=quant.file_label,
        keys=keys_of(weights, bits="num_bits", group_size="group_size"),
    )


class IntQuantized(QuantFormat):
    name = "int-quantized"
    description = "compressed-tensors int-quantized (W8A8 / INT8)"
    parts = ("weight", "weight_scale", "weight_zero_point")
    quantized_parts = ("weight_scale",)
    configs = {"compressed-tensors/int-quantized": read_config}

    def tensor_axes(self, scheme, suffix, meta, fmt):
        if suffix not in ("weight_scale", "weight_zero_point"):
            return None
        if scheme.strategy == "tensor":  # replicated (per tensor)
            return TensorAxes(None, None, per_part=suffix == "weight_scale")
        group = Axis(1, scheme.group_size) if scheme.group_size != -1 else None
        return TensorAxes(Axis(0), group, grouped=True)

    def zero_weight_fill(self, scheme, parts, read):
        # (q - zp) * s: the zero point is a zero weight, if every column shares it
        from .packing import one_code

        return one_code(read("weight_zero_point")) if "weight_zero_point" in parts else 0

    def dense(self, parts, scheme, ggml_types):
        import torch

        from .packing import columns

        q, s = need(parts, "weight").to(torch.int32), need(parts, "weight_scale").float()
        zp = parts.get("weight_zero_point", torch.zeros((), dtype=torch.int32))
        if s.numel() > 1 and s.shape[-1] > 1:  # per group: one scale column per group of K
            s = columns(s, q.shape[-1], scheme.group_size)
            zp = columns(zp, q.shape[-1], scheme.group_size) if zp.numel() > 1 else zp
        elif s.numel() == 1:  # per tensor, [] or [1]
            s, zp = s.reshape(()), zp.reshape(())
        return (q - zp.to(torch.int32)).float() * s


FORMAT = IntQuantized()
