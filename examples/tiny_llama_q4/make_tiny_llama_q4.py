"""Make the embedded example: a tiny Llama-style checkpoint in 4-bit GPTQ layout, and its plan.

    python examples/tiny_llama_q4/make_tiny_llama_q4.py [OUT_DIR]

Deterministic (fixed seed), so re-running it reproduces the committed files byte for byte.
Weights are random and quantized round-to-nearest, per group of 32 input rows, asymmetric,
in AutoGPTQ's v1 layout (``checkpoint_format: "gptq"``, zeros stored minus one):

    qweight int32 [K/8, N]     8 rows of 4 bits per word, LSB first
    qzeros  int32 [K/G, N/8]   8 columns of 4 bits per word, LSB first
    scales  fp16  [K/G, N]
    g_idx   int32 [K]          k // G (no act-order)

The plan (``shard_info.json``) is the one ``shardload plan`` writes for this folder, in
expressions of ``num_shards``, so the one file loads for N in {1, 2, 4, 8}: q/gate/up split
their output columns, k/v split whole KV heads and replicate them when N exceeds the 2 KV heads
(GQA), o/down split their input rows (scales and zeros by group, g_idx rebased), norms and
embeddings replicated.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

from shardload import open_checkpoint
from shardload.planners import plan_for

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
    },
}
BITS, GROUP = 4, 32
PACK = 32 // BITS


def pack_rows(q: np.ndarray) -> np.ndarray:
    """[K, N] 4-bit codes -> [K/8, N] int32, row k at bits 4*(k % 8) of word k // 8."""
    k, n = q.shape
    words = np.zeros((k // PACK, n), dtype=np.uint32)
    for j in range(PACK):
        words |= q[j::PACK].astype(np.uint32) << (BITS * j)
    return words.view(np.int32)


def pack_cols(q: np.ndarray) -> np.ndarray:
    """[R, N] 4-bit codes -> [R, N/8] int32, column n at bits 4*(n % 8) of word n // 8."""
    r, n = q.shape
    words = np.zeros((r, n // PACK), dtype=np.uint32)
    for j in range(PACK):
        words |= q[:, j::PACK].astype(np.uint32) << (BITS * j)
    return words.view(np.int32)


def quantize_gptq(w: np.ndarray) -> dict[str, np.ndarray]:
    """HF weight [N, K] -> GPTQ v1 tensors, round-to-nearest per group of GROUP input rows."""
    wt = w.T.astype(np.float32)  # [K, N]: GPTQ stores K first
    k, n = wt.shape
    groups = wt.reshape(k // GROUP, GROUP, n)
    lo, hi = groups.min(axis=1), groups.max(axis=1)  # [K/G, N]
    scale = ((hi - lo) / (2**BITS - 1)).astype(np.float16)
    scale = np.where(scale == 0, np.float16(1e-3), scale)
    zero = np.clip(np.round(-lo / scale.astype(np.float32)), 0, 2**BITS - 1).astype(np.int64)
    q = np.round(groups / scale.astype(np.float32)[:, None, :]) + zero[:, None, :]
    q = np.clip(q, 0, 2**BITS - 1).astype(np.int64).reshape(k, n)
    return {
        "qweight": pack_rows(q),
        # v1 stores zero - 1; a zero of 0 wraps to 15, exactly as AutoGPTQ's packer does
        "qzeros": pack_cols((zero - 1) & (2**BITS - 1)),
        "scales": scale,
        "g_idx": (np.arange(k) // GROUP).astype(np.int32),
    }


def make_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    c = CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}

    def dense(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float16)

    out["model.embed_tokens.weight"] = dense(c["vocab_size"], h)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (1 + dense(h)).astype(np.float16)
        out[p + "post_attention_layernorm.weight"] = (1 + dense(h)).astype(np.float16)
        shapes = {
            "self_attn.q_proj": (nq * hd, h),
            "self_attn.k_proj": (nkv * hd, h),
            "self_attn.v_proj": (nkv * hd, h),
            "self_attn.o_proj": (h, nq * hd),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        for proj, shape in shapes.items():
            for suffix, tensor in quantize_gptq(dense(*shape)).items():
                out[f"{p}{proj}.{suffix}"] = tensor
    out["model.norm.weight"] = (1 + dense(h)).astype(np.float16)
    out["lm_head.weight"] = dense(c["vocab_size"], h)
    return out


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tensors = make_tensors(np.random.default_rng(0))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(CONFIG)
    quant = config.pop("quantization_config")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": quant}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "quantize_config.json"), "w") as f:
        json.dump(
            {
                "bits": BITS,
                "group_size": GROUP,
                "desc_act": False,
                "sym": False,
                "checkpoint_format": "gptq",
            },
            f,
            indent=2,
        )
        f.write("\n")
    # The plan is what `shardload plan` writes for this folder, from config.json alone.
    with open_checkpoint(out_dir) as ckpt:
        plan_for(ckpt, num_shards=4).dump(os.path.join(out_dir, "shard_info.json"))
    size = sum(t.nbytes for t in tensors.values())
    print(f"wrote {len(tensors)} tensors ({size} bytes) to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
