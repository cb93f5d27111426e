"""Dense LSB-first bit streams of unsigned codes in 32-bit words.

Along the packed axis, code ``i`` occupies bits ``[b*i, b*i + b)`` of the stream formed by the
words ``w0, w1, ...`` with ``w0`` the least significant.  For ``b`` in {1, 2, 4, 8} this is
"``32/b`` codes per word, code ``j`` of a word at bit ``b*j``"; for ``b = 3`` 32 codes fill exactly
3 words and codes 10 and 21 straddle a word boundary (bits 30-32 and 63-65), which is the
GPTQ 3-bit layout (AutoGPTQ ``qlinear_cuda_old.pack``: ``v10 << 30`` then ``(v10 >> 2) & 1`` in
the next word, ``v21 << 31`` then ``(v21 >> 1) & 3``) and the dense layout of
compressed-tensors >= 0.20 ``pack_to_int32``.
"""

from __future__ import annotations

import math

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)


def pack_bits(codes, bits: int, axis: int) -> np.ndarray:
    """Pack unsigned ``codes`` (each ``0 <= c < 2**bits``) along ``axis`` into int32 words.

    A length ``L`` along ``axis`` becomes ``ceil(L*bits/32)`` words; missing codes of the last
    word are zero.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    c = np.asarray(codes)
    if c.size and (c.min() < 0 or c.max() >= (1 << bits)):
        raise ValueError(f"codes out of range for {bits}-bit packing")
    c = np.moveaxis(c.astype(np.uint64), axis, -1)
    lead, length = c.shape[:-1], c.shape[-1]
    n_words = math.ceil(length * bits / 32)
    n_blocks = math.ceil(length / 32)  # 32 codes always fill exactly `bits` words
    padded = np.zeros((*lead, n_blocks * 32), dtype=np.uint64)
    padded[..., :length] = c
    blocks = padded.reshape(*lead, n_blocks, 32)
    out = np.zeros((*lead, n_blocks, bits), dtype=np.uint64)
    for j in range(32):
        word, off = divmod(j * bits, 32)
        out[..., word] |= (blocks[..., j] << np.uint64(off)) & _MASK32
        if off + bits > 32:  # the code's high bits spill into the next word
            out[..., word + 1] |= blocks[..., j] >> np.uint64(32 - off)
    out = out.reshape(*lead, n_blocks * bits)[..., :n_words]
    out = out.astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))


def unpack_bits(words, bits: int, axis: int, count: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_bits`: int64 codes, ``count`` of them along ``axis``.

    ``count`` defaults to every code the words can hold (``n_words*32 // bits``).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    w = np.asarray(words)
    if w.dtype not in (np.int32, np.uint32):
        raise TypeError(f"expected int32 words, got {w.dtype}")
    w = np.moveaxis(w.view(np.uint32).astype(np.uint64), axis, -1)
    lead, n_words = w.shape[:-1], w.shape[-1]
    if count is None:
        count = n_words * 32 // bits
    if count * bits > n_words * 32:
        raise ValueError(f"{n_words} words hold fewer than {count} {bits}-bit codes")
    n_blocks = math.ceil(n_words / bits)
    padded = np.zeros((*lead, n_blocks * bits), dtype=np.uint64)
    padded[..., :n_words] = w
    blocks = padded.reshape(*lead, n_blocks, bits)
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((*lead, n_blocks, 32), dtype=np.uint64)
    for j in range(32):
        word, off = divmod(j * bits, 32)
        val = blocks[..., word] >> np.uint64(off)
        if off + bits > 32:
            val = val | (blocks[..., word + 1] << np.uint64(32 - off))
        out[..., j] = val & mask
    out = out.reshape(*lead, n_blocks * 32)[..., :count].astype(np.int64)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis))
