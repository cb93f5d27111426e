"""Dense weights from the stored tensors of one quantized linear module.

``dequantize_module(method, parts)`` turns what a checkpoint stores for ONE module into the
parameters transformers' own module holds. ``parts`` may be the whole tensors or one worker's
pieces of them: the layouts are the same, only smaller. Each format in one line (``W`` is
``[N, K]``, out x in; ``_scale`` is ``weight_scale``; docs/quant_formats.md has the details):

=============== ===============================================================================
method          stored -> dense
=============== ===============================================================================
none            weight (gpt-oss: gate_up_proj, down_proj) as stored
gptq            qweight [K*b/32, N], qzeros [K/G, N*b/32], scales [K/G, N], g_idx [K]: (q-z[g])*s[g]
awq             qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]: W^T = (q - z) * s
pack-quantized  weight_packed [N, K*b/32], _scale [N, K/G], _zero_point [N*b/32, K/G]: (q - zp) * s
int-quantized   weight int8 [N, K], _scale [1] | [N, 1] | [N, K/G], _zero_point: (q - zp) * s
nvfp4           weight_packed u8 [N, K/2], _scale e4m3 [N, K/16], _global_scale [1]: fp4 * (s / g)
mxfp4           weight_packed u8 [N, K/2], _scale e8m0 [N, K/32]: fp4 * 2^(e - 127)
modelopt-nvfp4  weight u8 [N, K/2], _scale e4m3 [N, K/16], _scale_2 []: fp4 * (s * s2)
fp8             weight e4m3 [N, K], _scale(_inv) [] | [1] | [N, 1] | [N/bn, K/bk] blocks: w * s
gguf            weight u8 [rows, row bytes] of ggml blocks: gguf-py's dequantize, [rows, K]
mlc             q_weight u32 [N, K/8], q_scale f16 [N, K/32]: (q - 7) * s
=============== ===============================================================================

Integer codes ``q`` are packed LSB first: code ``i`` along the packed axis is bits
``[b*i, b*i + b)`` of the words' concatenation (3-bit codes straddle words). GPTQ: ``g =
g_idx[k]`` (``k // G`` without it), v1 stores ``z - 1`` wrapped to b bits. AWQ's nibbles hold
columns 0 2 4 6 1 3 5 7. pack-quantized's codes and zero points are stored plus ``2^(b-1)``.
FP4 is E2M1, two per byte, the even element in the low nibble; nvfp4's global scale ``g`` is
stored as a reciprocal and divides ``s`` first. gpt-oss's fused MXFP4 experts, ``*_blocks``
[E, rows, K/32, 16] and ``*_scales`` [E, rows, K/32], come out as transformers holds them,
``[E, K, rows]``.

Everything is computed in float32 and cast to ``dtype`` once at the end: the integer formats'
products (at most 8-bit codes times 16-bit scales) are exact in float32, so that one rounding is
the one a tool computing in the scale's dtype makes. A module a quantized checkpoint keeps in
float (an lm_head) passes through.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import torch

__all__ = ["dequantize_module", "unpack_int32", "METHODS"]

METHODS = ("none", "gptq", "awq", "pack-quantized", "int-quantized", "nvfp4", "mxfp4",
           "modelopt-nvfp4", "fp8", "gguf", "mlc")

#: E2M1 code -> value; bit 3 is the sign (OCP Microscaling spec v1.0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: AWQ GEMM packs columns 0 2 4 6 1 3 5 7 into nibbles 0..7: column j is nibble REVERSE[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
#: tensors of activation (or KV-cache) quantization stored beside a weight: not the weight's
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale",
                    "k_scale", "v_scale")
#: what each method reads, besides ``bias``
_PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                       "weight_shape"),
    "int-quantized": ("weight", "weight_scale", "weight_zero_point"),
    "nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
    "mxfp4": ("weight_packed", "weight_scale"),
    "modelopt-nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "fp8": ("weight", "weight_scale", "weight_scale_inv"),
    "gguf": ("weight",),
    "mlc": ("q_weight", "q_scale"),
}
_GPT_OSS = ("gate_up_proj", "down_proj")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dequantize_module(method: str, parts: Mapping[str, torch.Tensor], *, bits: int = 4,
                      group_size: int = -1, gptq_version: int = 1,
                      block: tuple[int, int] = (128, 128),
                      ggml_types: Optional[Mapping[str, str]] = None,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The dense parameters of one module from its stored ``parts`` (suffix -> tensor; numpy
    arrays are taken too).

    Returns ``{"weight": [N, K]}`` (plus ``"bias"``, cast to ``dtype``); for gpt-oss's fused
    experts ``{"gate_up_proj": [E, H, 2I], "down_proj": [E, I, H]}`` and their biases.
    ``bits``, ``group_size`` and ``gptq_version`` are the checkpoint's (gptq, awq,
    pack-quantized, int-quantized; ``group_size`` -1: taken from the shapes, one group when the
    scales have one column); ``block`` is FP8's scale block; ``ggml_types`` the GGUF type name
    of each part (``{"weight": "Q4_K"}``). Activation scales (``input_scale``, ...) are ignored;
    any other unknown part is an error, never silently dropped.

    >>> qweight = torch.tensor([[0x76543210]], dtype=torch.int32)  # codes 0..7 along K, N = 1
    >>> qzeros = torch.tensor([[0x3]], dtype=torch.int32)          # GPTQ v1 stores z - 1
    >>> scales = torch.tensor([[0.5]], dtype=torch.float16)
    >>> dequantize_module("gptq", {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    {'weight': tensor([[-2.0000, -1.5000, -1.0000, -0.5000,  0.0000,  0.5000,  1.0000,  1.5000]])}
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; known: {', '.join(METHODS)}")
    parts = {name: torch.as_tensor(t) for name, t in parts.items()}
    # a float module in a quantized checkpoint (lm_head, an ignored layer), or method "none"
    if method == "none" or _is_dense(parts):
        return {name: t.to(dtype) if t.is_floating_point() else t for name, t in parts.items()}
    if method == "mxfp4" and any(name.startswith(_GPT_OSS) for name in parts):
        return _gpt_oss_experts(parts, dtype)

    _check_parts(method, parts, _PARTS[method])
    if method == "gptq":
        w = _gptq(parts, bits, group_size, gptq_version)
    elif method == "awq":
        w = _awq(parts, group_size)
    elif method == "pack-quantized":
        w = _pack_quantized(parts, bits, group_size)
    elif method == "int-quantized":
        w = _int_quantized(parts, group_size)
    elif method == "nvfp4":
        w = _nvfp4(parts)
    elif method == "mxfp4":
        w = _mxfp4(_need(parts, "weight_packed"), _need(parts, "weight_scale"))
    elif method == "modelopt-nvfp4":
        w = _modelopt_nvfp4(parts)
    elif method == "fp8":
        w = _fp8(parts, block, group_size)
    elif method == "gguf":
        w = _gguf(_need(parts, "weight"), (ggml_types or {}).get("weight"))
    else:
        w = _mlc(parts)
    out = {"weight": w.to(dtype).contiguous()}
    if "bias" in parts:
        out["bias"] = parts["bias"].to(dtype)
    return out


# ---- shared pieces -------------------------------------------------------------------------

def unpack_int32(words: torch.Tensor, bits: int, dim: int,
                 count: Optional[int] = None) -> torch.Tensor:
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


def _columns(t: torch.Tensor, k: int, group_size: int,
             g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
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
            raise ValueError(f"K={k} in groups of {g} is {-(-k // g)} groups, the scales "
                             f"have {groups}")
        g_idx = torch.arange(k, device=t.device) // g
    elif g_idx.shape != (k,):
        raise ValueError(f"g_idx has shape {list(g_idx.shape)}, the weight K={k}")
    return t[..., g_idx.long()]


def _fp4(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes, two per byte along the last axis (the even element in the low nibble) ->
    float32 ``[..., 2 * bytes]``."""
    table = torch.tensor(FP4_VALUES, device=packed.device)
    packed = packed.view(torch.uint8)  # (an int8 view would shift in sign bits)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return table[codes.long()]


def _scale_groups(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``values [..., K] * scale [..., K/group]``, each scale on its ``group`` elements."""
    if values.shape[-1] != scale.shape[-1] * group or values.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"a scale per {group} elements: {list(scale.shape)} scales do not fit "
                         f"{list(values.shape)} elements")
    return (values.unflatten(-1, (-1, group)) * scale.unsqueeze(-1)).flatten(-2)


def _mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 codes times E8M0 scales ``2^(byte - 127)``, one per 32 elements; ``ldexp`` is exact
    (as transformers' ``convert_moe_packed_tensors`` computes it). A zero byte is ``2^-127``,
    not 0: padded blocks are zero through their codes (FP4 code 0 is +0)."""
    values = _fp4(packed)
    if values.shape[-1] != scale.shape[-1] * 32:
        raise ValueError(f"MXFP4 has a scale per 32 elements: {list(scale.shape)} scales do not "
                         f"fit {list(values.shape)} elements")
    exponent = scale.to(torch.int32) - 127
    return torch.ldexp(values.unflatten(-1, (-1, 32)), exponent.unsqueeze(-1)).flatten(-2)


# ---- the formats ---------------------------------------------------------------------------

def _gptq(parts, bits: int, group_size: int, version: int) -> torch.Tensor:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ has 2, 3, 4 or 8 bits, not {bits}")
    if version not in (1, 2):
        raise ValueError(f"gptq_version is 1 (AutoGPTQ, zeros stored minus one) or 2, not "
                         f"{version}")
    s = _need(parts, "scales").float().t()                              # [N, groups]
    q = unpack_int32(_need(parts, "qweight"), bits, dim=0).t()          # [N, K]
    z = unpack_int32(_need(parts, "qzeros"), bits, dim=1, count=s.shape[0]).t()
    if version == 1:
        # v1 stores z - 1, wrapped to b bits: an all-ones field is z = 0 (GPTQModel's reading)
        z = (z + 1) & ((1 << bits) - 1)
    if q.shape[0] != s.shape[0] or z.shape != s.shape:
        raise ValueError(f"qweight, qzeros and scales disagree: N={q.shape[0]}, zeros "
                         f"{list(z.shape)}, scales {list(s.shape)} (as [N, groups])")
    k, g_idx = q.shape[1], parts.get("g_idx")
    return (q - _columns(z, k, group_size, g_idx)).float() * _columns(s, k, group_size, g_idx)


def _awq(parts, group_size: int) -> torch.Tensor:
    def unpack(words):  # [rows, N/8] -> [N, rows], nibbles put back in column order
        codes = unpack_int32(words, 4, dim=1).unflatten(1, (-1, 8))
        return codes[..., list(AWQ_REVERSE_ORDER)].flatten(1).t()

    q, z = unpack(_need(parts, "qweight")), unpack(_need(parts, "qzeros"))
    s = _need(parts, "scales").float().t()
    k = q.shape[1]
    return (q - _columns(z, k, group_size)).float() * _columns(s, k, group_size)


def _pack_quantized(parts, bits: int, group_size: int) -> torch.Tensor:
    offset = 1 << (bits - 1)  # codes (and zero points) are stored + 2^(b-1), as unsigned
    packed, s = _need(parts, "weight_packed"), _need(parts, "weight_scale").float()
    n, k = packed.shape[0], packed.shape[1] * 32 // bits
    if "weight_shape" in parts:  # the true K: the last word may be part padding
        shape = [int(v) for v in parts["weight_shape"].tolist()]
        if len(shape) != 2 or shape[0] != n:
            raise ValueError(f"weight_shape {shape} does not fit weight_packed "
                             f"{list(packed.shape)}")
        k = shape[1]
    g_idx = parts.get("weight_g_idx")
    q = unpack_int32(packed, bits, dim=1, count=k) - offset
    if "weight_zero_point" in parts:  # asymmetric
        zp = unpack_int32(parts["weight_zero_point"], bits, dim=0, count=n) - offset
        q = q - _columns(zp, k, group_size, g_idx)
    return q.float() * _columns(s, k, group_size, g_idx)


def _int_quantized(parts, group_size: int) -> torch.Tensor:
    q, s = _need(parts, "weight").to(torch.int32), _need(parts, "weight_scale").float()
    zp = parts.get("weight_zero_point", torch.zeros((), dtype=torch.int32))
    if s.numel() > 1 and s.shape[-1] > 1:  # per group: one scale column per group of K
        s = _columns(s, q.shape[-1], group_size)
        zp = _columns(zp, q.shape[-1], group_size) if zp.numel() > 1 else zp
    elif s.numel() == 1:  # per tensor, [] or [1]
        s, zp = s.reshape(()), zp.reshape(())
    return (q - zp.to(torch.int32)).float() * s


def _nvfp4(parts) -> torch.Tensor:
    # compressed-tensors' order: the E4M3 scale divided by the (reciprocal) global scale in
    # float32 first, then the codes times that; so results match it bit for bit
    global_scale = _need(parts, "weight_global_scale").float()
    if global_scale.numel() != 1:
        raise ValueError(f"weight_global_scale has {global_scale.numel()} values; one per "
                         "module is stored")
    scale = _need(parts, "weight_scale").float() / global_scale.reshape(())
    return _scale_groups(_fp4(_need(parts, "weight_packed")), scale, 16)


def _modelopt_nvfp4(parts) -> torch.Tensor:
    # ModelOpt's order (NVFP4QTensor.dequantize): E4M3 scale times weight_scale_2, then codes
    scale_2 = _need(parts, "weight_scale_2").float()
    scale = _need(parts, "weight_scale").float() * scale_2.reshape(())
    return _scale_groups(_fp4(_need(parts, "weight")), scale, 16)


def _fp8(parts, block: tuple[int, int], group_size: int) -> torch.Tensor:
    w = _need(parts, "weight").float()
    if ("weight_scale" in parts) == ("weight_scale_inv" in parts):
        raise ValueError("an FP8 weight needs one of weight_scale and weight_scale_inv (both "
                         "mean W = w * s)")
    s = parts.get("weight_scale", parts.get("weight_scale_inv")).float()
    n, k = w.shape[-2:]
    if s.numel() == 1:  # per tensor
        return w * s.reshape(())
    if s.shape[-2:] == (n, 1):  # per channel
        return w * s
    bn, bk = (1, group_size) if group_size > 0 else block  # per group, else per block
    if s.shape[-2:] != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"FP8 scale {list(s.shape)} is neither per tensor, per channel nor "
                         f"per {bn}x{bk} block of a {n}x{k} weight")
    # each scale over its block; edge blocks may be partial, so expand and trim
    return w * s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


def _gguf(weight: torch.Tensor, ggml_type) -> torch.Tensor:
    if ggml_type is None:
        raise ValueError("a GGUF weight of raw blocks needs its ggml type: "
                         "ggml_types={'weight': 'Q4_K'}")
    from gguf import GGMLQuantizationType  # only GGUF checkpoints need gguf-py
    from gguf.quants import dequantize

    qtype = (GGMLQuantizationType[ggml_type] if isinstance(ggml_type, str)
             else GGMLQuantizationType(ggml_type))
    values = dequantize(weight.cpu().numpy(), qtype)  # ggml rows are HF rows: [.., N, K]
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(weight.device)


def _mlc(parts) -> torch.Tensor:
    # q4f16_1: symmetric around 7 (= 2^(4-1) - 1, MLC's max_int_value), groups of 32 along K
    q = unpack_int32(_need(parts, "q_weight"), 4, dim=-1)
    s = _need(parts, "q_scale").float()
    return _scale_groups((q - 7).float(), s, 32)


def _gpt_oss_experts(parts, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """gpt-oss's fused MXFP4 experts -> transformers' in-memory ``[E, K, rows]`` (``x @ W``):
    ``gate_up_proj`` ``[E, H, 2I]`` (gate and up interleaved, as stored), ``down_proj``
    ``[E, I, H]``; biases (``[E, rows]``) pass through."""
    _check_parts("mxfp4", parts, [p + s for p in _GPT_OSS for s in ("", "_blocks", "_scales",
                                                                     "_bias")])
    out = {}
    for p in _GPT_OSS:
        if f"{p}_blocks" in parts:
            blocks, scales = parts[f"{p}_blocks"], _need(parts, f"{p}_scales")
            if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
                raise ValueError(f"{p}_blocks {list(blocks.shape)} and {p}_scales "
                                 f"{list(scales.shape)} are not [E, rows, K/32, 16] and "
                                 "[E, rows, K/32]")
            w = _mxfp4(blocks.flatten(-2), scales)                  # [E, rows, K]
            out[p] = w.transpose(-1, -2).to(dtype).contiguous()     # [E, K, rows]
        elif p in parts:  # the bf16 experts of an unquantized gpt-oss
            out[p] = parts[p].to(dtype)
        if f"{p}_bias" in parts:
            out[f"{p}_bias"] = parts[f"{p}_bias"].to(dtype)
    return out


# ---- checks --------------------------------------------------------------------------------

def _is_dense(parts) -> bool:
    """Only a float ``weight`` (and ``bias``): a module the checkpoint did not quantize."""
    w = parts.get("weight")
    return w is not None and w.dtype in _FLOATS and set(parts) <= {"weight", "bias"}


def _check_parts(method: str, parts, known) -> None:
    """A part nobody reads would be silently lost: refuse it (activation scales excepted)."""
    unknown = sorted(set(parts) - set(known) - set(ACTIVATION_PARTS) - {"bias"})
    if unknown:
        raise ValueError(f"{method}: unknown parts {unknown} (this format stores "
                         f"{', '.join(known)}, bias)")


def _need(parts, name: str) -> torch.Tensor:
    if name not in parts:
        raise ValueError(f"missing part {name!r} (got {', '.join(sorted(parts)) or 'none'})")
    return parts[name]
