"""Planners write ``shard_info.json`` for known architectures and quantization formats.

``plan_for(checkpoint)`` reads the checkpoint's own metadata (HF ``config.json`` with its
``quantization_config``, GGUF key-values, MLC's ``mlc-chat-config.json``), decides how every
tensor splits, and returns a plan written in expressions of ``num_shards``: one file for every
N the model allows. For a given N the decision is ``plan_decision``'s (``decision.py``): the
plan as it is, a plan for N alone that zero-pads heads and MLP blocks, or a refusal naming the
constraint N breaks and the N that work.

The modules: ``decision`` (the decision and its results), ``kinds`` and ``spec`` (what the
checkpoint is), ``checks`` (its metadata against its tensors), ``tensors``, ``roles``,
``naming`` and ``architectures`` (each tensor's role), ``decoder`` (each tensor's step),
``fit`` (the N each split allows), ``padding``, ``experts`` and ``record`` (what the plan
records for integrations). Which N any plan fits, by validating it, is the plan's own
(``shardload.plan``: ``valid_num_shards``), re-exported here.

>>> info = plan_for(open_checkpoint("examples/tiny_llama_q4"), num_shards=4)   # doctest: +SKIP
>>> valid_num_shards(info, open_checkpoint("examples/tiny_llama_q4"))           # doctest: +SKIP
[1, 2, 4, 8]
"""

from __future__ import annotations

from ..plan import MAX_SHARDS_TRIED, MAX_VALIDATION_WORK, ValidNumShards, valid_num_shards
from .decision import PlanDecision, PlanKind, PlanSummary, plan_decision, plan_for

__all__ = [
    "MAX_SHARDS_TRIED",
    "MAX_VALIDATION_WORK",
    "PlanDecision",
    "PlanKind",
    "PlanSummary",
    "ValidNumShards",
    "plan_decision",
    "plan_for",
    "valid_num_shards",
]
