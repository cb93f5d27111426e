"""What a planner must know of a model: its geometry, from HF, GGUF or MLC metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import PlanError

#: HF model_type values whose layers are Llama-shaped (attention + gated MLP, optional MoE)
LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}


@dataclass(frozen=True)
class ModelSpec:
    """The sizes that decide how a Llama-family model may be split."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _need(config: Mapping[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if type(value) is not int or value <= 0:
        raise PlanError(f"the model config has no valid {key!r} (got {value!r}); the planner "
                        "needs it to know how the model may be split", source=source)
    return value


def spec_from_hf(config: Mapping[str, Any], source: str) -> ModelSpec:
    """From an HF ``config.json``."""
    model_type = config.get("model_type")
    if model_type not in LLAMA_LIKE:
        raise PlanError(f"model_type {model_type!r} is not supported by the planner (it knows "
                        f"{', '.join(sorted(LLAMA_LIKE))}); write shard_info.json by hand, or "
                        "register shard functions for it", source=source)
    heads = _need(config, "num_attention_heads", source)
    hidden = _need(config, "hidden_size", source)
    head_dim = config.get("head_dim") or hidden // heads
    return ModelSpec(
        architecture=model_type, num_layers=_need(config, "num_hidden_layers", source),
        hidden_size=hidden, num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=config.get("intermediate_size") or 0,
        vocab_size=_need(config, "vocab_size", source),
        moe_intermediate_size=(config.get("moe_intermediate_size")
                               or (config.get("intermediate_size") if model_type == "mixtral"
                                   else 0) or 0),
        shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0)


def spec_from_gguf(kv: Mapping[str, Any], source: str) -> ModelSpec:
    """From GGUF key-values (``llama.attention.head_count`` ...)."""
    arch = kv.get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe"):
        raise PlanError(f"GGUF architecture {arch!r} is not supported by the planner",
                        source=source)

    def get(key: str, default=None):
        return kv.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    if type(heads) is not int or type(hidden) is not int:
        raise PlanError(f"the GGUF metadata lacks {arch}.attention.head_count or "
                        f"{arch}.embedding_length", source=source)
    head_dim = get("attention.key_length") or hidden // heads
    vocab = get("vocab_size") or 0
    return ModelSpec(
        architecture=arch, num_layers=get("block_count") or 0, hidden_size=hidden,
        num_heads=heads, num_kv_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim, intermediate_size=get("feed_forward_length") or 0,
        vocab_size=vocab, moe_intermediate_size=get("expert_feed_forward_length") or 0)


def spec_from_mlc(config: Mapping[str, Any], source: str) -> ModelSpec:
    """From MLC's ``mlc-chat-config.json`` (its ``model_config`` holds HF-style sizes)."""
    model = dict(config.get("model_config") or {})
    model.setdefault("model_type", config.get("model_type"))
    if model.get("model_type") not in LLAMA_LIKE:
        raise PlanError(f"MLC model_type {model.get('model_type')!r} is not supported by the "
                        "planner", source=source)
    model.setdefault("num_hidden_layers", model.get("num_layers"))
    return spec_from_hf(model, source)
