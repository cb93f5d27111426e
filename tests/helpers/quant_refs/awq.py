"""AutoAWQ GEMM checkpoints (``quant_method: "awq"``, ``version: "gemm"``), 4 bit.

Tensors, for ``W [N, K]``, group size ``G`` (``-1`` = one group; AutoAWQ asserts ``K % G == 0``):

============  ===============  =======  ==========================================
``qweight``   ``[K, N/8]``     int32    codes packed along **N**, interleaved
``qzeros``    ``[K/G, N/8]``   int32    zero points, same packing, stored as is
``scales``    ``[K/G, N]``     float16
============  ===============  =======  ==========================================

No ``g_idx``: row ``k`` belongs to group ``k // G``.  Nibble ``i`` (bits ``4i..4i+3``) of word
``c`` holds column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``; reading
the nibbles back in column order takes nibble ``AWQ_REVERSE_ORDER[j]`` for column ``8c + j``,
``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``.  Sources: AutoAWQ
``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``
(``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``,
``qweight[:, col] |= intweight[:, col*8 + order_map[i]] << (i*4)``; same loop for ``qzeros``
with no offset) and ``awq/utils/packing_utils.py`` (``AWQ_ORDER``, ``AWQ_REVERSE_ORDER``,
``dequantize_gemm``: ``(iweight - izeros) * scales`` with both repeated ``G`` times along K).

Dequantization: ``W[n, k] = scales[k//G, n] * (q[k, n] - z[k//G, n])``.
"""

from __future__ import annotations

import numpy as np

from ._bits import pack_bits, unpack_bits
from ._dtypes import round_up_scale, to_f32, to_int

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "dequantize_awq",
    "pack_awq",
    "quantize_awq",
    "unpack_awq",
]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_BITS = 4
_PF = 8


def pack_awq(codes) -> np.ndarray:
    """Codes ``[R, N]`` (0..15) -> int32 ``[R, N/8]``, nibble ``i`` of word ``c`` = column
    ``8c + AWQ_ORDER[i]``."""
    codes = np.asarray(codes, dtype=np.int64)
    r, n = codes.shape
    if n % _PF:
        raise ValueError(f"N={n} is not a multiple of 8 for AWQ")
    interleaved = codes.reshape(r, n // _PF, _PF)[:, :, list(AWQ_ORDER)].reshape(r, n)
    return pack_bits(interleaved, _BITS, axis=1)


def unpack_awq(words) -> np.ndarray:
    """Inverse of :func:`pack_awq`: int32 ``[R, N/8]`` -> codes ``[R, N]`` in column order."""
    words = to_int(words)
    r, c = words.shape
    nibbles = unpack_bits(words, _BITS, axis=1).reshape(r, c, _PF)
    out = np.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles  # nibble i -> column AWQ_ORDER[i]
    return out.reshape(r, c * _PF)


def quantize_awq(w, group_size: int = 128, *, bits: int = 4) -> dict:
    """Round-to-nearest asymmetric 4-bit quantization of ``w [N, K]`` into AWQ GEMM tensors.

    The grid of each (group, column) spans ``[min(x, 0), max(x, 0)]`` with the fp16 scale rounded
    up (AutoAWQ's ``pseudo_quantize_tensor`` uses ``[min, max]`` and ``clamp(min=1e-5)``; the
    stored layout is the same).
    """
    if bits != _BITS:
        raise NotImplementedError("AWQ GEMM is 4-bit only")
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    g = k if group_size == -1 else int(group_size)
    if k % g:
        raise ValueError(f"K={k} is not a multiple of the group size {g}")
    if n % _PF:
        raise ValueError(f"N={n} is not a multiple of 8")
    maxq = (1 << bits) - 1
    x = w.T.astype(np.float64).reshape(k // g, g, n)  # [ng, G, N]
    xmin = np.minimum(x.min(axis=1), 0.0)
    xmax = np.maximum(x.max(axis=1), 0.0)
    span = np.maximum(xmax - xmin, 1e-5)
    s16, s = round_up_scale(span / maxq, "float16")  # [ng, N]
    z = np.round(-xmin / s).astype(np.int64)
    codes = (
        np.clip(np.round(x / s[:, None, :]) + z[:, None, :], 0, maxq).astype(np.int64).reshape(k, n)
    )
    return {"qweight": pack_awq(codes), "qzeros": pack_awq(z), "scales": s16}


def dequantize_awq(tensors, group_size: int | None = None) -> np.ndarray:
    """AWQ GEMM tensors -> float32 ``W [N, K]``; ``G`` defaults to ``K / scales.shape[0]``."""
    q = unpack_awq(tensors["qweight"])  # [K, N]
    z = unpack_awq(tensors["qzeros"])  # [ng, N]
    s = to_f32(tensors["scales"])  # [ng, N]
    k, n = q.shape
    ng = s.shape[0]
    if group_size is None or group_size == -1:
        if k % ng:
            raise ValueError(f"K={k} is not a multiple of {ng} groups: pass group_size")
        g = k // ng
    else:
        g = int(group_size)
    rows = np.arange(k) // g
    if rows[-1] >= ng or z.shape != s.shape or s.shape[1] != n:
        raise ValueError("qweight, qzeros and scales shapes disagree")
    w = s[rows] * (q - z[rows]).astype(np.float32)
    return np.ascontiguousarray(w.T)
