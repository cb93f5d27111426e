"""A GPTQ v1 dequantizer written from the format's definition, independent of shardload.

    W[n, k] = scales[g_idx[k], n] * (q[k, n] - (z[g_idx[k], n] + 1))

qweight int32 [K/8, N] holds row k at bits 4*(k % 8) of word k // 8; qzeros int32 [K/G, N/8]
holds column n at bits 4*(n % 8) of word n // 8; v1 stores each zero point minus one.
"""

import numpy as np


def unpack_4bit(words: np.ndarray, axis: int) -> np.ndarray:
    """Unpack 8 nibbles per int32 word along ``axis``, least significant first."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    nibbles = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= 8
    return nibbles.reshape(shape)


def dequantize(qweight, qzeros, scales, g_idx) -> np.ndarray:
    """HF-layout float32 weight [N, K]."""
    q = unpack_4bit(np.asarray(qweight), axis=0)  # [K, N]
    z = (unpack_4bit(np.asarray(qzeros), axis=1) + 1) & 0xF  # [K/G, N]; v1 stores z - 1
    g = np.asarray(g_idx).astype(np.int64)
    s = np.asarray(scales).astype(np.float32)
    w = s[g] * (q - z[g]).astype(np.float32)  # [K, N]
    return w.T
