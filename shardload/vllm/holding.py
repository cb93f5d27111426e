"""How the model vLLM built holds its weights, which a plan made from the config follows.

Two choices of the planner depend on vLLM's model, not on the checkpoint:

* **whole experts** per rank (``--enable-expert-parallel``): the planner's ``experts="ep"``;
* **the vocabulary split**. vLLM holds the embeddings and ``lm_head`` split by vocabulary rows
  (``VocabParallelEmbedding``, ``ParallelLMHead``): it pads the vocabulary to a multiple of 64
  (plus any added tokens), cuts that into N equal parts, and rank ``r`` keeps the checkpoint's
  rows ``[r * part, min((r + 1) * part, vocab))``. Where the vocabulary needs no padding and N
  divides it, that is exactly the planner's even split (``vocab_parallel``), so each rank need
  read only its own rows: a rank of Llama 3 70B at TP=8 reads 0.5 GB of its embeddings and
  ``lm_head`` instead of 4.2 GB. Elsewhere (a vocabulary vLLM pads, so that the last rank
  keeps fewer rows) the plan replicates them and vLLM narrows, as before. The answer comes
  from every such module of the model, so a model that holds its vocabulary another way is
  planned replicated; ``verify`` proves the split byte for byte (``verify.py``).

Only a plan the planner makes follows them: a plan given (the ``plan`` option) or beside the
checkpoint (``shard_info.json``) is used as it is.

>>> Holding(whole_experts=False, vocab_split=True).planner_options(False, None)
{'vocab_parallel': True}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn
    from vllm.config import ModelConfig

__all__ = ["Holding", "holds_even_rows", "places_whole_experts", "vocab_split_matches"]


@dataclass(frozen=True)
class Holding:
    """How vLLM holds the model on this rank: whole experts per rank; the vocabulary split as
    the planner's ``vocab_parallel`` splits it."""

    whole_experts: bool
    vocab_split: bool

    @classmethod
    def of(cls, model: nn.Module, model_config: ModelConfig) -> Holding:
        from vllm.distributed import get_tp_group

        return cls(
            places_whole_experts(model, model_config),
            vocab_split_matches(model, get_tp_group().world_size),
        )

    def planner_options(self, plan_given: bool, beside: str | None) -> dict[str, Any]:
        """``plan_once``'s planner options: none for a plan given, and no vocabulary split
        where a plan lies beside the checkpoint (``beside``, else None), which is used as it
        is (whole experts are asked for there too: the front door refuses, naming the flag,
        since that plan cannot place them)."""
        if plan_given:
            return {}
        options: dict[str, Any] = {"experts": "ep"} if self.whole_experts else {}
        if self.vocab_split and beside is None:
            options["vocab_parallel"] = True
        return options


def places_whole_experts(model: nn.Module, model_config: ModelConfig) -> bool:
    """Whether vLLM places whole experts per rank (``--enable-expert-parallel``): its
    parallel config says so on a first load; vLLM's in-place reload sets no current config,
    and there the model it built says so (its fused MoE layers hold fewer experts than the
    model has)."""
    from vllm.config import get_current_vllm_config_or_none

    if not model_config.is_moe:
        return False
    config = get_current_vllm_config_or_none()
    if config is not None:
        return bool(config.parallel_config.enable_expert_parallel)
    experts = model_config.get_num_experts()
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1].startswith("w13_"):  # vLLM's fused MoE weights
            return p.shape[0] < experts
    return False


def vocab_split_matches(model: nn.Module, num_shards: int) -> bool:
    """Whether every vocabulary-parallel module of ``model`` (there is at least one) holds
    rank ``r``'s ``r``-th of N equal parts of its rows, which ``vocab_parallel`` plans."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    held = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    return num_shards > 1 and bool(held) and all(holds_even_rows(m, num_shards) for m in held)


def holds_even_rows(module: Any, num_shards: int) -> bool:
    """Whether a ``VocabParallelEmbedding`` (its attributes as vLLM sets them) holds its
    rank's equal part of the checkpoint's rows: no padding, no added tokens, N parts."""
    rows = module.org_vocab_size
    part, rank = rows // num_shards, module.tp_rank
    indices = module.shard_indices
    return (
        module.tp_size == num_shards
        and module.num_added_embeddings == 0
        and module.num_embeddings_padded == rows
        and rows % num_shards == 0
        and (indices.org_vocab_start_index, indices.org_vocab_end_index)
        == (rank * part, (rank + 1) * part)
    )
