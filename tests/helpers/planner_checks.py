"""The planner tests' shared references: a padded plan's recorded layout against the rule's
(``check_padded_layout``), a Mixture-of-Experts tensor's tensor-parallel split by the rules
(``split_of``, for ``helpers.moe_configs``' models) and the expert a tensor belongs to
(``expert_of``)."""

from __future__ import annotations

import re

from helpers.moe_configs import HEADS, KV_HEADS, mlp_sizes

__all__ = ["check_padded_layout", "expert_of", "split_of"]

_EXPERT = re.compile(r"\.experts\.([0-9]+)(?:\.|$)")


def check_padded_layout(
    decision,
    heads: tuple[list, list],
    mlp_blocks: dict[int, list],
    *,
    block: int = 1,
    head_dim: int | None = None,
) -> None:
    """The padded plan's record (``__metadata__.tensor_parallel``) is the rule's: its N, each
    worker's query and KV heads (``heads``), the rows of an MLP block (``block``, where an MLP
    is split) and, by MLP size, each worker's blocks (``mlp_blocks``); ``head_dim`` where given.

    >>> heads, blocks = padded_heads(9, 3, 2), {64: padded_units(64, 2)}  # doctest: +SKIP
    >>> check_padded_layout(decision, heads, blocks)                      # doctest: +SKIP
    """
    layout = decision.shard_info().metadata["tensor_parallel"]
    assert layout["num_shards"] == decision.num_shards
    if head_dim is not None:
        assert layout["head_dim"] == head_dim
    assert (layout["q_heads"], layout["kv_heads"]) == heads
    if mlp_blocks:
        assert layout["mlp_block"] == block
    assert layout["mlp_blocks"] == {str(size): units for size, units in mlp_blocks.items()}


def split_of(name: str, config):
    """(axis, rows, units, replicable, kind) of a tensor's split in a ``moe_configs`` model, or
    None: replicated (norms, per-head q/k norms, routers, shared_expert_gate, embeddings)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // HEADS
    module = name.rsplit(".", 2)[-2]
    if module in ("q_proj", "o_proj"):
        return (1 if module == "o_proj" else 0), HEADS * head_dim, HEADS, False, "q"
    if module in ("k_proj", "v_proj"):
        return 0, KV_HEADS * head_dim, KV_HEADS, True, "kv"
    if module not in ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2"):
        return None
    kind = (
        "experts"
        if ".experts." in name
        else "shared_expert"
        if ".shared_expert." in name
        else "dense"
    )
    size = mlp_sizes(config)[kind]
    return (1 if module in ("down_proj", "w2") else 0), size, size, False, kind


def expert_of(name: str) -> int | None:
    """The routed expert a tensor or module belongs to (``...experts.E....``), or None.

    >>> expert_of("model.layers.1.mlp.experts.3.gate_proj.weight"), expert_of("lm_head.weight")
    (3, None)
    """
    found = _EXPERT.search(name)
    return None if found is None else int(found.group(1))
