"""A tiny gpt-oss GGUF as llama.cpp's converter writes it (``general.architecture`` ``gpt-oss``),
written with gguf-py's own ``GGUFWriter``: every tensor gguf-py lists for ``MODEL_ARCH.GPT_OSS``
under gguf-py's names, the stacked experts in MXFP4, everything else F16 / F32, with how each
tensor splits under tensor parallelism (``TOP``, ``BLOCK_TENSORS``, ``tensors()``) and the keys
``GptOssModel`` writes (``write_gpt_oss``)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES
from gguf.quants import quantize

ARCH = "gpt-oss"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
EXPERTS, INTER, LAYERS, VOCAB, CONTEXT = 4, 96, 2, 96, 256
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
BLOCK, BLOCK_BYTES = gguf.GGML_QUANT_SIZES[T.MXFP4]  # 32 elements in 17 bytes
GROUPS = INTER // BLOCK  # the experts' 96 rows: 3 blocks

# how each tensor splits under tensor parallelism: q / kv (rows in whole query / KV heads), o
# (columns in whole query heads), sinks (one per query head), exp_rows (dim 1 of [E, inter,
# ...]), exp_k (dim 2 of [E, hidden, inter]), rep (replicated)
TOP = {
    "TOKEN_EMBD": [("weight", (VOCAB, HIDDEN), T.F16, "rep")],
    "OUTPUT_NORM": [("weight", (HIDDEN,), T.F32, "rep")],
    "OUTPUT": [("weight", (VOCAB, HIDDEN), T.F16, "rep")],
}
BLOCK_TENSORS = {
    "ATTN_NORM": [("weight", (HIDDEN,), T.F32, "rep")],
    "ATTN_POST_NORM": [("weight", (HIDDEN,), T.F32, "rep")],
    "ATTN_Q": [("weight", (Q, HIDDEN), T.F16, "q"), ("bias", (Q,), T.F32, "q")],
    "ATTN_K": [("weight", (KV, HIDDEN), T.F16, "kv"), ("bias", (KV,), T.F32, "kv")],
    "ATTN_V": [("weight", (KV, HIDDEN), T.F16, "kv"), ("bias", (KV,), T.F32, "kv")],
    # the bias is added once, after the row-parallel sum
    "ATTN_OUT": [("weight", (HIDDEN, Q), T.F16, "o"), ("bias", (HIDDEN,), T.F32, "rep")],
    "ATTN_SINKS": [("weight", (HEADS,), T.F32, "sinks")],
    "FFN_GATE_INP": [
        ("weight", (EXPERTS, HIDDEN), T.F32, "rep"),
        ("bias", (EXPERTS,), T.F32, "rep"),
    ],
    "FFN_GATE_EXP": [
        ("weight", (EXPERTS, INTER, HIDDEN), T.MXFP4, "exp_rows"),
        ("bias", (EXPERTS, INTER), T.F32, "exp_rows"),
    ],
    "FFN_UP_EXP": [
        ("weight", (EXPERTS, INTER, HIDDEN), T.MXFP4, "exp_rows"),
        ("bias", (EXPERTS, INTER), T.F32, "exp_rows"),
    ],
    "FFN_DOWN_EXP": [
        ("weight", (EXPERTS, HIDDEN, INTER), T.MXFP4, "exp_k"),
        ("bias", (EXPERTS, HIDDEN), T.F32, "rep"),
    ],
}
EXP_KINDS = ("FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP")


def gguf_name(kind: str, bid: int = 0) -> str:
    """gguf-py's name for a gpt-oss tensor, checked to be one it lists for the architecture."""
    tensor = MODEL_TENSOR[kind]
    assert tensor in MODEL_TENSORS[MODEL_ARCH.GPT_OSS], f"gguf-py lists no gpt-oss {kind}"
    return TENSOR_NAMES[tensor].format(bid=bid)


def tensors() -> dict[str, tuple[tuple[int, ...], T, str]]:
    """Every tensor of the test model: name -> (numpy shape, ggml type, split)."""
    out = {}
    for kind, parts in TOP.items():
        for suffix, shape, qtype, split in parts:
            out[f"{gguf_name(kind)}.{suffix}"] = shape, qtype, split
    for bid in range(LAYERS):
        for kind, parts in BLOCK_TENSORS.items():
            for suffix, shape, qtype, split in parts:
                out[f"{gguf_name(kind, bid)}.{suffix}"] = shape, qtype, split
    return out


def write_gpt_oss(path: str) -> None:
    """The tiny model, with the keys llama.cpp's converter writes for gpt-oss (``TextModel``'s
    and ``GptOssModel.set_gguf_parameters``')."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)  # gpt-oss's intermediate_size: the experts'
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(150000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(128)
    writer.add_expert_feed_forward_length(INTER)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_rope_scaling_orig_ctx_len(4096)
    for name, (shape, qtype, _) in tensors().items():
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == T.MXFP4:
            writer.add_tensor(name, quantize(x, T.MXFP4), raw_dtype=T.MXFP4)
        else:
            writer.add_tensor(name, x.astype(np.float16 if qtype == T.F16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
