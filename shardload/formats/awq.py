"""AWQ GEMM (AutoAWQ, ``quant_method: awq``, ``version: gemm``): 4-bit codes, interleaved.

Stored: ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[K/G, N/8]``, ``scales`` ``[K/G,
N]``; ``Wᵀ = (q - z) * s``. The nibbles of a word hold columns 0 2 4 6 1 3 5 7, so a column
split in whole int32 words keeps the interleave; rows split freely, scales and zeros in whole
groups. GEMV and other versions store a permuted layout and are refused.
"""

from __future__ import annotations

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .scheme import Scheme

#: AWQ GEMM packs columns 0 2 4 6 1 3 5 7 into nibbles 0..7: column j is nibble REVERSE[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def read_config(quant) -> Scheme:
    version = quant.str("version", default="gemm", nullable=True).lower()
    if version != "gemm":
        raise PlanError(
            f"key {quant.name('version')!r} is {version!r}: that AWQ version "
            "stores a permuted layout; only GEMM checkpoints can be sliced",
            source=quant.file,
        )
    bits_key = "w_bit" if "w_bit" in quant and "bits" not in quant else "bits"
    group_key = (
        "q_group_size" if "q_group_size" in quant and "group_size" not in quant else "group_size"
    )
    return Scheme(
        "awq",
        quant.int(bits_key, choices=(4,), default=4),
        quant.int(group_key, min=1, max=MAX_GROUP, also=(-1,), default=128),
        file=quant.file_label,
        keys=keys_of(quant, bits=bits_key, group_size=group_key),
    )


class AWQ(QuantFormat):
    name = "awq"
    description = "AWQ GEMM 4-bit"
    parts = ("qweight", "qzeros", "scales")
    quantized_parts = ("qweight",)
    configs = {"awq": read_config}

    def tensor_axes(self, scheme, suffix, meta, fmt):
        # -1: one group the whole K (AutoAWQ's meaning)
        group = Axis(0, scheme.group_size) if scheme.group_size != -1 else None
        if suffix == "qweight":
            return TensorAxes(Axis(1, 8), Axis(0))
        if suffix == "qzeros":
            return TensorAxes(Axis(1, 8), group, grouped=True)
        if suffix == "scales":
            return TensorAxes(Axis(1), group, grouped=True)
        return None

    def zero_weight_fill(self, scheme, parts, read):
        # (q - z) * s: the zero point's code is a zero weight, if every column shares it
        from .packing import fill_word, one_code, unpack_int32

        if "qzeros" not in parts:
            return None
        code = one_code(unpack_int32(read("qzeros"), 4, dim=1))
        return None if code is None else fill_word(code, 4)

    def dense(self, parts, scheme, ggml_types):
        from .packing import columns, unpack_int32

        def unpack(words):  # [rows, N/8] -> [N, rows], nibbles put back in column order
            codes = unpack_int32(words, 4, dim=1).unflatten(1, (-1, 8))
            return codes[..., list(AWQ_REVERSE_ORDER)].flatten(1).t()

        q, z = unpack(need(parts, "qweight")), unpack(need(parts, "qzeros"))
        s = need(parts, "scales").float().t()
        k = q.shape[1]
        return (q - columns(z, k, scheme.group_size)).float() * columns(s, k, scheme.group_size)


FORMAT = AWQ()
