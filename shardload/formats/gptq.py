"""GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``): 2/3/4/8-bit integer codes, any group.

Stored per linear layer (``W [N, K]``, ``b`` bits, ``pf = 32 / b``, ``G`` the group size):
``qweight`` int32 ``[K*b/32, N]`` (codes packed along K, 3-bit codes straddling words),
``qzeros`` int32 ``[K/G, N*b/32]`` (zero points packed along N), ``scales`` ``[K/G, N]``,
``g_idx`` ``[K]`` (each input row's group). ``W = (q - z[g]) * s[g]`` with ``g = g_idx[k]``
(``k // G`` without one); v1 stores ``z - 1`` wrapped to b bits, v2 (``checkpoint_format:
gptq_v2``) stores ``z``.

Split rules: a column split takes ``qweight``/``scales`` columns and ``qzeros`` columns in whole
words; ``g_idx`` stays whole. A row split takes ``qweight`` rows in whole words, ``scales`` and
``qzeros`` rows in whole groups (the K share must be a multiple of G), and ``g_idx`` sliced and
rebased. **Act-order** (``desc_act``: ``g_idx`` reorders rows): any row may use any group, so a
row split keeps every scale and zero point, and ``g_idx`` is sliced but not rebased.
Zero-padding a row split adds zero rows in zero-scaled groups of their own, which ``g_idx``
points them at (``shardload.take_g_idx``; act-order appends the zero groups to the replicated
scales, ``shardload.replicate_padded``): a zero scale makes any code 0. Per channel (group -1)
a padded row shares its column's scale: its codes are the zero point's (``shardload.
take_units_fill``; symmetric, 2^(b-1) in every column), refused where zero points differ by
column or codes straddle words (3-bit).
"""

from __future__ import annotations

from ..config_fields import MAX_GROUP
from ..errors import PlanError
from .base import Axis, QuantFormat, TensorAxes, keys_of, need
from .scheme import Scheme

#: bits -> (K rows, in this many int32 words)
PACK = {2: (16, 1), 3: (32, 3), 4: (8, 1), 8: (4, 1)}


def read_config(quant) -> Scheme:
    fmt = quant.str("checkpoint_format", default="gptq", nullable=True).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise PlanError(
            f"key {quant.name('checkpoint_format')!r} is {fmt!r}: that GPTQ "
            "format keeps weights in a tile-permuted layout that cannot be "
            "sliced; repack it to plain GPTQ first",
            source=quant.file,
        )
    return Scheme(
        "gptq",
        quant.int("bits", choices=(2, 3, 4, 8), default=4),
        quant.int("group_size", min=1, max=MAX_GROUP, also=(-1,), default=-1),
        quant.bool("desc_act", default=False, nullable=True),
        gptq_version=2 if fmt == "gptq_v2" else 1,
        file=quant.file_label,
        keys=keys_of(quant, bits="bits", group_size="group_size"),
    )


class GPTQ(QuantFormat):
    name = "gptq"
    description = "GPTQ 2/3/4/8-bit, any group size incl. -1, v1 and v2 zeros"
    parts = ("qweight", "qzeros", "scales", "g_idx")
    quantized_parts = ("qweight",)
    configs = {"gptq": read_config}
    g_idx_part = "g_idx"

    def tensor_axes(self, scheme, suffix, meta, fmt):
        elems, width = PACK[scheme.bits]
        group = Axis(0, scheme.group_size) if scheme.group_size != -1 else None
        if suffix == "qweight":
            return TensorAxes(Axis(1), Axis(0, elems, width))
        if suffix == "qzeros":
            return TensorAxes(Axis(1, elems, width), group, grouped=True, act_order=True)
        if suffix == "scales":
            return TensorAxes(Axis(1), group, grouped=True, act_order=True)
        if suffix == "g_idx":
            return TensorAxes(None, Axis(0), special="g_idx")
        return None

    def zero_weight_fill(self, scheme, parts, read):
        # (q - z) * s: the zero point's code is a zero weight (symmetric: 2^(b-1) everywhere)
        from .packing import fill_word, one_code, unpack_int32

        if "qzeros" not in parts:
            return None
        z = unpack_int32(read("qzeros"), scheme.bits, dim=1, count=read("scales").shape[1])
        if scheme.gptq_version == 1:
            z = (z + 1) & ((1 << scheme.bits) - 1)
        code = one_code(z)
        return None if code is None else fill_word(code, scheme.bits)

    def dense(self, parts, scheme, ggml_types):
        from .packing import columns, unpack_int32

        bits, version = scheme.bits, scheme.gptq_version
        if bits not in PACK:
            raise ValueError(f"GPTQ has 2, 3, 4 or 8 bits, not {bits}")
        if version not in (1, 2):
            raise ValueError(
                f"gptq_version is 1 (AutoGPTQ, zeros stored minus one) or 2, not {version}"
            )
        s = need(parts, "scales").float().t()  # [N, groups]
        q = unpack_int32(need(parts, "qweight"), bits, dim=0).t()  # [N, K]
        z = unpack_int32(need(parts, "qzeros"), bits, dim=1, count=s.shape[0]).t()
        if version == 1:
            # v1 stores z - 1, wrapped to b bits: an all-ones field is z = 0 (GPTQModel's reading)
            z = (z + 1) & ((1 << bits) - 1)
        if q.shape[0] != s.shape[0] or z.shape != s.shape:
            raise ValueError(
                f"qweight, qzeros and scales disagree: N={q.shape[0]}, zeros "
                f"{list(z.shape)}, scales {list(s.shape)} (as [N, groups])"
            )
        k, g_idx, group = q.shape[1], parts.get("g_idx"), scheme.group_size
        return (q - columns(z, k, group, g_idx)).float() * columns(s, k, group, g_idx)


FORMAT = GPTQ()
