"""The tiny transformers configs the ModelOpt NVFP4 tests export with ModelOpt itself
(``helpers.modelopt_tool.cached_modelopt_nvfp4``): Llama, Phi-3 (fused qkv / gate_up),
Qwen3-MoE (experts one tensor each) and a Llama whose 8-element heads share a 16-element NVFP4
group (``CONFIGS``, name -> config maker). Used by the planner's ModelOpt tests and the TP-model
format tests."""

from __future__ import annotations

import transformers

HEADS, KV_HEADS, HIDDEN, INTER, VOCAB = 4, 2, 64, 128, 96
EXPERTS, MOE_INTER = 4, 32
DENSE = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=1,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    vocab_size=VOCAB,
)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**DENSE),
    "phi3": lambda: transformers.Phi3Config(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **DENSE
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        moe_intermediate_size=MOE_INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=16,
        vocab_size=VOCAB,
        decoder_sparse_step=1,
    ),
    # heads of 8 elements: each 16-element group of o_proj's K holds two of them
    "llama_narrow_heads": lambda: transformers.LlamaConfig(
        **{**DENSE, "hidden_size": 32, "intermediate_size": 64}
    ),
}
