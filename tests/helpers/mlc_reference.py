"""MLC-LLM reference code for tests, written from the format definitions, independent of shardload.

* ``write_mlc_folder``: an MLC-LLM weight folder (``tensor-cache.json`` + ``params_shard_*.bin``
  + ``mlc-chat-config.json``) from a dict of arrays, laid out as TVM's
  ``tvm.contrib.tvmjs.dump_tensor_cache`` lays it out, with optional alignment gaps.
* ``quantize_q4f16_1`` / ``dequantize_q4f16_1``: MLC's q4f16_1 group quantization
  (``mlc_llm/quantization/group_quantization.py``, ``GroupQuantize`` with group_size 32, int4
  codes in uint32 words, float16 scales, "NK" layout).

q4f16_1 for a linear weight ``w`` of shape ``[N, K]`` (``N`` outputs, ``K`` inputs)::

    q_weight  uint32  [N, ceil(K/32) * 4]   code of w[n, k] at bits 4*(k % 8) of word k // 8
    q_scale   float16 [N, ceil(K/32)]       one scale per group of 32 along K
    scale = max|w[n, group]| / 7                       (computed in float16)
    code  = clip(round(w / scale + 7), 0, 14)          (symmetric; 7 = 2**(4-1) - 1)
    w'    = (code - 7) * scale[n, k // 32]

Both functions take ``[..., K]`` arrays, grouping along the last axis (embeddings are quantized
the same way).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

try:  # torch is optional here: it is how bfloat16 / float8 arrays are passed in
    import torch
except ImportError:  # pragma: no cover
    torch = None

__all__ = [
    "GROUP_SIZE",
    "MAX_INT",
    "dequantize_q4f16_1",
    "f32_to_bf16_bits",
    "pack_int4",
    "quantize_q4f16_1",
    "unpack_int4",
    "write_mlc_folder",
]

GROUP_SIZE = 32  # q4f16_1 group size along K
MAX_INT = 7  # 2 ** (4 - 1) - 1: the zero point, and the largest |code - zero|
CODES_PER_WORD = 8  # 32-bit storage / 4-bit codes
WORDS_PER_GROUP = GROUP_SIZE // CODES_PER_WORD


# ----------------------------------------------------------------------------------------------
# q4f16_1


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``[..., K]`` (K a multiple of 8) into uint32 words ``[..., K/8]``.

    Code ``k`` goes to bits ``4 * (k % 8)`` of word ``k // 8``: least significant first.
    """
    codes = np.asarray(codes)
    if codes.shape[-1] % CODES_PER_WORD:
        raise ValueError(f"last axis {codes.shape[-1]} is not a multiple of {CODES_PER_WORD}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes must lie in [0, 15]")
    c = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, CODES_PER_WORD)
    shifts = 4 * np.arange(CODES_PER_WORD, dtype=np.uint32)
    return np.bitwise_or.reduce(c << shifts, axis=-1).astype(np.uint32)


def unpack_int4(words: np.ndarray) -> np.ndarray:
    """Unpack uint32 words ``[..., W]`` into 4-bit codes ``[..., 8W]`` (uint8), LSB first."""
    w = np.asarray(words).astype(np.uint32)
    shifts = 4 * np.arange(CODES_PER_WORD, dtype=np.uint32)
    codes = (w[..., None] >> shifts) & np.uint32(0xF)
    return codes.reshape(*w.shape[:-1], -1).astype(np.uint8)


def quantize_q4f16_1(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float weight ``[..., K]`` (``[N, K]`` for a linear layer) to q4f16_1.

    Returns ``(q_weight, q_scale)``: uint32 ``[..., ceil(K/32)*4]`` and float16
    ``[..., ceil(K/32)]``. As MLC does, the weight is first cast to float16 and the scale and the
    codes are computed in float16: ``scale = max|w| / 7`` per group of 32 along the last axis,
    ``code = clip(round(w / scale + 7), 0, 14)`` (round half to even). A K that is not a
    multiple of 32 is padded: the padding's codes are 0, and scales cover the real elements only
    (MLC's ``pack_weight`` and ``_quantize`` do the same). An all-zero group gets scale 0 and
    codes 7 (it dequantizes to 0, as it does in MLC).
    """
    w = np.asarray(w)
    if w.ndim < 1:
        raise ValueError("quantize_q4f16_1 needs at least one axis")
    k = w.shape[-1]
    groups = math.ceil(k / GROUP_SIZE)
    w16 = w.astype(np.float16)
    padded = np.zeros((*w.shape[:-1], groups * GROUP_SIZE), np.float16)
    padded[..., :k] = w16
    g = padded.reshape(*w.shape[:-1], groups, GROUP_SIZE)
    max_abs = np.abs(g).max(axis=-1)  # float16, exact
    scale = (max_abs / np.float16(MAX_INT)).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = (g / scale[..., None]).astype(np.float16) + np.float16(MAX_INT)
    x = np.where(scale[..., None] == 0, np.float16(MAX_INT), x)
    codes = np.clip(np.rint(x), 0, 2 * MAX_INT).astype(np.uint8)
    codes = codes.reshape(*w.shape[:-1], groups * GROUP_SIZE)
    codes[..., k:] = 0  # padding, as MLC packs it
    return pack_int4(codes), scale


def dequantize_q4f16_1(
    q_weight: np.ndarray, q_scale: np.ndarray, k: int | None = None
) -> np.ndarray:
    """``(code - 7) * scale`` as float32 ``[..., K]``; ``K = 8 * words`` unless ``k`` is given.

    ``q_weight`` uint32 ``[..., W]`` (W a multiple of 4: whole groups) and ``q_scale``
    ``[..., W/4]``. The product of a small integer and a float16 is exact in float32; MLC
    computes it in float16, which rounds the same value to float16.
    """
    q_weight, q_scale = np.asarray(q_weight), np.asarray(q_scale)
    words = q_weight.shape[-1]
    if words % WORDS_PER_GROUP:
        raise ValueError(
            f"q_weight has {words} words per row, not whole groups of {WORDS_PER_GROUP}"
        )
    if q_scale.shape != (*q_weight.shape[:-1], words // WORDS_PER_GROUP):
        raise ValueError(
            f"q_scale shape {q_scale.shape} does not match q_weight shape {q_weight.shape}"
        )
    codes = unpack_int4(q_weight).astype(np.float32) - np.float32(MAX_INT)
    scale = np.repeat(q_scale.astype(np.float32), GROUP_SIZE, axis=-1)
    out = codes * scale
    return out if k is None else out[..., :k]


# ----------------------------------------------------------------------------------------------
# the folder writer

# dtype spellings TVM writes
_NUMPY_NAMES = {
    "bool": "bool",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
}
_TORCH_VIEW = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16): round to nearest even, as TVM's dumper does for
    in-range values; values that would round past the largest bfloat16 are truncated instead
    (TVM clips them so), and NaN stays a quiet NaN."""
    bits = np.array(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    truncated = bits >> 16
    finite = np.isfinite(np.asarray(x, dtype=np.float32))
    overflow = finite & ((rounded & 0x7F80) == 0x7F80)
    out = np.where(finite & ~overflow, rounded, truncated)
    out = np.where(np.isnan(x), truncated | 0x40, out)
    return out.astype(np.uint16)


def _as_bytes(name: str, value: Any, encode_format: str) -> tuple[str, list[int], bytes]:
    """(MLC dtype, shape, stored bytes) of a numpy array or torch tensor."""
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype in _TORCH_VIEW:
            shape = list(t.shape)
            return dtype, shape, t.view(getattr(torch, _TORCH_VIEW[dtype])).numpy().tobytes()
        value = t.numpy()
    arr = np.asarray(value)  # (not ascontiguousarray: that makes a 0-d array 1-d)
    if arr.dtype.name not in _NUMPY_NAMES:
        raise TypeError(f"{name}: dtype {arr.dtype} has no MLC spelling")
    dtype = _NUMPY_NAMES[arr.dtype.name]
    if encode_format == "f32-to-bf16" and dtype == "float32":
        return dtype, list(arr.shape), f32_to_bf16_bits(arr).astype("<u2").tobytes()
    return dtype, list(arr.shape), arr.astype(arr.dtype.newbyteorder("<")).tobytes()


def write_mlc_folder(
    folder: str | os.PathLike,
    tensors: Mapping[str, Any],
    *,
    shard_bytes: int = 1 << 20,
    config: dict | None = None,
    align: int = 1,
    pad_byte: int = 0,
    encode_format: str = "raw",
    index_name: str = "tensor-cache.json",
    metadata: dict | None = None,
) -> Path:
    """Write ``tensors`` (name -> numpy array or torch tensor) as an MLC-LLM weight folder.

    Tensors go, in the dict's order, into ``params_shard_0.bin``, ``params_shard_1.bin``, ...:
    a shard is closed when the next tensor would take it past ``shard_bytes``, and a tensor
    bigger than that gets a shard of its own (as TVM's dumper does). Each tensor starts at a
    multiple of ``align`` bytes within its shard; the gap is filled with ``pad_byte`` (pick a
    non-zero one to catch a reader that reads the wrong bytes).

    ``encode_format`` labels every record, as MLC labels them all ``"f32-to-bf16"``; with
    ``"f32-to-bf16"`` float32 tensors are stored as bfloat16 bits (the record keeps dtype
    ``"float32"`` and ``nbytes`` is ``numel * 2``). bfloat16 and float8 tensors are passed as
    torch tensors. ``config`` is written as ``mlc-chat-config.json`` when given; ``metadata``
    is the index's ``metadata`` (default: MLC's ``ParamSize`` / ``ParamBytes``).
    ``index_name`` may be ``"ndarray-cache.json"``, the older name. Shard records carry
    ``md5sum`` as TVM writes it.

    Returns the index file's path.
    """
    if encode_format not in ("raw", "f32-to-bf16"):
        raise ValueError(f"encode_format must be 'raw' or 'f32-to-bf16', not {encode_format!r}")
    if align < 1 or shard_bytes < 1:
        raise ValueError("align and shard_bytes must be positive")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    shards: list[dict] = []
    data = bytearray()
    records: list[dict] = []
    total = 0

    def commit() -> None:
        nonlocal data, records
        if not records:
            return
        path = f"params_shard_{len(shards)}.bin"
        (folder / path).write_bytes(bytes(data))
        shards.append(
            {
                "dataPath": path,
                "format": "raw-shard",
                "nbytes": len(data),
                "records": records,
                "md5sum": hashlib.md5(data).hexdigest(),
            }
        )
        data, records = bytearray(), []

    for name, value in tensors.items():
        dtype, shape, raw = _as_bytes(name, value, encode_format)
        total += len(raw)
        offset = -(-len(data) // align) * align
        if records and offset + len(raw) > shard_bytes:
            commit()
            offset = 0
        data += bytes([pad_byte]) * (offset - len(data))
        data += raw
        records.append(
            {
                "name": name,
                "shape": shape,
                "dtype": dtype,
                "format": encode_format,
                "nbytes": len(raw),
                "byteOffset": offset,
            }
        )
    commit()

    if metadata is None:
        metadata = {"ParamSize": len(tensors), "ParamBytes": float(total)}
    index = folder / index_name
    index.write_text(json.dumps({"metadata": metadata, "records": shards}, indent=2))
    if config is not None:
        (folder / "mlc-chat-config.json").write_text(json.dumps(config, indent=2))
    return index
