"""Tiny Llama checkpoints in GGUF and in MLC q4f16_1 (8 query heads, 2 KV heads), for the planner
tests: ``write_gguf`` (each linear role quantized to the type asked for, with ``GGUF_LINEARS``
saying how each splits) and ``write_mlc_model`` (one layer, qkv and gate/up fused as MLC stores
them; returns each module's dequantized weight)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from helpers.gguf_blocks import blocks
from helpers.mlc_reference import dequantize_q4f16_1, quantize_q4f16_1, write_mlc_folder

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


GGUF_LINEARS = {
    "attn_q": "q",
    "attn_k": "kv",
    "attn_v": "kv",
    "attn_output": "row",
    "ffn_gate": "mlp",
    "ffn_up": "mlp",
    "ffn_down": "row",
}


def write_gguf(path: str, qtypes: dict[str, T], *, hidden: int, inter: int, layers: int = 1):
    """A Llama GGUF whose linear weights are quantized to ``qtypes[role]`` (F32 norms)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_vocab_size(64)
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, hidden),
        "attn_k": (KV_HEADS * HEAD_DIM, hidden),
        "attn_v": (KV_HEADS * HEAD_DIM, hidden),
        "attn_output": (hidden, HEADS * HEAD_DIM),
        "ffn_gate": (inter, hidden),
        "ffn_up": (inter, hidden),
        "ffn_down": (hidden, inter),
    }
    writer.add_tensor("token_embd.weight", blocks(rng, T.Q8_0, 64, hidden), raw_dtype=T.Q8_0)
    for layer in range(layers):
        writer.add_tensor(
            f"blk.{layer}.attn_norm.weight", rng.standard_normal(hidden).astype(np.float32)
        )
        for name, (rows, cols) in shapes.items():
            qtype = qtypes.get(name, T.Q8_0)
            data = (
                rng.standard_normal((rows, cols)).astype(np.float16)
                if qtype == T.F16
                else blocks(rng, qtype, rows, cols)
            )
            writer.add_tensor(
                f"blk.{layer}.{name}.weight", data, raw_dtype=None if qtype == T.F16 else qtype
            )
    writer.add_tensor("output_norm.weight", rng.standard_normal(hidden).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_mlc_model(folder, *, hidden=256, inter=512, quantization="q4f16_1"):
    """An MLC q4f16_1 Llama layer: fused qkv_proj and gate_up_proj, as MLC stores them."""
    rng = np.random.default_rng(1)
    q, kv = HEADS * 32, KV_HEADS * 32
    linears = {
        "self_attn.qkv_proj": (q + 2 * kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_up_proj": (2 * inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    tensors, full = {}, {}
    for module, shape in linears.items():
        w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        q_weight, q_scale = quantize_q4f16_1(w)
        tensors[f"model.layers.0.{module}.q_weight"] = q_weight
        tensors[f"model.layers.0.{module}.q_scale"] = q_scale
        full[module] = dequantize_q4f16_1(q_weight, q_scale)
    tensors["model.layers.0.input_layernorm.weight"] = np.ones(hidden, np.float16)
    config = {
        "model_type": "llama",
        "quantization": quantization,
        "model_config": {
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": 32,
            "num_hidden_layers": 1,
            "vocab_size": 64,
        },
    }
    write_mlc_folder(folder, tensors, config=config, shard_bytes=64 << 10)
    return full
