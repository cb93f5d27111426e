"""Numeric helpers the formats share: packed integer codes, per-group values, FP4 and E8M0.

Integer codes ``q`` are packed LSB first: code ``i`` along the packed axis is bits
``[b*i, b*i + b)`` of the words' concatenation (3-bit codes straddle words). FP4 is E2M1, two
per byte, the even element in the low nibble. Everything is computed in float32: the integer
formats' products (at most 8-bit codes times 16-bit scales) are exact in float32, so the one
rounding, to the caller's dtype at the end, is the one a tool computing in the scale's dtype
makes.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP4_VALUES",
    "columns",
    "fill_word",
    "fp4_values",
    "mxfp4",
    "one_code",
    "scale_groups",
    "unpack_int32",
]

#: E2M1 code -> value; bit 3 is the sign (OCP Microscaling spec v1.0)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def fill_word(code: int, bits: int) -> int | None:
    """The int32 word whose every ``bits``-bit field holds ``code`` (as a signed value), or
    ``None`` for 3-bit codes, which straddle words (no one word repeats).

    >>> hex(fill_word(8, 4) & 0xFFFFFFFF)
    '0x88888888'
    """
    if 32 % bits:
        return None
    word = sum(code << (bits * i) for i in range(32 // bits))
    return word - (1 << 32) if word >= 1 << 31 else word


def one_code(codes: torch.Tensor) -> int | None:
    """The one value every code holds, or ``None`` where they differ (or there are none)."""
    values = torch.unique(codes)
    return int(values[0]) if values.numel() == 1 else None


def unpack_int32(
    words: torch.Tensor, bits: int, dim: int, count: int | None = None
) -> torch.Tensor:
    """The unsigned ``bits``-bit codes packed LSB first along ``dim`` of int32 (or uint32)
    ``words``, as int32: ``count`` of them along ``dim`` (default: all the words hold).

    >>> unpack_int32(torch.tensor([0x76543210], dtype=torch.int32), 4, dim=0)
    tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    """
    if words.dtype == torch.uint32:  # MLC's words; torch shifts only signed ones
        words = words.view(torch.int32)
    if words.dtype != torch.int32 or not 1 <= bits <= 8:
        raise ValueError(f"cannot unpack {bits}-bit codes from {words.dtype} words")
    w = words.movedim(dim, -1)
    room = w.shape[-1] * 32 // bits
    count = room if count is None else count
    if count > room:
        raise ValueError(f"{w.shape[-1]} words hold {room} {bits}-bit codes, not {count}")
    mask = (1 << bits) - 1
    if 32 % bits == 0:  # whole codes per word: shift each word 32/b ways (sign bits masked off)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
        codes = ((w.unsqueeze(-1) >> shifts) & mask).flatten(-2)[..., :count]
    else:  # 3 bits: a code starting at bit `start` may end in the next word: read the pair
        start = torch.arange(count, device=w.device) * bits
        w64 = torch.nn.functional.pad(w.long() & 0xFFFFFFFF, (0, 1))
        pair = w64[..., start // 32] | ((w64[..., start // 32 + 1] & mask) << 32)
        codes = ((pair >> (start % 32)) & mask).int()
    return codes.movedim(-1, dim)


def columns(
    t: torch.Tensor, k: int, group_size: int, g_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-group values ``[..., groups]`` -> one per input column ``[..., k]``: column ``k``
    takes group ``g_idx[k]`` (act-order), or ``k // G``."""
    groups = t.shape[-1]
    if g_idx is None:
        if group_size > 0:
            g = group_size
        elif k % groups == 0:  # -1: the shapes tell (one group when there is one column)
            g = k // groups
        else:
            raise ValueError(f"{groups} scale groups do not divide K={k}: pass group_size")
        if -(-k // g) != groups:
            raise ValueError(
                f"K={k} in groups of {g} is {-(-k // g)} groups, the scales have {groups}"
            )
        g_idx = torch.arange(k, device=t.device) // g
    elif g_idx.shape != (k,):
        raise ValueError(f"g_idx has shape {list(g_idx.shape)}, the weight K={k}")
    return t[..., g_idx.long()]


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes, two per byte along the last axis (the even element in the low nibble) ->
    float32 ``[..., 2 * bytes]``."""
    table = torch.tensor(FP4_VALUES, device=packed.device)
    packed = packed.view(torch.uint8)  # (an int8 view would shift in sign bits)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return table[codes.long()]


def scale_groups(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``values [..., K] * scale [..., K/group]``, each scale on its ``group`` elements."""
    if values.shape[-1] != scale.shape[-1] * group or values.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"a scale per {group} elements: {list(scale.shape)} scales do not fit "
            f"{list(values.shape)} elements"
        )
    return (values.unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2)


def mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 codes times E8M0 scales ``2^(byte - 127)``, one per 32 elements; ``ldexp`` is exact
    (as transformers' ``convert_moe_packed_tensors`` computes it). A zero byte is ``2^-127``,
    not 0: padded blocks are zero through their codes (FP4 code 0 is +0)."""
    values = fp4_values(packed)
    if values.shape[-1] != scale.shape[-1] * 32:
        raise ValueError(
            f"MXFP4 has a scale per 32 elements: {list(scale.shape)} scales do not "
            f"fit {list(values.shape)} elements"
        )
    exponent = scale.to(torch.int32) - 127
    return torch.ldexp(values.unflatten(-1, (-1, 32)), exponent.unsqueeze(-1)).flatten(-2)
