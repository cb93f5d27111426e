"""The tiny DeepSeek configs: ``tiny_config("v3")`` (MLA with q_lora) and ``tiny_config("v2")``
(``q_lora_rank=None``: one ``q_proj``), 4 heads, 4 routed experts and 1 shared, layer 0 dense;
and ``fp8_config``, a DeepSeek-V3 whose every quantized dim is a multiple of 128 (block FP8: 8
heads of 192 rows). Saved by the planner's DeepSeek tests, and reused by the TP-model parity
tests."""

from __future__ import annotations

import transformers

HEADS, HIDDEN, INTER, MOE_INTER, SHARED, EXPERTS, VOCAB = 4, 64, 96, 32, 1, 4, 96
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 48, 32, 16, 8, 16


def tiny_config(version: str):
    """The tiny DeepSeek-V3 (q_lora) or DeepSeek-V2 (``q_lora_rank=None``: ``q_proj``)."""
    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=VOCAB,
        n_routed_experts=EXPERTS,
        n_shared_experts=SHARED,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        n_group=2,
        topk_group=1,
    )
    if version == "v3":
        return transformers.DeepseekV3Config(q_lora_rank=Q_LORA, **common)
    return transformers.DeepseekV2Config(q_lora_rank=None, **common)


FP8_HEADS, FP8_NOPE, FP8_ROPE, FP8_V = 8, 64, 128, 128
FP8_HIDDEN, FP8_INTER, FP8_MOE_INTER = 256, 1536, 512  # 12 and 4 blocks of MLP rows


def fp8_config():
    """A DeepSeek-V3 whose every quantized dim is a multiple of 128 (the tool's requirement):
    kv_a_proj_with_mqa is kv_lora 256 + rope 128 = 384 rows; the MLPs 1536 (12 blocks: any N
    of 1, 2, 3, 4 divides them, so at N=3 only the heads refuse) and 512 (4 blocks). kv_lora
    is 256, not 128: a [N/128, 1] scale grid is misread (test_fp8_one_block_of_k_columns)."""
    return transformers.DeepseekV3Config(
        hidden_size=FP8_HIDDEN,
        intermediate_size=FP8_INTER,
        moe_intermediate_size=FP8_MOE_INTER,
        num_hidden_layers=2,
        num_attention_heads=FP8_HEADS,
        num_key_value_heads=FP8_HEADS,
        vocab_size=256,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=256,
        kv_lora_rank=256,
        qk_nope_head_dim=FP8_NOPE,
        qk_rope_head_dim=FP8_ROPE,
        v_head_dim=FP8_V,
        n_group=2,
        topk_group=1,
    )
