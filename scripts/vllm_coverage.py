#!/usr/bin/env python
"""Which tensor-parallel sizes vLLM runs the checkpoints people serve at: with its own loader,
and with shardload's (``--load-format shardload``), at the checkpoints' real shapes.

For each checkpoint in ``MODELS`` (its published ``config.json``) the script writes a
header-only safetensors checkpoint into a temporary folder: the tensor names, shapes and dtypes
the published checkpoint has, its data a sparse hole (nothing is downloaded, no disk is used)
but for the few tensors the planner reads (GPTQ ``g_idx``, compressed-tensors
``weight_shape``), which hold their real values. Then, for each N in ``TP``:

* **vLLM's own loader**: vLLM's alignment checks, restated here from its source
  (``vllm_refusal``: one function per check, each citing the vLLM file and function it comes
  from; vLLM 0.32 on CUDA, its default ``--moe-backend auto``);
* **shardload**: ``shardload.vllm.padding.vllm_overrides(folder, N)``: ``{}`` runs as it is, a
  dict runs zero-padded with those ``--hf-overrides`` (and the padded sizes are put through
  vLLM's checks again, since vLLM builds and checks the padded model), a ``PlanError`` refuses;
  where shardload's own planner (``plan_decision``) decides otherwise, the cell says so.

Usage::

    python scripts/vllm_coverage.py            # print the section
    python scripts/vllm_coverage.py --write    # rewrite it in docs/vllm.md (between the markers)
    python scripts/vllm_coverage.py --check    # exit 1 with a diff if docs/vllm.md is stale
    python scripts/vllm_coverage.py --model Qwen/Qwen3-30B-A3B-FP8 --tp 4   # some cells only
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "vllm.md")
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"
TP = (2, 3, 4, 6, 8, 16)

# ---- the checkpoints: each its published config.json (the fields that shape its tensors) -----

_AWQ = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 128,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}
_QWEN_GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "damp_percent": 0.01,
    "static_groups": False,
    "true_sequential": True,
}
_QWEN_FP8 = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def _ct(weights: dict, fmt: str, input_activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config with one scheme for every Linear but lm_head."""
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": input_activations,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


_QWEN25_72B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=8192,
    intermediate_size=29696,  # Qwen's own quantized 72B: zero-padded from 29568
    num_attention_heads=64,
    num_key_value_heads=8,
    num_hidden_layers=80,
    vocab_size=152064,
    tie_word_embeddings=False,
    torch_dtype="float16",
)
_LLAMA_70B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_key_value_heads=8,
    num_hidden_layers=80,
    vocab_size=128256,
    tie_word_embeddings=False,
)

MODELS: list[dict[str, Any]] = [
    dict(name="Qwen/Qwen2.5-72B-Instruct-AWQ", config=dict(_QWEN25_72B, quantization_config=_AWQ)),
    dict(
        name="Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4",
        config=dict(_QWEN25_72B, quantization_config=_QWEN_GPTQ),
    ),
    dict(
        name="Qwen/Qwen2.5-7B-Instruct-AWQ",
        config=dict(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            num_hidden_layers=28,
            vocab_size=152064,
            tie_word_embeddings=False,
            torch_dtype="float16",
            quantization_config=_AWQ,
        ),
    ),
    dict(
        name="Qwen/Qwen3-32B-AWQ",
        config=dict(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            hidden_size=5120,
            intermediate_size=25600,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            num_hidden_layers=64,
            vocab_size=151936,
            tie_word_embeddings=False,
            torch_dtype="float16",
            quantization_config=_AWQ,
        ),
    ),
    dict(
        name="Qwen/Qwen3-30B-A3B-FP8",
        config=dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=48,
            vocab_size=151936,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            quantization_config=_QWEN_FP8,
        ),
    ),
    dict(
        name="Qwen/Qwen3-235B-A22B-FP8",
        config=dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=94,
            vocab_size=151936,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            quantization_config=_QWEN_FP8,
        ),
    ),
    dict(
        name="deepseek-ai/DeepSeek-V3",
        mtp_layers=1,  # num_nextn_predict_layers: layer 61 (multi-token prediction) is stored too
        config=dict(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            moe_layer_freq=1,
            n_group=8,
            topk_group=4,
            num_attention_heads=128,
            num_key_value_heads=128,
            num_hidden_layers=61,
            num_nextn_predict_layers=1,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            vocab_size=129280,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            quantization_config={
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
        ),
    ),
    dict(
        name="RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic",
        config=dict(
            _LLAMA_70B,
            torch_dtype="bfloat16",
            quantization_config=_ct(
                {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": "minmax",
                },
                "float-quantized",
                {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                    "group_size": None,
                    "block_structure": None,
                    "actorder": None,
                    "observer": None,
                },
            ),
        ),
    ),
    dict(
        name="casperhansen/llama-3.3-70b-instruct-awq",
        config=dict(_LLAMA_70B, torch_dtype="float16", quantization_config=_AWQ),
    ),
    dict(
        name="RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
        config=dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            vocab_size=128256,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            quantization_config=_ct(
                {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                    "dynamic": False,
                    "actorder": None,
                    "block_structure": None,
                    "observer": "minmax",
                },
                "pack-quantized",
            ),
        ),
    ),
    dict(
        name="TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ",
        config=dict(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            vocab_size=32000,
            tie_word_embeddings=False,
            torch_dtype="float16",
            # its main branch: 4-bit, act-order, no group size
            quantization_config={
                "quant_method": "gptq",
                "bits": 4,
                "group_size": -1,
                "desc_act": True,
                "sym": True,
                "damp_percent": 0.1,
                "true_sequential": True,
            },
        ),
    ),
    dict(
        name="openai/gpt-oss-120b",
        config=dict(
            architectures=["GptOssForCausalLM"],
            model_type="gpt_oss",
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=128,
            num_experts_per_tok=4,
            experts_per_token=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_hidden_layers=36,
            vocab_size=201088,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            sliding_window=128,
            swiglu_limit=7.0,
            layer_types=["sliding_attention", "full_attention"] * 18,
            quantization_config={
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            },
        ),
    ),
]

# ---- the tensors each architecture stores --------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """A linear layer ``y = x W^T``, ``W`` [n, k], stored in the checkpoint's format unless
    ``quantized`` is False (routers, lm_head, what the config leaves unconverted)."""

    name: str
    n: int
    k: int
    quantized: bool = True
    bias: bool = False


# An architecture yields its Linear layers and its plain tensors, ``(name, shape, dtype)``
# (dtype ``"act"``: the model's torch_dtype), in the order the checkpoint stores them.


def _attention(
    c: dict,
    p: str,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    quantized: bool = True,
) -> Iterator:
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    a = p + ".self_attn"
    yield Linear(a + ".q_proj", heads * d, h, quantized, qkv_bias)
    yield Linear(a + ".k_proj", kv * d, h, quantized, qkv_bias)
    yield Linear(a + ".v_proj", kv * d, h, quantized, qkv_bias)
    yield Linear(a + ".o_proj", h, heads * d, quantized, o_bias)
    if qk_norm:
        yield (a + ".q_norm.weight", [d], "act")
        yield (a + ".k_norm.weight", [d], "act")


def _mla(c: dict, p: str) -> Iterator:
    """DeepSeek's multi-head latent attention (q through a q_lora latent)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora, a = c["q_lora_rank"], c["kv_lora_rank"], p + ".self_attn"
    yield Linear(a + ".q_a_proj", q_lora, h)
    yield (a + ".q_a_layernorm.weight", [q_lora], "act")
    yield Linear(a + ".q_b_proj", heads * (nope + rope), q_lora)
    yield Linear(a + ".kv_a_proj_with_mqa", kv_lora + rope, h)
    yield (a + ".kv_a_layernorm.weight", [kv_lora], "act")
    yield Linear(a + ".kv_b_proj", heads * (nope + v), kv_lora)
    yield Linear(a + ".o_proj", h, heads * v)


def _gated_mlp(p: str, h: int, width: int, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    yield Linear(f"{p}.{gate}", width, h)
    yield Linear(f"{p}.{up}", width, h)
    yield Linear(f"{p}.{down}", h, width)


def _norms(p: str, h: int) -> Iterator:
    yield (p + ".input_layernorm.weight", [h], "act")
    yield (p + ".post_attention_layernorm.weight", [h], "act")


def _ends(c: dict, prefix: str = "model") -> Iterator:
    v, h = c["vocab_size"], c["hidden_size"]
    yield (f"{prefix}.embed_tokens.weight", [v, h], "act")
    yield (f"{prefix}.norm.weight", [h], "act")
    if not c.get("tie_word_embeddings"):
        yield Linear("lm_head", v, h, quantized=False)


def llama_like(c: dict) -> Iterator:
    """llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms)."""
    t = c["model_type"]
    yield from _ends(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, c["hidden_size"])
        yield from _attention(c, p, qkv_bias=t == "qwen2", qk_norm=t == "qwen3")
        yield from _gated_mlp(p + ".mlp", c["hidden_size"], c["intermediate_size"])


def qwen3_moe(c: dict) -> Iterator:
    h, e, w = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    yield from _ends(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(c, p, qk_norm=True)
        yield Linear(p + ".mlp.gate", e, h, quantized=False)
        for j in range(e):
            yield from _gated_mlp(f"{p}.mlp.experts.{j}", h, w)


def mixtral(c: dict) -> Iterator:
    h, e, w = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    yield from _ends(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(c, p)
        yield Linear(p + ".block_sparse_moe.gate", e, h, quantized=False)
        for j in range(e):
            yield from _gated_mlp(f"{p}.block_sparse_moe.experts.{j}", h, w, ("w1", "w3", "w2"))


def _deepseek_layer(c: dict, i: int) -> Iterator:
    h, e, w = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
    p = f"model.layers.{i}"
    yield from _norms(p, h)
    yield from _mla(c, p)
    if i < c["first_k_dense_replace"]:
        yield from _gated_mlp(p + ".mlp", h, c["intermediate_size"])
        return
    yield Linear(p + ".mlp.gate", e, h, quantized=False)
    yield (p + ".mlp.gate.e_score_correction_bias", [e], "F32")
    for j in range(e):
        yield from _gated_mlp(f"{p}.mlp.experts.{j}", h, w)
    yield from _gated_mlp(p + ".mlp.shared_experts", h, w * c["n_shared_experts"])


def deepseek_v3(c: dict) -> Iterator:
    h, v = c["hidden_size"], c["vocab_size"]
    yield from _ends(c)
    for i in range(c["num_hidden_layers"]):
        yield from _deepseek_layer(c, i)
    # multi-token prediction layers, stored after the model's own (vLLM's deepseek_mtp.py
    # builds them; its main model skips them): a whole MoE layer, its own embedding and head
    for i in range(c["num_hidden_layers"], c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}"
        yield (p + ".embed_tokens.weight", [v, h], "act")
        yield (p + ".enorm.weight", [h], "act")
        yield (p + ".hnorm.weight", [h], "act")
        yield Linear(p + ".eh_proj", h, 2 * h, quantized=False)
        yield (p + ".shared_head.norm.weight", [h], "act")
        yield Linear(p + ".shared_head.head", v, h, quantized=False)
        yield from _deepseek_layer(c, i)


def gpt_oss(c: dict) -> Iterator:
    """gpt-oss as published: attention (with biases and sinks) and the router unquantized, each
    layer's experts fused in MXFP4: ``*_blocks`` [E, rows, K/32, 16] bytes, ``*_scales``
    [E, rows, K/32] exponents, biases [E, rows]; gate_up rows interleave gate and up."""
    h, e, w = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    yield from _ends(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _norms(p, h)
        yield from _attention(c, p, qkv_bias=True, o_bias=True, quantized=False)
        yield (p + ".self_attn.sinks", [c["num_attention_heads"]], "act")
        yield Linear(p + ".mlp.router", e, h, quantized=False, bias=True)
        x = p + ".mlp.experts"
        for name, rows, k in (("gate_up_proj", 2 * w, h), ("down_proj", h, w)):
            yield (f"{x}.{name}_blocks", [e, rows, k // 32, 16], "U8")
            yield (f"{x}.{name}_scales", [e, rows, k // 32], "U8")
            yield (f"{x}.{name}_bias", [e, rows], "act")


ARCHITECTURES = {
    "llama": llama_like,
    "qwen2": llama_like,
    "qwen3": llama_like,
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}

# ---- how each format stores one linear layer -----------------------------------------------------


def _groups(k: int, group: int) -> int:
    return 1 if group == -1 else -(-k // group)


def gptq(linear: Linear, q: dict) -> Iterator:
    """AutoGPTQ: qweight int32 [K*b/32, N], qzeros [K/G, N*b/32], scales fp16 [K/G, N], g_idx
    [K] (each row's group: trivial ``k // G`` without act-order, all 0 with one group)."""
    bits, g = q["bits"], q["group_size"]
    yield (linear.name + ".qweight", [linear.k * bits // 32, linear.n], "I32")
    yield (linear.name + ".qzeros", [_groups(linear.k, g), linear.n * bits // 32], "I32")
    yield (linear.name + ".scales", [_groups(linear.k, g), linear.n], "F16")
    rows = np.arange(linear.k, dtype=np.int32)
    yield (linear.name + ".g_idx", [linear.k], "I32", rows // g if g != -1 else rows * 0)


def awq(linear: Linear, q: dict) -> Iterator:
    """AutoAWQ GEMM: qweight int32 [K, N/8], qzeros [K/G, N/8], scales fp16 [K/G, N]."""
    g = q["group_size"]
    yield (linear.name + ".qweight", [linear.k, linear.n // 8], "I32")
    yield (linear.name + ".qzeros", [_groups(linear.k, g), linear.n // 8], "I32")
    yield (linear.name + ".scales", [_groups(linear.k, g), linear.n], "F16")


def fp8_block(linear: Linear, q: dict) -> Iterator:
    """HF / DeepSeek FP8: weight e4m3 [N, K], weight_scale_inv fp32 per block."""
    bn, bk = q["weight_block_size"]
    yield (linear.name + ".weight", [linear.n, linear.k], "F8_E4M3")
    yield (linear.name + ".weight_scale_inv", [-(-linear.n // bn), -(-linear.k // bk)], "F32")


def compressed_tensors(linear: Linear, q: dict) -> Iterator:
    """float-quantized (FP8 per channel) or pack-quantized (int4 in int32 words, per group)."""
    w = q["config_groups"]["group_0"]["weights"]
    if q["format"] == "float-quantized":
        yield (linear.name + ".weight", [linear.n, linear.k], "F8_E4M3")
        yield (linear.name + ".weight_scale", [linear.n, 1], "BF16")
        return
    pack = 32 // w["num_bits"]
    yield (linear.name + ".weight_packed", [linear.n, linear.k // pack], "I32")
    yield (linear.name + ".weight_scale", [linear.n, _groups(linear.k, w["group_size"])], "BF16")
    yield (
        linear.name + ".weight_shape",
        [2],
        "I64",
        np.array([linear.n, linear.k], dtype=np.int64),
    )


def unquantized(linear: Linear, q: dict) -> Iterator:
    yield (linear.name + ".weight", [linear.n, linear.k], "act")


FORMATS = {
    "gptq": gptq,
    "awq": awq,
    "fp8": fp8_block,
    "compressed-tensors": compressed_tensors,
    "mxfp4": unquantized,
}  # gpt-oss: its quantized experts are the architecture's own
DTYPES = {"float16": "F16", "bfloat16": "BF16"}
BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1}


def _parts(t, store, q: dict) -> Iterator[tuple]:
    """What the checkpoint stores of ``t``: a linear layer in its format (unquantized where it
    is not quantized) and its bias; a plain tensor as it is."""
    if not isinstance(t, Linear):
        yield t
        return
    yield from (store if t.quantized else unquantized)(t, q)
    if t.bias:
        yield (t.name + ".bias", [t.n], "act")


def stored_tensors(config: dict) -> Iterator[tuple]:
    """(name, shape, dtype[, values]) of every tensor the checkpoint stores, in order."""
    q = config["quantization_config"]
    store, act = FORMATS[q["quant_method"]], DTYPES[config["torch_dtype"]]
    for t in ARCHITECTURES[config["model_type"]](config):
        for name, shape, dtype, *values in _parts(t, store, q):
            yield (name, shape, act if dtype == "act" else dtype, *values)


# ---- writing it: headers, real bytes where the planner reads them, holes elsewhere -----------

#: how much tensor data one file holds at most, as Hugging Face's save_pretrained shards (5 GB);
#: a published checkpoint of this size is such a folder, and a single file larger than memory
#: could not be mapped copy-on-write here
SHARD_BYTES = 5 * 10**9


def _write_file(path: str, tensors: list[tuple]) -> None:
    """One safetensors file: the header, then the data as a hole, but for the given values."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, size, _ in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, *_, values in tensors:
            if values is not None:
                f.seek(8 + len(blob) + header[name]["data_offsets"][0])
                f.write(values.astype(values.dtype.newbyteorder("<")).tobytes())
        f.truncate(8 + len(blob) + offset)


def write_checkpoint(model: dict, folder: str) -> int:
    """``folder/config.json`` and the checkpoint's tensors, header-only (sparse files: only the
    headers and the tensors given values take disk), in files of at most ``SHARD_BYTES`` with
    ``model.safetensors.index.json``. Returns the number of tensors."""
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model["config"], f, indent=2)
    files: list[list[tuple]] = [[]]
    held = 0
    for name, shape, dtype, *values in stored_tensors(model["config"]):
        size = math.prod(shape) * BYTES[dtype]
        if held and held + size > SHARD_BYTES:
            files.append([])
            held = 0
        files[-1].append((name, shape, dtype, size, values[0] if values else None))
        held += size
    weight_map = {}
    for i, tensors in enumerate(files, 1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        _write_file(os.path.join(folder, file), tensors)
        weight_map.update((t[0], file) for t in tensors)
    total = sum(t[3] for tensors in files for t in tensors)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return len(weight_map)


# ---- vLLM's own checks, restated (vLLM 0.32, CUDA) -------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What vLLM's checks read of a config."""

    heads: int
    kv_heads: int | None  # None: latent attention (MLA), no KV heads to split
    head_dim: int  # a query head's width (MLA: nope + rope)
    o_head_dim: int  # o_proj's K per head (MLA: v_head_dim)
    hidden: int
    dense: tuple[int, ...]  # widths of dense (and shared-expert) MLPs
    experts: int  # one routed expert's width (0: none)
    quant: dict
    method: str
    mla_heads: tuple[int, ...] = ()  # MLA's per-head widths of its column-parallel q_b/kv_b


def shape_of(c: dict) -> Shape:
    t, q = c["model_type"], c["quantization_config"]
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if t == "deepseek_v3":
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        dense = (c["intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"])
        return Shape(
            heads,
            None,
            nope + rope,
            v,
            h,
            dense,
            c["moe_intermediate_size"],
            q,
            q["quant_method"],
            (nope + rope, nope + v),
        )
    d = c.get("head_dim") or h // heads
    experts = {
        "qwen3_moe": c.get("moe_intermediate_size", 0),
        "mixtral": c["intermediate_size"],
        "gpt_oss": c["intermediate_size"],
    }.get(t, 0)
    dense = () if experts else (c["intermediate_size"],)
    return Shape(heads, c["num_key_value_heads"], d, d, h, dense, experts, q, q["quant_method"])


def _wna16(s: Shape) -> tuple[int, int] | None:
    """(group, pack factor) of an int4/int8 weight-only scheme (GPTQ, AWQ, compressed-tensors
    pack-quantized), else None."""
    q = s.quant
    if s.method in ("gptq", "awq"):
        return q["group_size"], 32 // q["bits"]
    if s.method == "compressed-tensors" and q["format"] == "pack-quantized":
        w = q["config_groups"]["group_0"]["weights"]
        return (w["group_size"] if w["strategy"] == "group" else -1), 32 // w["num_bits"]
    return None


def _row_parallel_k(s: Shape, tp: int) -> list[tuple[str, int]]:
    """Each row-parallel layer's K on one rank."""
    return [("o_proj", s.heads * s.o_head_dim // tp)] + [("down_proj", w // tp) for w in s.dense]


def check_heads(s: Shape, tp: int):
    # vllm/config/model.py ModelConfig.verify_with_parallel_config: "Total number of attention
    # heads (...) must be divisible by tensor parallel size (...)"
    if s.heads % tp:
        return "heads", f"{s.heads} attention heads do not divide by {tp}"


def check_kv_heads(s: Shape, tp: int):
    # vllm/model_executor/layers/linear.py QKVParallelLinear.__init__: divide(tp, kv) when
    # tp >= kv (each KV head replicated), else divide(kv, tp); MLA has no KV heads to split
    if s.kv_heads and (tp % s.kv_heads if tp >= s.kv_heads else s.kv_heads % tp):
        return "KV heads", f"{s.kv_heads} KV heads neither divide nor are divided by {tp}"


def check_dense_mlp(s: Shape, tp: int):
    # vllm/model_executor/layers/linear.py MergedColumnParallelLinear / RowParallelLinear:
    # divide(output_size, tp) and divide(input_size, tp)
    for w in s.dense:
        if w % tp:
            return "MLP", f"an MLP {w} wide does not divide by {tp}"


def check_gptq_act_order(s: Shape, tp: int):
    # vllm/model_executor/layers/quantization/utils/gptq_utils.py
    # normalize_and_validate_gptq_desc_act: desc_act with groups is refused at every N ("no
    # longer supported"); with one group (group_size -1) it is a no-op and dropped
    if s.method == "gptq" and s.quant.get("desc_act") and s.quant["group_size"] != -1:
        return "act-order", "GPTQ desc_act with groups: vLLM refuses it at every N"


def check_wna16_linear(s: Shape, tp: int):
    # vllm/model_executor/kernels/linear/mixed_precision/marlin.py MarlinLinearKernel
    # .can_implement: "A group straddling TP ranks cannot be fixed by padding" (a row-parallel
    # layer's K on a rank % group_size; a misaligned tile is zero-padded at weight prep). AWQ's
    # fallback, quantization/auto_awq.py AutoAWQLinearMethod.create_weights, refuses the same
    # ("The input size is not aligned with the quantized weight shape") and an output width on
    # a rank that is not a whole number of packed words ("The output size is not aligned ...")
    found = _wna16(s)
    if found is None:
        return None
    group, pack = found
    for layer, k in _row_parallel_k(s, tp):
        if group != -1 and group < k * tp and k % group:
            return "groups", f"{layer}'s K on a rank, {k}, is not a whole number of {group}-groups"
    kv = s.kv_heads or s.heads
    qkv = (s.heads + 2 * max(kv, tp)) // tp * s.head_dim
    for layer, n in [("qkv_proj", qkv)] + [("gate_up_proj", 2 * w // tp) for w in s.dense]:
        if n % pack:
            return "packing", f"{layer}'s N on a rank, {n}, is not a whole number of {pack}-packs"


def check_wna16_experts(s: Shape, tp: int):
    # quantization/utils/marlin_utils.py check_moe_marlin_supports_config (tile padding
    # allowed): an expert's width on a rank % group_size, else quantization/moe_wna16.py
    # MoeWNA16Method.create_weights halves the group until it divides that width and hidden,
    # asserting group >= 32; fused_moe/config.py takes the width on a rank as width // tp
    found = _wna16(s)
    if found is None or not s.experts:
        return None
    group, w = found[0], s.experts // tp
    if group == -1 or w % group == 0:
        return None
    while w % group or s.hidden % group:
        group //= 2
        if group < 32:
            return "groups", (
                f"an expert's {w} rows on a rank split its {found[0]}-groups below 32"
            )


def check_fp8_block_linear(s: Shape, tp: int):
    # vllm/model_executor/layers/quantization/utils/fp8_utils.py validate_fp8_block_shape (from
    # fp8.py Fp8LinearMethod.create_weights): a row-parallel layer's K on a rank % block_k, a
    # column-parallel layer's N on a rank % block_n; merged layers (qkv_proj, gate_up_proj) whose
    # parts are not whole blocks are let through (linear.py ColumnParallelLinear
    # ._maybe_allow_fp8_block_shape_mismatch), so only unmerged ones count: MLA's q_b/kv_b_proj
    if s.method != "fp8":
        return None
    bn, bk = s.quant["weight_block_size"]
    for layer, k in _row_parallel_k(s, tp):
        if k % bk:
            return "blocks", f"{layer}'s K on a rank, {k}, is not a whole number of {bk}-blocks"
    for layer, width in zip(("q_b_proj", "kv_b_proj"), s.mla_heads):
        if s.heads // tp * width % bn:
            return "blocks", (
                f"{layer}'s N on a rank, {s.heads // tp * width}, is not a whole "
                f"number of {bn}-blocks"
            )


def check_fp8_block_experts(s: Shape, tp: int):
    # vllm/model_executor/layers/fused_moe/oracle/fp8.py refine_fp8_moe_block_shape: where an
    # expert's width on a rank is not whole blocks, the scales are refined to blocks of
    # gcd(block_n, block_k, width on a rank, hidden) if that is >= 32 (Triton kernels), else
    # quantization/utils/fp8_utils.py validate_fp8_block_shape_moe refuses
    if s.method != "fp8" or not s.experts:
        return None
    bn, bk = s.quant["weight_block_size"]
    w = s.experts // tp
    if w % bn == 0 and w % bk == 0:
        return None
    refined = math.gcd(bn, bk, w, s.hidden)
    if refined < 32:
        return "blocks", (
            f"an expert's {w} rows on a rank are not whole {bn}-blocks, and "
            f"vLLM refines blocks only down to 32 (gcd {refined})"
        )


#: vLLM's checks that refuse, in the order vLLM meets them
CHECKS = (
    check_heads,
    check_kv_heads,
    check_dense_mlp,
    check_gptq_act_order,
    check_wna16_linear,
    check_wna16_experts,
    check_fp8_block_linear,
    check_fp8_block_experts,
)


def vllm_refusal(config: dict, tp: int) -> tuple[str, str] | None:
    """(short, why) of the first of vLLM's checks that refuses ``config`` at ``tp``, or None."""
    s = shape_of(config)
    for check in CHECKS:
        found = check(s, tp)
        if found:
            return found
    return None


def vllm_note(config: dict, tp: int) -> str | None:
    """What vLLM does itself to run ``config`` at ``tp`` (not a refusal), if anything."""
    s = shape_of(config)
    w = s.experts // tp if s.experts else 0
    if s.method == "fp8" and w and w % s.quant["weight_block_size"][0]:
        # fused_moe/oracle/fp8.py refine_fp8_moe_block_shape
        b = math.gcd(*s.quant["weight_block_size"], w, s.hidden)
        return f"vLLM refines the experts' FP8 scale blocks to {b}x{b} ({w} rows a rank)"
    if s.method == "mxfp4" and w % 32:
        # models/gpt_oss.py GptOssModel._load_weights_mxfp4: cdiv(width / 32, tp) blocks a rank
        per = -(-s.experts // 32 // tp) * 32
        return (
            f"vLLM pads the MXFP4 experts itself: {per} rows a rank (of {w}), the last ranks fewer"
        )
    return None


# ---- shardload's verdict -------------------------------------------------------------------------


def _apply(config: dict, overrides: dict) -> dict:
    out = dict(config)
    for key, value in overrides.items():
        out[key] = _apply(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _reason(exc: Exception, folder: str, name: str) -> str:
    """An error's reason for people: the checkpoint by its name, not the temporary folder, and
    without the list of N that work (the table's row says that)."""
    from shardload import PlanError

    why = exc.reason if isinstance(exc, PlanError) else f"{type(exc).__name__}: {exc}"
    why = why.replace(folder, name)
    return why.split("; N that work")[0].split(". N that work")[0].split("; no N from")[0]


def shardload_verdict(folder: str, name: str, config: dict, tp: int) -> dict:
    """What ``vllm_overrides`` says for the checkpoint in ``folder`` at ``tp``: ``kind`` (as is,
    padded or refused), the overrides or the reason, vLLM's checks on the overridden config
    (vLLM builds and checks the padded model), and ``own``, ``plan_decision``'s kind."""
    from shardload import open_checkpoint

    with open_checkpoint(folder) as ckpt:  # its headers read once for both
        return _verdict(ckpt, folder, name, config, tp)


def _verdict(ckpt, folder: str, name: str, config: dict, tp: int) -> dict:
    from shardload import PlanError, ShardloadError
    from shardload.planners import plan_decision
    from shardload.vllm.padding import vllm_overrides

    try:
        own = plan_decision(ckpt, tp).kind
    except ShardloadError as exc:  # an error in the checkpoint's metadata, not a refusal
        return {"kind": "refused", "why": _reason(exc, folder, name), "own": "error"}
    try:
        overrides = vllm_overrides(ckpt, tp)
    except ShardloadError as exc:
        kind = "refused" if isinstance(exc, PlanError) else "error"
        return {"kind": kind, "why": _reason(exc, folder, name), "own": own}
    return {
        "kind": "padded" if overrides else "as is",
        "overrides": overrides,
        "own": own,
        "vllm": vllm_refusal(_apply(config, overrides), tp),
    }


def _one_cell(index: int, tp: int, root: str) -> tuple[int, int, int, dict, float]:
    """(model index, N, tensor count, shardload's verdict, seconds): one checkpoint asked about
    one N (a task of the process pool). Each worker process writes a checkpoint once, into a
    folder of its own under ``root``, and asks it about every N it is given."""
    model = MODELS[index]
    start = time.perf_counter()
    folder = os.path.join(root, f"{index}-{os.getpid()}")
    counted = folder + ".count"
    if not os.path.exists(counted):
        os.makedirs(folder)
        count = write_checkpoint(model, folder)
        with open(counted, "w") as f:
            f.write(str(count))
    with open(counted) as f:
        count = int(f.read())
    verdict = shardload_verdict(folder, model["name"], model["config"], tp)
    return index, tp, count, verdict, time.perf_counter() - start


def evaluate(names: list[str], tps, jobs: int, log=lambda *a: None) -> list[tuple]:
    """(model, tensor count, {N: shardload's verdict}) for each model named, the cells computed
    ``jobs`` at a time in worker processes."""
    from concurrent.futures import ProcessPoolExecutor

    indices = [i for i, m in enumerate(MODELS) if m["name"] in names]
    counts: dict[int, int] = {}
    verdicts: dict[int, dict[int, dict]] = {i: {} for i in indices}
    with (
        tempfile.TemporaryDirectory(prefix="vllm-coverage-") as root,
        ProcessPoolExecutor(max_workers=jobs) as pool,
    ):
        futures = [pool.submit(_one_cell, i, n, root) for i in indices for n in tps]
        for future in futures:
            i, n, count, verdict, seconds = future.result()
            counts[i], verdicts[i][n] = count, verdict
            log(
                f"{MODELS[i]['name']} ({count:,} tensors) N={n}: {verdict['kind']} "
                f"({seconds:.1f} s)"
            )
    return [(MODELS[i], counts[i], verdicts[i]) for i in indices]


# ---- the table -----------------------------------------------------------------------------------


class Notes:
    """Footnotes, numbered in order of first use, each text once."""

    def __init__(self):
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"


def vllm_cell(config: dict, tp: int, notes: Notes) -> str:
    refusal, note = vllm_refusal(config, tp), vllm_note(config, tp)
    if refusal:
        return f"vLLM ✗ {refusal[0]} {notes.ref(refusal[1])}"
    return "vLLM ✓" + (f" {notes.ref(note)}" if note else "")


def shardload_cell(verdict: dict, notes: Notes) -> str:
    if verdict["kind"] in ("refused", "error"):
        text = f"shardload ✗ {notes.ref(verdict['why'])}"
    elif verdict["kind"] == "padded":
        text = f"shardload padded {notes.ref('--hf-overrides ' + json.dumps(verdict['overrides']))}"
    else:
        text = "shardload as is"
    if verdict.get("vllm"):
        text += f", vLLM still ✗ {verdict['vllm'][0]} {notes.ref(verdict['vllm'][1])}"
    said = {"as is": "unpadded"}.get(verdict["kind"], verdict["kind"])
    if verdict["own"] != said:
        text += f" (own planner: {verdict['own']})"
    return text


def render(rows: list[tuple]) -> str:
    notes = Notes()
    lines = [
        "| checkpoint | tensors | " + " | ".join(f"TP={n}" for n in TP) + " |",
        "|---|---:|" + "---|" * len(TP),
    ]
    for model, count, verdicts in rows:
        cells = [
            f"{vllm_cell(model['config'], n, notes)} · {shardload_cell(verdicts[n], notes)}"
            for n in TP
        ]
        lines.append(f"| {model['name']} | {count:,} | " + " | ".join(cells) + " |")
    foot = [f"{i}. {text}" for i, text in enumerate(notes.texts, 1)]
    return "\n".join(lines + ["", LEGEND, ""] + foot)


LEGEND = (
    "vLLM ✓ / ✗: what vLLM's own checks allow with its default loader (in a word why "
    "not; the footnote gives the sizes). shardload: `as is` (its plan for N pads nothing: "
    "vLLM runs it unchanged), `padded` (zero-padded exactly: run vLLM with the footnote's "
    "`--hf-overrides`), ✗ (refused; the footnote is `vllm_overrides`' reason). `vLLM "
    "still ✗`: vLLM's checks refuse the padded model too. `own planner`: what "
    "`plan_decision` decides for shardload's own loader, where it differs."
)


def section(rows: list[tuple]) -> str:
    return f"{BEGIN}\n{render(rows)}\n{END}"


def replace_section(text: str, new: str) -> str:
    head, found, rest = text.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} section")
    return head + new + rest.partition(END)[2]


# ---- reading the table back (for the tests' quick checks) ----------------------------------------


def read_section(text: str) -> tuple[dict[str, tuple[int, list[str]]], list[str]]:
    """The section's rows ({checkpoint: (tensors, [cell for each N])}) and its footnotes."""
    body = text.partition(BEGIN)[2].partition(END)[0]
    rows, notes = {}, []
    for line in body.splitlines():
        if line.startswith("| ") and not line.startswith("| checkpoint"):
            name, count, *cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[name] = (int(count.replace(",", "")), cells)
        elif line[:1].isdigit() and ". " in line:
            notes.append(line.partition(". ")[2])
    return rows, notes


def expand(cell: str, notes: list[str]) -> str:
    """A cell with each footnote mark replaced by its text: comparable across tables."""
    for i in range(len(notes), 0, -1):
        cell = cell.replace(f"[{i}]", f"[{notes[i - 1]}]")
    return cell


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the section in docs/vllm.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/vllm.md is stale")
    parser.add_argument("--model", action="append", help="only this checkpoint (repeatable)")
    parser.add_argument("--tp", type=int, action="append", help="only this N (repeatable)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="cells computed at once (worker processes; default: CPU count)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    if (args.model or args.tp) and (args.write or args.check):
        parser.error("--write and --check need every checkpoint and every N")
    names = args.model or [m["name"] for m in MODELS]
    unknown = sorted(set(names) - {m["name"] for m in MODELS})
    if unknown:
        parser.error(f"unknown checkpoint {unknown[0]!r}")
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    start = time.perf_counter()
    rows = evaluate(names, args.tp or TP, args.jobs, log)
    log(f"{time.perf_counter() - start:.0f} s")
    if args.model or args.tp:
        for model, _, verdicts in rows:
            for n, verdict in verdicts.items():
                notes = Notes()
                cell = f"{vllm_cell(model['config'], n, notes)} · {shardload_cell(verdict, notes)}"
                print(f"{model['name']} TP={n}: {expand(cell, notes.texts)}")
        return 0
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    fresh = replace_section(text, section(rows))
    if args.write:
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(fresh)
    elif args.check and fresh != text:
        sys.stdout.writelines(
            difflib.unified_diff(
                text.splitlines(True),
                fresh.splitlines(True),
                "docs/vllm.md (as it is)",
                "docs/vllm.md (as generated)",
            )
        )
        print("docs/vllm.md is stale: run python scripts/vllm_coverage.py --write")
        return 1
    elif not args.check:
        print(section(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
