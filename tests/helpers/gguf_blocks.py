"""GGUF block data for tests: real quantization where gguf-py has a quantizer, valid random
blocks for the K-quants (gguf-py has no K-quant quantizer); and gguf-py's own dequantizer of
stored data, the reference the GGUF tests compare with (``dequantized``)."""

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

K_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
# K blocks are random bytes with their f16 scales (at these byte offsets in the block) set to
# small finite values, so dequantizing gives finite numbers.
K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def blocks(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
    """A (rows, cols) float matrix quantized to ``qtype``, as gguf-py's uint8 block rows."""
    if qtype not in K_TYPES:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for at in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.001, 0.1, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def dequantized(raw: np.ndarray, qtype: T) -> np.ndarray:
    """Stored GGUF data as float32: F16 / F32 converted, every block type through gguf-py's own
    dequantizer."""
    return raw.astype(np.float32) if qtype in (T.F16, T.F32) else dequantize(raw, qtype)
