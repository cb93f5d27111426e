"""The record of the model a plan carries for integrations (``__metadata__.model``).

What the planner knows and an integration needs to build each worker's model, written once
here, read by ``shardload.geometry`` (whose docstring is the record's contract): the whole
model's sizes under transformers' names and where each lives in the checkpoint's own metadata,
the tensors that need handling of their own (row-parallel biases, k/v projections, split
norms, expert weights) by name, and the quantization. It is independent of N: the per-worker
shares follow from it and the padded layout (``__metadata__.tensor_parallel``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..formats import Scheme

if TYPE_CHECKING:  # pragma: no cover
    from ..readers.base import Checkpoint
    from .experts import ExpertParallel
    from .spec import ModelSpec
    from .tensors import Tensor, Walk

__all__ = ["model_record"]

#: the spec's sizes, under transformers' names (the record's vocabulary)
_SIZES = {
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "moe_intermediate_size": "moe_intermediate_size",
    "shared_expert_intermediate_size": "shared_expert_intermediate_size",
}
#: where GGUF keeps them (``{arch}.<key>``)
_GGUF_KEYS = {
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "intermediate_size": "feed_forward_length",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}


def _config_keys(spec: ModelSpec, kind: str, config: dict) -> dict[str, str]:
    """Where each per-worker size goes in the checkpoint's own metadata."""
    if kind == "gguf":
        return {attr: f"{spec.architecture}.{key}" for attr, key in _GGUF_KEYS.items()}
    under = spec.rules.sizes_under or ("model_config" if kind == "mlc" else "")
    target = config.get(under, {}) if under else config
    target = target if isinstance(target, dict) else {}
    keys = {
        "num_attention_heads": "num_attention_heads",
        "num_key_value_heads": "num_key_value_heads",
    }
    if spec.mla is None:
        keys["head_dim"] = "head_dim"  # no longer hidden / heads on a worker
    for attr in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if attr in target:
            keys[attr] = attr
    if spec.rules.experts_size == "intermediate_size":
        # Mixtral's and gpt-oss's intermediate_size is the experts' width
        keys.pop("moe_intermediate_size", None)
        keys["moe_intermediate_size"] = "intermediate_size"
        keys.pop("intermediate_size", None)
    prefix = f"{under}." if under else ""
    return {attr: prefix + key for attr, key in keys.items()}


def model_record(
    ckpt: Checkpoint,
    spec: ModelSpec,
    scheme: Scheme,
    kind: str,
    walked: Walk,
    experts: ExpertParallel | None = None,
) -> dict:
    """The record of ``spec`` for the plan's ``__metadata__.model`` (``walked``: its tensors,
    ``tensors.walk``)."""
    sizes = {name: getattr(spec, attr) for name, attr in _SIZES.items()}
    sizes = {name: value for name, value in sizes.items() if value}
    row_biases: list[str] = []
    kv: dict[str, None] = {}  # modules, in storage order
    stacked: dict[str, None] = {}
    expert_shapes: dict[str, list[int]] = {}
    shared_shapes: dict[str, list[int]] = {}
    noted: dict[int, _Notes] = {}  # by kind: what its tensors add to the record
    for meta, each in walked.rows():
        if each.role is None:
            continue
        notes = noted.get(id(each))
        if notes is None:
            notes = noted[id(each)] = _notes(each, spec, experts)
            if notes.expert_shape is not None:
                expert_shapes[each.module.rpartition(".")[2]] = notes.expert_shape
        if notes.row_bias:
            row_biases.append(meta.name)
        if notes.modules is not None or notes.shared_shape is not None:
            module = meta.name.rpartition(".")[0]
            if notes.modules == "kv":
                kv.setdefault(module)
            elif notes.modules == "stacked":
                stacked.setdefault(module)
            if notes.shared_shape is not None:
                shared_shapes[f"{module}.weight"] = notes.shared_shape
    record = {
        "architecture": spec.architecture,
        "checkpoint": kind,
        "sizes": sizes,
        "config_keys": _config_keys(spec, kind, ckpt.config),
        "mla": spec.mla is not None,
        "projection_norms": dict(spec.rules.split_norms),
        "row_parallel_biases": row_biases,
        "kv_projections": list(kv),
        "quantization": scheme.to_json(),
    }
    if stacked:
        record["stacked_experts"] = list(stacked)
    if expert_shapes:
        record["expert_shapes"] = expert_shapes
    if shared_shapes:
        record["shared_expert_shapes"] = shared_shapes
    return record


class _Notes(NamedTuple):
    """What every tensor of one kind adds to the record."""

    row_bias: bool  # its name goes in ``row_parallel_biases``
    modules: str | None  # its module goes in ``kv`` or ``stacked`` (experts)
    expert_shape: list[int] | None  # one expert's [N, K], for ``expert_shapes``
    shared_shape: list[int] | None  # a shared expert's padded [N, K] (DeepSeek under EP)


def _notes(t: Tensor, spec: ModelSpec, experts: ExpertParallel | None) -> _Notes:
    role = t.role
    assert role is not None
    expert = spec.rules.naming.expert_kind(t.name, t.module) if role.kind == "mlp" else None
    # added once, after the row-parallel sum; an expert's own bias under expert parallelism
    # belongs to the worker holding the expert
    row_bias = (
        "bias" in t.suffix and not role.column and not (experts is not None and expert is not None)
    )
    modules = (
        "kv"
        if role.name in ("k", "v")
        else "stacked"
        if expert is not None and expert[0] == "stacked"
        else None
    )
    expert_shape = shared_shape = None
    if expert is not None and expert[0] == "one":
        (n, _), (k, _) = role.extents(spec, t.mlp)
        expert_shape = [n, k]
    if (
        experts is not None
        and spec.mla is not None
        and t.mlp == "shared"
        and spec.shared_expert_intermediate_size
        and t.suffix in ("weight", "qweight", "weight_packed")
    ):
        # DeepSeek sizes its shared experts from the experts' width (moe_intermediate_size
        # x n_shared_experts), which expert parallelism keeps whole: their tensor-parallel
        # share is zero-padded to that width (zero rows of gate/up, columns of down)
        (n, _), (k, _) = role.extents(spec, t.mlp)
        shared_shape = [n, k]
    return _Notes(row_bias, modules, expert_shape, shared_shape)
