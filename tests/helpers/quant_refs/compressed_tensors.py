"""compressed-tensors (llm-compressor) checkpoints: ``pack-quantized`` int4/int8 and
``float-quantized`` FP8.

pack-quantized, for ``W [N, K]``, ``b`` = ``num_bits`` in {4, 8}, ``pf = 32/b``:

=====================  =====================  ==============  ================================
``weight_packed``      ``[N, ceil(K/pf)]``    int32           ``q + 2**(b-1)`` packed along K
``weight_scale``       ``[N, K/G]`` (group)   model dtype     ``[N, 1]`` for channel
                                              (bf16, fp16
                                              or fp32)
``weight_zero_point``  ``[ceil(N/pf), K/G]``  int32           asymmetric only;
                                                              ``zp + 2**(b-1)`` packed along
                                                              **N** (dim 0)
``weight_shape``       ``[2] = [N, K]``       int64
=====================  =====================  ==============  ================================

Codes ``q`` and zero points ``zp`` are signed, in ``[-2**(b-1), 2**(b-1) - 1]``; packing adds
``2**(b-1)`` and lays them LSB first (``pack_to_int32`` / ``unpack_from_int32``,
``compressors/pack_quantized/helpers.py`` in compressed-tensors 0.20.1, and
``quantized_compressors/pack_quantized.py`` before the refactor; a ragged last word is
zero-padded).  The compressor packs the zero point with ``packed_dim=0`` when the weights are
asymmetric and the strategy is group or channel (``PACK_ZP_STRATS``), and drops it when
symmetric.  Releases up to 0.9.3 stored the zero point unpacked, int8 ``[N, K/G]``; 0.9.4 is
the first wheel whose ``compress_weight`` packs it with ``packed_dim=0``.  This module writes the
packed form and ``dequantize_pack_quantized`` also reads the unpacked one.

Dequantization: ``W = (q - zp) * scale``, scale and zp repeated ``G`` times along K.
Scale/zero point (``quantization/utils/helpers.py calculate_qparams``): range includes 0;
symmetric ``scale = amax / ((qmax - qmin) / 2)``; asymmetric
``scale = (max - min) / (qmax - qmin)``, ``zp = round(qmin - min / scale)``;
``q = clamp(round(x / scale + zp), qmin, qmax)``.  Scale shapes from ``lifecycle/initialize.py``:
tensor ``(1,)``, channel ``(N, 1)``, group ``(N, ceil(K/G))``, block ``(ceil(N/bn), ceil(K/bk))``;
scale dtype = the weight's dtype.

float-quantized FP8: ``weight`` float8_e4m3fn ``[N, K]``; ``weight_scale`` tensor ``[1]`` (older
checkpoints: ``[]``), channel ``[N, 1]``, group ``[N, K/G]`` or block ``[ceil(N/bn), ceil(K/bk)]``
(usually 128x128); ``W = weight.float() * scale`` broadcast per strategy.  ``scale = amax / 448``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._bits import pack_bits, unpack_bits
from ._dtypes import eps, round_up_scale, to_f32, to_int

__all__ = [
    "FP8_MAX",
    "dequantize_fp8",
    "dequantize_pack_quantized",
    "pack_int32",
    "quantize_fp8",
    "quantize_pack_quantized",
    "unpack_int32",
]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _check_bits(num_bits: int) -> None:
    if num_bits not in (4, 8):
        raise ValueError(f"pack-quantized num_bits must be 4 or 8 here, got {num_bits}")


def pack_int32(values, num_bits: int, axis: int = 1) -> np.ndarray:
    """Signed codes (``-2**(b-1) <= v < 2**(b-1)``) -> int32 words along ``axis``, offset by
    ``2**(b-1)``."""
    _check_bits(num_bits)
    v = np.asarray(values, dtype=np.int64) + (1 << (num_bits - 1))
    return pack_bits(v, num_bits, axis=axis)


def unpack_int32(words, num_bits: int, size: int, axis: int = 1) -> np.ndarray:
    """Inverse of :func:`pack_int32`: ``size`` signed codes (int64) along ``axis``."""
    _check_bits(num_bits)
    return unpack_bits(to_int(words), num_bits, axis=axis, count=size) - (1 << (num_bits - 1))


def _group_size(strategy: str, k: int, group_size) -> int:
    if strategy == "channel":
        return k
    if strategy == "group":
        if not group_size or group_size <= 0:
            raise ValueError("group strategy needs a positive group_size")
        return int(group_size)
    raise ValueError(f"unsupported pack-quantized strategy {strategy!r}")


def quantize_pack_quantized(
    w,
    num_bits: int = 4,
    *,
    strategy: str = "group",
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype="bfloat16",
) -> dict:
    """Quantize ``w [N, K]`` into pack-quantized tensors (group or channel strategy).

    ``weight_scale`` is a torch tensor for bfloat16, a numpy array for float16/float32.
    """
    _check_bits(num_bits)
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    g = _group_size(strategy, k, group_size)
    ng = math.ceil(k / g)
    qmin, qmax = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    x = np.zeros((n, ng * g), dtype=np.float64)
    x[:, :k] = w  # pad the ragged last group with zeros (0 is always in range)
    x = x.reshape(n, ng, g)
    xmin = np.minimum(x.min(axis=2), 0.0)
    xmax = np.maximum(x.max(axis=2), 0.0)
    if symmetric:
        scale = np.maximum(-xmin, xmax) / ((qmax - qmin) / 2)
    else:
        scale = (xmax - xmin) / (qmax - qmin)
    scale = np.where(scale == 0, eps(scale_dtype), scale)
    stored_scale, s = round_up_scale(scale, scale_dtype)  # [N, ng]
    if symmetric:
        zp = np.zeros((n, ng), dtype=np.int64)
    else:
        zp = np.clip(np.round(qmin - xmin / s), qmin, qmax).astype(np.int64)
    # x / scale in float32, as compressed-tensors computes it for a float32 weight
    xs = x.astype(np.float32) / s.astype(np.float32)[:, :, None]
    q = np.clip(np.round(xs + zp[:, :, None].astype(np.float32)), qmin, qmax).astype(np.int64)
    q = q.reshape(n, ng * g)[:, :k]
    out = {
        "weight_packed": pack_int32(q, num_bits, axis=1),
        "weight_scale": stored_scale,
        "weight_shape": np.array([n, k], dtype=np.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_int32(zp, num_bits, axis=0)
    return out


def dequantize_pack_quantized(
    tensors, num_bits: int = 4, *, group_size: int | None = None
) -> np.ndarray:
    """pack-quantized tensors -> float32 ``W [N, K]``.

    Symmetric iff there is no ``weight_zero_point``.  ``G`` defaults to
    ``K / weight_scale.shape[1]`` (channel strategy: one group); pass ``group_size`` when that
    does not divide.
    """
    _check_bits(num_bits)
    n, k = (int(v) for v in to_int(tensors["weight_shape"]))
    q = unpack_int32(tensors["weight_packed"], num_bits, k, axis=1)
    if q.shape[0] != n:
        raise ValueError(f"weight_packed has {q.shape[0]} rows, weight_shape says N={n}")
    s = to_f32(tensors["weight_scale"])
    if s.ndim != 2 or s.shape[0] != n:
        raise ValueError(f"weight_scale shape {s.shape} does not fit N={n}")
    ng = s.shape[1]
    if group_size is None:
        if k % ng:
            raise ValueError(f"K={k} is not a multiple of {ng} groups: pass group_size")
        g = k // ng
    else:
        g = int(group_size)
    zp_t = tensors.get("weight_zero_point")
    if zp_t is None:
        zp = np.zeros((n, ng), dtype=np.int64)
    else:
        zp_raw = to_int(zp_t)
        if zp_raw.dtype == np.int32 and zp_raw.shape == (math.ceil(n * num_bits / 32), ng):
            zp = unpack_int32(zp_raw, num_bits, n, axis=0)
        elif zp_raw.shape == (n, ng):  # compressed-tensors < 0.10: unpacked, signed
            zp = zp_raw.astype(np.int64)
        else:
            raise ValueError(
                f"weight_zero_point shape {zp_raw.shape} fits neither packed nor unpacked form"
            )
    cols = np.arange(k) // g
    w = (q - zp[:, cols]).astype(np.float32) * s[:, cols]
    return np.ascontiguousarray(w)


# --------------------------------------------------------------------------------------------
# FP8 (float-quantized)


def _fp8_scale_grid(strategy: str, n: int, k: int, block_size, group_size):
    """(rows per scale row, cols per scale column) for a strategy."""
    if strategy == "tensor":
        return n, k
    if strategy == "channel":
        return 1, k
    if strategy == "group":
        if not group_size:
            raise ValueError("group strategy needs group_size")
        return 1, int(group_size)
    if strategy == "block":
        bn, bk = block_size
        return int(bn), int(bk)
    raise ValueError(f"unsupported FP8 strategy {strategy!r}")


def quantize_fp8(
    w,
    strategy: str = "channel",
    *,
    block_size=(128, 128),
    group_size: int | None = None,
    scale_dtype="float32",
) -> dict:
    """Quantize ``w [N, K]`` to float8_e4m3fn with ``scale = amax / 448`` per
    tensor/channel/group/block.

    Returns ``weight`` (torch float8_e4m3fn) and ``weight_scale`` (numpy float32/float16 or torch
    bfloat16) shaped ``[1]``, ``[N, 1]``, ``[N, ceil(K/G)]`` or ``[ceil(N/bn), ceil(K/bk)]``.
    """
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    rn, ck = _fp8_scale_grid(strategy, n, k, block_size, group_size)
    sr, sc = math.ceil(n / rn), math.ceil(k / ck)
    pad = np.zeros((sr * rn, sc * ck), dtype=np.float64)
    pad[:n, :k] = np.abs(w)
    amax = pad.reshape(sr, rn, sc, ck).max(axis=(1, 3))
    scale = amax / FP8_MAX
    scale = np.where(scale == 0, eps("float32"), scale)
    stored, s = round_up_scale(scale, scale_dtype)
    full = np.repeat(np.repeat(s, rn, axis=0), ck, axis=1)[:n, :k]
    x = np.clip(w.astype(np.float64) / full, -FP8_MAX, FP8_MAX)
    weight = torch.from_numpy(x).to(torch.float8_e4m3fn)
    if strategy == "tensor":
        stored = stored.reshape(1)
    return {"weight": weight, "weight_scale": stored}


def _infer_fp8_strategy(scale_shape, n: int) -> str:
    if int(np.prod(scale_shape, dtype=np.int64)) == 1 and len(scale_shape) <= 1:
        return "tensor"
    if len(scale_shape) == 2 and scale_shape == (n, 1):
        return "channel"
    raise ValueError(f"cannot tell group from block for weight_scale {scale_shape}: pass strategy")


def dequantize_fp8(
    tensors, strategy: str | None = None, *, block_size=(128, 128), group_size: int | None = None
) -> np.ndarray:
    """FP8 tensors -> float32 ``W = weight.float() * scale`` broadcast per strategy.

    ``strategy`` is inferred for tensor (scale ``[1]`` or ``[]``) and channel (``[N, 1]``); group
    and block must be named.  ``weight_scale_inv`` (DeepSeek) is read like ``weight_scale``.
    """
    weight = tensors["weight"]
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn:
        raise TypeError("weight must be a torch float8_e4m3fn tensor")
    wf = to_f32(weight)
    n, k = wf.shape
    s = to_f32(
        tensors["weight_scale"] if "weight_scale" in tensors else tensors["weight_scale_inv"]
    )
    strategy = strategy or _infer_fp8_strategy(tuple(s.shape), n)
    if strategy == "tensor":
        if s.size != 1:
            raise ValueError(f"per-tensor scale has shape {s.shape}")
        return wf * s.reshape(())
    rn, ck = _fp8_scale_grid(strategy, n, k, block_size, group_size)
    if s.ndim != 2:
        raise ValueError(f"{strategy} scale must be 2-D, got {s.shape}")
    if s.shape != (math.ceil(n / rn), math.ceil(k / ck)):
        raise ValueError(f"weight_scale {s.shape} does not fit weight {wf.shape} for {strategy}")
    full = np.repeat(np.repeat(s, rn, axis=0), ck, axis=1)
    return wf * full[:n, :k]
