"""GPTQ checkpoints (AutoGPTQ ``checkpoint_format: "gptq"`` = v1, GPTQModel ``"gptq_v2"`` = v2).

Tensors, for ``W [N, K]`` (N = out_features, K = in_features), ``b`` bits, group size ``G``
(``-1`` = one group, ``G := K``), ``ng = ceil(K/G)``:

============  ===============  =======  ==============================================
``qweight``   ``[K*b/32, N]``  int32    codes packed along **K**, LSB first
``qzeros``    ``[ng, N*b/32]`` int32    zero points packed along **N**, LSB first
``scales``    ``[ng, N]``      float16
``g_idx``     ``[K]``          int32    group of input row ``k``
============  ===============  =======  ==============================================

Packing is a dense bit stream along the packed axis (see ``_bits``): for ``b`` in {2, 4, 8} code
``k`` sits at bit ``b*(k % (32/b))`` of word ``k // (32/b)``; for ``b = 3`` 32 codes fill 3 words
and codes 10 and 21 of each 32 straddle words.  So K must be a multiple of 32/b (32 for 3 bit)
and N*b a multiple of 32.  (AutoGPTQ allocates ``K // 32 * b`` rows and ``N // 32 * b`` columns,
i.e. it needs K and N to be multiples of 32; the layout is the same.)

Dequantization::

    W[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])

Zero points: v1 stores ``(z - 1) mod 2**b`` in each field and readers add 1 back
(mod ``2**b``).  A zero point of 0 (possible only with ``sym=False``) is stored as the
all-ones field ``2**b - 1``: the "wraparound".  This is the per-field convention GPTQModel's
loader uses (``_shift_gptq_qzeros``: ``(zeros + delta) & mask`` then repack, for 3 bit) and the
one ``tests/helpers/gptq_reference.py`` decodes.  Beware that GPTQModel's 2/4/8-bit v1<->v2
converters instead add/subtract a constant such as ``0x11111111`` to the whole word: identical
whenever no zero point is 0, but a stored ``z = 0`` then borrows from the next field (the "~13%
overflow" its comments warn about).  v2 stores ``z`` itself.  Symmetric checkpoints have
``z = 2**(b-1)``: every 4-bit v1 qzeros word is ``0x77777777`` (v2: ``0x88888888``).

Act-order (``desc_act=True``): GPTQ quantizes columns in the order ``perm`` (AutoGPTQ: the
Hessian diagonal, descending), so group ``j`` holds input rows ``perm[j*G:(j+1)*G]`` and
``g_idx = (arange(K) // G)[argsort(perm)]`` (AutoGPTQ ``gptq.py fasterquant``); qweight stays in
the original row order.  The quantizer here takes ``perm`` as an argument.
"""

from __future__ import annotations

import math

import numpy as np

from ._bits import pack_bits, unpack_bits
from ._dtypes import round_up_scale, to_f32, to_int

__all__ = [
    "BITS",
    "act_order_g_idx",
    "dequantize_gptq",
    "normalize_version",
    "pack_qweight",
    "pack_qzeros",
    "quantize_gptq",
    "unpack_qweight",
    "unpack_qzeros",
]

BITS = (2, 3, 4, 8)


def normalize_version(version) -> int:
    """1, ``"gptq"``, ``"v1"`` -> 1; 2, ``"gptq_v2"``, ``"v2"`` -> 2."""
    table = {1: 1, "1": 1, "v1": 1, "gptq": 1, 2: 2, "2": 2, "v2": 2, "gptq_v2": 2}
    try:
        return table[version]
    except (KeyError, TypeError):
        raise ValueError(f"unknown GPTQ zero-point format {version!r}") from None


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"GPTQ bits must be one of {BITS}, got {bits}")


def _pack_unit(bits: int) -> int:
    """Codes per packing unit along an axis: 32/b words' worth, 32 codes (3 words) for 3 bit."""
    return 32 if bits == 3 else 32 // bits


def pack_qweight(codes, bits: int) -> np.ndarray:
    """Codes ``q [K, N]`` -> ``qweight [K*b/32, N]`` int32 (packed along K)."""
    _check_bits(bits)
    codes = np.asarray(codes)
    if codes.shape[0] % _pack_unit(bits):
        raise ValueError(
            f"K={codes.shape[0]} is not a multiple of {_pack_unit(bits)} for {bits}-bit GPTQ"
        )
    return pack_bits(codes, bits, axis=0)


def unpack_qweight(qweight, bits: int) -> np.ndarray:
    """``qweight [K*b/32, N]`` -> codes ``q [K, N]`` (int64)."""
    _check_bits(bits)
    qweight = to_int(qweight)
    return unpack_bits(qweight, bits, axis=0, count=qweight.shape[0] * 32 // bits)


def pack_qzeros(zeros, bits: int, version=1) -> np.ndarray:
    """Zero points ``z [ng, N]`` (``0 <= z < 2**b``) -> ``qzeros [ng, N*b/32]`` int32 (packed
    along N).

    v1 stores ``(z - 1) mod 2**b`` per field; v2 stores ``z``.
    """
    _check_bits(bits)
    zeros = np.asarray(zeros, dtype=np.int64)
    if zeros.shape[1] % _pack_unit(bits):
        raise ValueError(
            f"N={zeros.shape[1]} is not a multiple of {_pack_unit(bits)} for {bits}-bit GPTQ qzeros"
        )
    if normalize_version(version) == 1:
        zeros = (zeros - 1) % (1 << bits)
    return pack_bits(zeros, bits, axis=1)


def unpack_qzeros(qzeros, bits: int, version=1) -> np.ndarray:
    """``qzeros [ng, N*b/32]`` -> the zero points ``z [ng, N]`` the kernels use (v1: field + 1,
    mod 2**b)."""
    _check_bits(bits)
    qzeros = to_int(qzeros)
    fields = unpack_bits(qzeros, bits, axis=1, count=qzeros.shape[1] * 32 // bits)
    if normalize_version(version) == 1:
        fields = (fields + 1) % (1 << bits)
    return fields


def act_order_g_idx(perm, group_size: int) -> np.ndarray:
    """``g_idx`` for a GPTQ run that quantized input rows in the order ``perm``:
    ``g_idx[perm[i]] = i // G``."""
    perm = np.asarray(perm, dtype=np.int64)
    k = perm.shape[0]
    if not np.array_equal(np.sort(perm), np.arange(k)):
        raise ValueError("perm is not a permutation of range(K)")
    g = k if group_size == -1 else group_size
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // g
    return g_idx


def quantize_gptq(
    w, bits: int = 4, group_size: int = 128, *, sym: bool = True, version=1, perm=None
) -> dict:
    """Round-to-nearest GPTQ quantization of ``w [N, K]`` into the checkpoint tensors.

    ``perm`` (a permutation of ``range(K)``) turns on act-order: groups are formed from
    consecutive rows of ``perm`` and ``g_idx`` is non-trivial.  Each group's grid spans
    ``[min(x, 0), max(x, 0)]`` (symmetric: ``[-amax, amax]`` with ``z = 2**(b-1)``) and its fp16
    scale is rounded up, so every element is within half a step of ``w``.
    """
    _check_bits(bits)
    version = normalize_version(version)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError("w must be 2-D [N, K]")
    n, k = w.shape
    g = k if group_size == -1 else int(group_size)
    if g <= 0:
        raise ValueError(f"bad group size {group_size}")
    g_idx = (
        (np.arange(k) // g).astype(np.int32) if perm is None else act_order_g_idx(perm, group_size)
    )
    n_groups = math.ceil(k / g)
    maxq = (1 << bits) - 1

    wt = w.T.astype(np.float64)  # [K, N]
    codes = np.empty((k, n), dtype=np.int64)
    scales = np.empty((n_groups, n), dtype=np.float16)
    zeros = np.empty((n_groups, n), dtype=np.int64)
    for gi in range(n_groups):
        rows = np.nonzero(g_idx == gi)[0]
        x = wt[rows]
        xmin = np.minimum(x.min(axis=0), 0.0)
        xmax = np.maximum(x.max(axis=0), 0.0)
        if sym:
            xmax = np.maximum(-xmin, xmax)
            xmin = -xmax
        dead = (xmin == 0) & (xmax == 0)
        xmin = np.where(dead, -1.0, xmin)
        xmax = np.where(dead, 1.0, xmax)
        s16, s = round_up_scale((xmax - xmin) / maxq, "float16")
        z = (
            np.full(n, (maxq + 1) // 2, dtype=np.int64)
            if sym
            else np.round(-xmin / s).astype(np.int64)
        )
        codes[rows] = np.clip(np.round(x / s) + z, 0, maxq).astype(np.int64)
        scales[gi] = s16
        zeros[gi] = z
    return {
        "qweight": pack_qweight(codes, bits),
        "qzeros": pack_qzeros(zeros, bits, version),
        "scales": scales,
        "g_idx": g_idx,
    }


def dequantize_gptq(tensors, bits: int, version=1, *, group_size: int | None = None) -> np.ndarray:
    """GPTQ tensors -> float32 ``W [N, K]``.

    ``g_idx`` gives K and each row's group; a checkpoint without ``g_idx`` needs ``group_size``.
    """
    _check_bits(bits)
    q = unpack_qweight(tensors["qweight"], bits)  # [K, N]
    k = q.shape[0]
    if "g_idx" in tensors and tensors["g_idx"] is not None:
        g_idx = to_int(tensors["g_idx"]).astype(np.int64)
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx has shape {g_idx.shape}, qweight holds K={k}")
    elif group_size is not None:
        g_idx = np.arange(k) // (k if group_size == -1 else group_size)
    else:
        raise ValueError("no g_idx: pass group_size")
    s = to_f32(tensors["scales"])  # [ng, N]
    n = s.shape[1]
    if q.shape[1] != n:
        raise ValueError(f"qweight has N={q.shape[1]}, scales N={n}")
    z = unpack_qzeros(tensors["qzeros"], bits, version)[:, :n]
    if z.shape[0] != s.shape[0]:
        raise ValueError("qzeros and scales disagree on the number of groups")
    w = s[g_idx] * (q - z[g_idx]).astype(np.float32)
    return np.ascontiguousarray(w.T)
