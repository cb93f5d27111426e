"""Each worker's share of a model, read from the plan: what integrations build from.

The planner records what it knows of the model in the plan's metadata, so that an integration
(``shardload.hf``, an engine's loader) builds each worker's model from the plan alone, never
from the planner's internals or the kind of session:

``__metadata__.model`` (every plan the planner writes; independent of N)
    ``architecture`` (HF ``model_type`` or GGUF ``general.architecture``), ``checkpoint``
    (``hf``, ``gguf`` or ``mlc``), ``sizes`` (the whole model's, under transformers' names:
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``, and the
    MLP widths it has of ``intermediate_size``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``), ``config_keys`` (where each size lives in the
    checkpoint's own metadata: ``text_config.num_attention_heads``,
    ``llama.attention.head_count``), ``mla`` (DeepSeek's latent attention: one KV head per query
    head), ``projection_norms`` (norms over a whole q or k projection, split with its heads:
    ``{"q_norm": "q"}``), ``row_parallel_biases`` (biases of row-parallel layers: added once,
    after the sum over workers), ``kv_projections`` (the k and v modules), ``quantization``
    (what dequantizing needs: ``formats.Scheme.to_json``), and, for mixtures of experts,
    ``stacked_experts`` (modules holding every routed expert stacked along dim 0: gpt-oss's
    fused ``mlp.experts``), ``expert_shapes`` (for experts stored one per tensor: a routed
    expert module's dense ``[N, K]``, by its last name component) and, where the model sizes its
    shared experts from the experts' width, ``shared_expert_shapes`` (each shared expert
    module's whole dense ``[N, K]``);
``__metadata__.tensor_parallel`` (zero-padded plans only, for their one N)
    each worker's query heads, KV heads (``-1``: a zero head), the local KV head of each local
    query head (``q_to_kv``), and its MLP blocks (``mlp_block`` rows each, per MLP width);
``__metadata__.experts`` (expert parallelism only)
    each worker's experts, per expert count.

``worker_share(validated, rank)`` turns them into one worker's ``WorkerShare``.

>>> share = worker_share(validated, 1)                                    # doctest: +SKIP
>>> share.sizes["num_attention_heads"], share.kv_map
(3, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import PlanError
from .tp_layout import head_layout

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ValidatedPlan

__all__ = ["MLP_SIZES", "MODEL_KEY", "WorkerShare", "worker_share"]

#: the key of the model record in a plan's ``__metadata__``
MODEL_KEY = "model"
#: the MLP widths a record may hold, under transformers' names
MLP_SIZES = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class WorkerShare:
    """One worker's share of the model.

    ``sizes``: this worker's sizes under transformers' names (its query and KV heads, its MLP
    rows of each kind; ``head_dim`` unchanged); ``config``: the same values under the keys of
    the checkpoint's own metadata (``config_keys``); ``kv_map``: the local KV head of each local
    query head where it is not transformers' regular ``h // (q / kv)`` (some zero-padded
    layouts), else None; ``projection_norms``: per split norm, the projection's whole
    ``width``, its ``head_dim`` and a weight per local head (1 / the number of workers holding
    that head, 0 for a zero head: a replicated KV head counts once in the sum of squares);
    ``experts``: under expert parallelism, this worker's experts (``experts_per_worker``), the
    dense shapes of the routed expert weights other workers hold (``missing``), of the shared
    experts to zero-pad to (``pad``), and the modules stacking experts (``stacked``).
    """

    rank: int
    num_shards: int
    record: dict
    sizes: dict[str, int]
    config: dict[str, int]
    kv_map: list[int] | None
    projection_norms: dict[str, dict]
    experts: dict | None = None
    row_parallel_biases: list[str] = field(default_factory=list)

    @property
    def quantization(self) -> dict:
        return self.record.get("quantization") or {"format": "none"}


def _record(validated: ValidatedPlan) -> dict:
    record = validated.plan.metadata.get(MODEL_KEY)
    if not isinstance(record, dict) or "sizes" not in record:
        raise PlanError(
            "the plan has no record of the model (__metadata__.model), so a model "
            "cannot be built from it: use a plan written by shardload's planner "
            "(shardload plan, or plan_for), or leave the plan out to have one made "
            "from the checkpoint's config",
            source=validated.plan.source,
        )
    return record


def _local_sizes(
    record: dict, padding: dict | None, n: int, i: int, whole_experts: bool
) -> dict[str, int]:
    sizes = record["sizes"]
    if padding is not None:
        q, kv = len(padding["q_heads"][i]), len(padding["kv_heads"][i])
        blocks, unit = padding["mlp_blocks"], padding["mlp_block"]

        def mlp(size: int) -> int:
            return len(blocks[str(size)][i]) * unit if str(size) in blocks else size // n
    else:
        q = sizes["num_attention_heads"] // n
        kv = max(1, sizes["num_key_value_heads"] // n)

        def mlp(size: int) -> int:
            return size // n

    local = {
        "num_attention_heads": q,
        "num_key_value_heads": q if record.get("mla") else kv,
        "head_dim": sizes["head_dim"],
    }
    for attr in MLP_SIZES:
        value = sizes.get(attr, 0)
        if value:
            local[attr] = mlp(value)
    if whole_experts and sizes.get("moe_intermediate_size"):
        local["moe_intermediate_size"] = sizes["moe_intermediate_size"]
    return local


def _kv_map(padding: dict | None, i: int) -> list[int] | None:
    if padding is None:
        return None
    q_to_kv = padding["q_to_kv"][i]
    q, kv = len(q_to_kv), len(padding["kv_heads"][i])
    if q % kv == 0 and all(k == h // (q // kv) for h, k in enumerate(q_to_kv)):
        return None
    return q_to_kv


def _head_layout(sizes: dict, padding: dict | None, n: int) -> dict:
    if padding is not None:
        return padding
    return head_layout(sizes["num_attention_heads"], sizes["num_key_value_heads"], n).as_dict()


def _projection_norms(
    record: dict, padding: dict | None, n: int, i: int, kv_map: list[int] | None
) -> dict[str, dict]:
    norms = record.get("projection_norms") or {}
    if not norms:
        return {}
    sizes = record["sizes"]
    heads = _head_layout(sizes, padding, n)
    layout = {"q": heads["q_heads"], "k": heads["kv_heads"]}
    if kv_map is not None:  # expanded: one (copied) KV head per query head, on every worker
        layout["k"] = [
            [kv[m] for m in heads["q_to_kv"][w]] for w, kv in enumerate(heads["kv_heads"])
        ]
    out = {}
    for norm, of in norms.items():
        counts: dict[int, int] = {}
        for worker_heads in layout[of]:
            for h in worker_heads:
                counts[h] = counts.get(h, 0) + 1
        weights = [0.0 if h < 0 else 1.0 / counts[h] for h in layout[of][i]]
        count = sizes["num_attention_heads"] if of == "q" else sizes["num_key_value_heads"]
        out[norm] = {
            "width": count * sizes["head_dim"],
            "weights": weights,
            "head_dim": sizes["head_dim"],
        }
    return out


def _experts(record: dict, validated: ValidatedPlan, i: int) -> dict | None:
    slots = validated.plan.metadata.get("experts")
    if not slots:
        return None
    shapes = record.get("expert_shapes") or {}
    missing = {}  # dense name -> shape of an expert weight another worker holds
    for param in validated:
        if param.workers is not None and i not in param.workers:
            module = param.name.rpartition(".")[0]
            last = module.rpartition(".")[2]
            if last in shapes:
                missing[f"{module}.weight"] = list(shapes[last])
    return {
        "experts_per_worker": {k: v[i] for k, v in slots["experts_per_worker"].items()},
        "missing": missing,
        "pad": dict(record.get("shared_expert_shapes") or {}),
        "stacked": list(record.get("stacked_experts") or ()),
    }


def worker_share(validated: ValidatedPlan, rank: int) -> WorkerShare:
    """Worker ``rank``'s share of the model a validated plan loads (see the module docstring);
    ``PlanError`` when the plan has no model record (a plan written by hand)."""
    record = _record(validated)
    n = validated.num_shards
    padding = validated.plan.metadata.get("tensor_parallel")
    experts = _experts(record, validated, rank)
    sizes = _local_sizes(record, padding, n, rank, whole_experts=experts is not None)
    keys = record.get("config_keys") or {}
    kv_map = _kv_map(padding, rank)
    return WorkerShare(
        rank,
        n,
        record,
        sizes,
        {keys[attr]: value for attr, value in sizes.items() if attr in keys},
        kv_map,
        _projection_norms(record, padding, n, rank, kv_map),
        experts,
        list(record.get("row_parallel_biases") or ()),
    )
