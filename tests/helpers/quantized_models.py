"""Tiny Llama / Mixtral checkpoints in every quantized format the planner tests cover: the
model geometries (``GQA``, ``THREE``, ``MQA``, ``WIDE``), the formats (``Format``: how to quantize
a weight into its stored tensors with the reference codecs of ``helpers.quant_refs``, read them
back, and which N fit: ``PLAIN``, ``GPTQ``, ``OTHERS`` and their makers), and ``write_model``,
which writes one (safetensors and config.json) and keeps each module's dequantized full weight.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import save_file

from helpers.quant_refs.awq import dequantize_awq, quantize_awq
from helpers.quant_refs.compressed_tensors import (
    dequantize_fp8,
    dequantize_pack_quantized,
    quantize_fp8,
    quantize_pack_quantized,
)
from helpers.quant_refs.gptq import dequantize_gptq, quantize_gptq

# ---- the model geometries ------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int = 64

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim


GQA = Geometry(hidden=256, heads=8, kv_heads=2, head_dim=32, inter=512)  # N 1, 2, 4, 8
THREE = Geometry(hidden=384, heads=12, kv_heads=3, head_dim=32, inter=768)  # N 1, 3
MQA = Geometry(hidden=256, heads=8, kv_heads=1, head_dim=32, inter=512)  # KV to everyone
WIDE = Geometry(hidden=512, heads=4, kv_heads=2, head_dim=128, inter=1024)  # FP8 blocks


# ---- the formats ---------------------------------------------------------------------------------


@dataclass
class Format:
    """How to quantize a weight into stored tensors, read them back, and which N fit."""

    name: str
    quant_config: dict | None
    quantize: Callable[[np.ndarray], dict]
    dequantize: Callable[[dict], np.ndarray]
    # logical elements that must stay together along N (column split) and K (row split)
    n_align: int = 1
    k_align: int = 1
    extra_config: dict = field(default_factory=dict)


def _fp16(w):
    return {"weight": torch.from_numpy(w).to(torch.float16)}


def _bf16(w):
    return {"weight": torch.from_numpy(w).to(torch.bfloat16)}


def _plain(t):
    return torch.as_tensor(t["weight"]).float().numpy()


def gptq(
    bits: int, group: int, version: int = 1, act_order: bool = False, sym: bool = False
) -> Format:
    pack_rows = {2: 16, 3: 32, 4: 8, 8: 4}[bits]

    def quantize(w):
        perm = np.random.default_rng(w.shape[1]).permutation(w.shape[1]) if act_order else None
        return quantize_gptq(w, bits, group, sym=sym, version=version, perm=perm)

    fmt = "gptq" if version == 1 else "gptq_v2"
    # K splits keep packed rows whole, and whole groups unless act-order replicates the scales
    k_align = pack_rows if (act_order or group == -1) else math.lcm(pack_rows, group)
    return Format(
        f"gptq{bits}-g{group}-v{version}{'-act' if act_order else ''}{'-sym' if sym else ''}",
        {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": fmt,
        },
        quantize,
        lambda t: dequantize_gptq(t, bits, version),
        n_align=pack_rows,
        k_align=k_align,
    )  # qzeros pack N like qweight packs K


def awq(group: int) -> Format:
    return Format(
        f"awq-g{group}",
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "version": "gemm",
            "zero_point": True,
        },
        lambda w: quantize_awq(w, group),
        lambda t: dequantize_awq(t, group),
        n_align=8,
        k_align=1 if group == -1 else group,
    )  # -1: one group, replicated


def pack_quantized(bits: int, group: int | None, symmetric: bool) -> Format:
    strategy = "group" if group else "channel"
    pf = 32 // bits
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": strategy,
        "group_size": group,
    }
    return Format(
        f"ct-int{bits}-{strategy}{group or ''}-{'sym' if symmetric else 'asym'}",
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        },
        lambda w: quantize_pack_quantized(
            w, bits, strategy=strategy, group_size=group, symmetric=symmetric
        ),
        lambda t: dequantize_pack_quantized(t, bits),
        n_align=1 if symmetric else pf,  # zero points are packed along N
        k_align=math.lcm(pf, group or 1),
    )


def ct_act_order(bits: int = 4, group: int = 32) -> Format:
    """compressed-tensors pack-quantized with ``actorder: group``: each input column's group
    given by ``weight_g_idx`` (a permutation of ``k // group``), made and read with the
    library's own functions, each column given its group's scale and zero point."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, symmetric=False, strategy="group", group_size=group)
    column = QuantizationArgs(num_bits=bits, symmetric=False, strategy="group", group_size=1)

    def quantize_(w):
        w = torch.from_numpy(w)
        n, k = w.shape
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))] = (
            torch.arange(k, dtype=torch.int32) // group
        )
        lo = torch.stack([w[:, g_idx == j].amin(1) for j in range(k // group)], 1)
        hi = torch.stack([w[:, g_idx == j].amax(1) for j in range(k // group)], 1)
        scale, zero = calculate_qparams(lo, hi, args)
        cols = g_idx.long()
        codes = quantize(w, scale[:, cols], zero[:, cols], column, dtype=torch.int8)
        return {
            "weight_packed": pack_to_int32(codes, bits),
            "weight_scale": scale,
            "weight_zero_point": pack_to_int32(zero, bits, packed_dim=0),
            "weight_g_idx": g_idx,
            "weight_shape": torch.tensor([n, k]),
        }

    def dequantize_(t):
        t = {k: torch.as_tensor(v) for k, v in t.items()}
        shape = torch.Size(t["weight_shape"].tolist())
        codes = unpack_from_int32(t["weight_packed"], bits, shape)
        zero = unpack_from_int32(
            t["weight_zero_point"],
            bits,
            torch.Size([shape[0], t["weight_scale"].shape[1]]),
            packed_dim=0,
        )
        cols = t["weight_g_idx"].long()
        return dequantize(
            codes, t["weight_scale"][:, cols], zero[:, cols], column, dtype=torch.float32
        ).numpy()

    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": group,
        "actorder": "group",
    }
    return Format(
        f"ct-int{bits}-g{group}-act-order",
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        },
        quantize_,
        dequantize_,
        n_align=32 // bits,
        k_align=32 // bits,
    )


def fp8(strategy: str) -> Format:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    align = 128 if strategy == "block" else 1
    return Format(
        f"fp8-{strategy}",
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        },
        lambda w: quantize_fp8(w, strategy),
        lambda t: dequantize_fp8(t, strategy),
        n_align=align,
        k_align=align,
    )


PLAIN = [Format("fp16", None, _fp16, _plain), Format("bf16", None, _bf16, _plain)]
GPTQ = (
    [gptq(bits, 32) for bits in (2, 3, 4, 8)]
    + [gptq(4, -1), gptq(3, -1)]
    + [gptq(4, 32, version=2), gptq(8, 32, version=2)]
    + [gptq(4, 32, act_order=True), gptq(3, 32, act_order=True), gptq(2, 32, act_order=True)]
)
OTHERS = [
    awq(32),
    awq(-1),
    pack_quantized(4, 32, True),
    pack_quantized(4, 32, False),
    pack_quantized(8, None, True),
    fp8("tensor"),
    fp8("channel"),
]


# ---- writing a checkpoint ------------------------------------------------------------------------

ROLES_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def linear_shapes(g: Geometry, fused: bool) -> dict[str, tuple[int, int]]:
    """HF module name (in layer 0) -> logical weight [N_out, K_in]."""
    if fused:
        return {
            "self_attn.qkv_proj": (g.q + 2 * g.kv, g.hidden),
            "self_attn.o_proj": (g.hidden, g.q),
            "mlp.gate_up_proj": (2 * g.inter, g.hidden),
            "mlp.down_proj": (g.hidden, g.inter),
        }
    return {
        "self_attn.q_proj": (g.q, g.hidden),
        "self_attn.k_proj": (g.kv, g.hidden),
        "self_attn.v_proj": (g.kv, g.hidden),
        "self_attn.o_proj": (g.hidden, g.q),
        "mlp.gate_proj": (g.inter, g.hidden),
        "mlp.up_proj": (g.inter, g.hidden),
        "mlp.down_proj": (g.hidden, g.inter),
    }


def moe_shapes(g: Geometry, experts: int) -> dict[str, tuple[int, int]]:
    shapes = {
        "self_attn.q_proj": (g.q, g.hidden),
        "self_attn.k_proj": (g.kv, g.hidden),
        "self_attn.v_proj": (g.kv, g.hidden),
        "self_attn.o_proj": (g.hidden, g.q),
    }
    for e in range(experts):
        shapes[f"block_sparse_moe.experts.{e}.w1"] = (g.inter, g.hidden)
        shapes[f"block_sparse_moe.experts.{e}.w3"] = (g.inter, g.hidden)
        shapes[f"block_sparse_moe.experts.{e}.w2"] = (g.hidden, g.inter)
    return shapes


@dataclass
class Model:
    folder: str
    geometry: Geometry
    fmt: Format
    shapes: dict[str, tuple[int, int]]
    full: dict[str, np.ndarray]  # module -> dequantized full weight


def write_model(folder: str, g: Geometry, fmt: Format, *, fused=False, experts=0) -> Model:
    rng = np.random.default_rng(0)
    shapes = moe_shapes(g, experts) if experts else linear_shapes(g, fused)
    tensors: dict[str, torch.Tensor] = {}
    full = {}
    for module, (n, k) in shapes.items():
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        stored = fmt.quantize(w)
        full[module] = fmt.dequantize(stored)
        for suffix, value in stored.items():
            t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
            tensors[f"model.layers.0.{module}.{suffix}"] = t.contiguous()
    half = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float16))  # noqa: E731
    tensors["model.embed_tokens.weight"] = half(g.vocab, g.hidden)
    tensors["lm_head.weight"] = half(g.vocab, g.hidden)
    tensors["model.norm.weight"] = half(g.hidden)
    tensors["model.layers.0.input_layernorm.weight"] = half(g.hidden)
    if experts:
        tensors["model.layers.0.block_sparse_moe.gate.weight"] = half(experts, g.hidden)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {
        "model_type": "mixtral" if experts else "llama",
        "hidden_size": g.hidden,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "intermediate_size": g.inter,
        "num_hidden_layers": 1,
        "vocab_size": g.vocab,
    }
    if experts:
        config["num_local_experts"] = experts
    if fmt.quant_config:
        config["quantization_config"] = fmt.quant_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return Model(folder, g, fmt, shapes, full)
