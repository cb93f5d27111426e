"""The tiny MoE configs transformers saves per expert: Mixtral, Qwen2-MoE (with a shared expert)
and Qwen3-MoE (per-head q/k norms), 4 experts, the Qwen models with one dense layer
(``CONFIGS``, name -> config maker); and ``mlp_sizes``, the widths of a MoE config's MLPs by
kind. Saved by the planner's MoE tests, and reused by the expert tests and the TP-model parity
tests."""

from __future__ import annotations

import transformers

HEADS, KV_HEADS, HIDDEN, VOCAB, EXPERTS = 4, 2, 64, 96, 4
COMMON = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    vocab_size=VOCAB,
    num_experts_per_tok=2,
)

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        intermediate_size=96, num_local_experts=EXPERTS, **COMMON
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=EXPERTS,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        **COMMON,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=32,
        head_dim=24,
        num_experts=EXPERTS,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        **COMMON,
    ),
}


def mlp_sizes(config) -> dict[str, int]:
    """The MLP widths by kind: experts, dense, shared_expert (Mixtral's experts are
    ``intermediate_size`` wide)."""
    if config.model_type == "mixtral":
        return {"experts": config.intermediate_size}
    sizes = {"experts": config.moe_intermediate_size, "dense": config.intermediate_size}
    if getattr(config, "shared_expert_intermediate_size", None):
        sizes["shared_expert"] = config.shared_expert_intermediate_size
    return sizes
