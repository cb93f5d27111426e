"""Any N in vLLM: the padded model, where shardload's zero-padding is exact in vLLM's own model.

vLLM refuses a tensor-parallel size that does not divide the attention heads (SmolLM2's 9 at
N=2 or 4) or the MLP. Where shardload's plan for that N zero-pads (zero query heads whose
output columns are zero, zero KV heads only zero query heads read, zero MLP rows), the padded
model computes exactly what the model does, and vLLM can run it if it is told the padded sizes:
``hf_overrides``, so it builds the padded model, and shardload hands it the padded tensors.

vLLM's attention has one shape on every rank: the same query and KV heads per rank, query head
``h`` reading KV head ``h // (q / kv)``, no KV head on two ranks once the KV heads are padded to
a multiple of N. The planner pads heads into such a layout (``tp_layout.head_layout``: SmolLM2's
9 query and 3 KV heads at N=2 become 12 and 4), so a padded plan gets its overrides; one that
is not (a hand-written plan, latent attention, norms over whole projections) is refused, with
the N that do work. Under expert parallelism (``experts="ep"``) routed experts are whole on
their rank and keep their width; the heads, the dense MLP and a shared expert with a width of
its own (Qwen2-MoE's ``shared_expert_intermediate_size``) pad as they do without it.

    shardload vllm-overrides --shards 4 CKPT     # the --hf-overrides JSON for N=4
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..geometry import MLP_SIZES, worker_share

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import ValidatedPlan

__all__ = [
    "check_built",
    "validated_for_vllm",
    "vllm_layout_problem",
    "vllm_overrides",
    "working_sizes",
]

#: the sizes the padded model's config states, under transformers' names
_HEAD_SIZES = ("num_attention_heads", "num_key_value_heads", "head_dim")

#: architectures whose vLLM model takes head_dim as hidden_size / heads, not from the config
#: (vllm/model_executor/models/qwen2.py, qwen2_moe.py), so padded heads would change it
_HEAD_DIM_FROM_HIDDEN = {"qwen2", "qwen2_moe"}


def vllm_layout_problem(validated) -> str | None:
    """Why vLLM's model cannot hold this padded plan's layout, or None if it can."""
    padding = validated.plan.metadata.get("tensor_parallel")
    if padding is None:
        return None
    n = validated.num_shards
    shares = [worker_share(validated, i) for i in range(n)]
    if any(s.sizes != shares[0].sizes for s in shares):
        counts = sorted(
            {(s.sizes["num_attention_heads"], s.sizes["num_key_value_heads"]) for s in shares}
        )
        return (
            f"its ranks hold different numbers of heads "
            f"({', '.join(f'{q} query / {k} KV' for q, k in counts)}), "
            "and vLLM's attention has one shape on every rank"
        )
    uneven = next((s for s in shares if s.kv_map is not None), None)
    if uneven is not None:
        return (
            f"rank {uneven.rank}'s query heads read KV heads {uneven.kv_map}, not vLLM's "
            f"regular h // (query heads / KV heads)"
        )
    kv_heads = padding["kv_heads"]
    # fewer (padded) KV heads than ranks: vLLM gives each to N / K ranks in turn
    replicas = _replicas(kv_heads)
    seen: dict[int, int] = {}
    for rank, heads in enumerate(kv_heads):
        for h in heads:
            if h >= 0 and h in seen and seen[h] // replicas != rank // replicas:
                return (
                    f"KV head {h} is on ranks {seen[h]} and {rank}; vLLM shares KV heads "
                    "between ranks only when there are fewer KV heads than ranks, each "
                    "with the ranks next to it"
                )
            seen.setdefault(h, rank)
    record = shares[0].record
    heads_padded = (
        n * shares[0].sizes["num_attention_heads"] != record["sizes"]["num_attention_heads"]
    )
    if heads_padded and record.get("architecture") in _HEAD_DIM_FROM_HIDDEN:
        return (
            f"vLLM's {record['architecture']} model takes head_dim as hidden_size / "
            "attention heads, so padded heads would change it"
        )
    if record.get("projection_norms"):
        return (
            "its norms span whole projections ("
            + ", ".join(record["projection_norms"])
            + "), which vLLM's model cannot pad"
        )
    if record.get("mla"):
        return "vLLM's latent attention is not padded"
    if validated.plan.metadata.get("experts"):
        whole = record["sizes"].get("moe_intermediate_size")
        padded = {int(w) for w in padding.get("mlp_blocks", {})}
        own = {record["sizes"].get(a) for a in MLP_SIZES if a != "moe_intermediate_size"}
        if whole in padded and whole not in own:
            return (
                f"under expert parallelism its shared experts pad from {whole} rows, the "
                "width vLLM builds them from (moe_intermediate_size), which the routed "
                "experts, whole on their ranks, keep"
            )
    return None


def _replicas(kv_heads: list[list[int]]) -> int:
    """How many ranks in turn hold each KV head: 1, or, where every rank holds one KV head,
    the length of the first run of ranks holding the same one."""
    if any(len(heads) != 1 for heads in kv_heads):
        return 1
    run = 1
    while run < len(kv_heads) and kv_heads[run] == kv_heads[0]:
        run += 1
    return run if len(kv_heads) % run == 0 else 1


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        where = out
        *parents, last = key.split(".")
        for p in parents:
            where = where.setdefault(p, {})
        where[last] = value
    return out


def padded_sizes(validated) -> dict[str, int]:
    """The whole padded model's sizes under transformers' names (empty for an unpadded plan)."""
    if validated.plan.metadata.get("tensor_parallel") is None:
        return {}
    n = validated.num_shards
    share = worker_share(validated, 0)
    local, whole = share.sizes, share.record["sizes"]
    sizes = {
        "num_attention_heads": n * local["num_attention_heads"],
        "num_key_value_heads": n * local["num_key_value_heads"],
        "head_dim": local["head_dim"],
    }
    padded_widths = validated.plan.metadata["tensor_parallel"].get("mlp_blocks", {})
    whole_experts = bool(validated.plan.metadata.get("experts"))
    for attr in MLP_SIZES:  # only the widths padding changed (of an MLP some tensor has)
        if whole_experts and attr == "moe_intermediate_size":
            continue  # expert parallelism: routed experts whole, their width kept
        if (
            attr in local
            and n * local[attr] != whole.get(attr)
            and str(whole.get(attr)) in padded_widths
        ):
            sizes[attr] = n * local[attr]
    return sizes


def overrides_for(validated) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` for this plan: {} for an unpadded one; the padded sizes under
    the checkpoint config's own keys for a padded one whose layout vLLM holds; else
    ``PlanError``."""
    problem = vllm_layout_problem(validated)
    if problem is not None:
        raise PlanError(
            f"vLLM cannot run shardload's zero-padded plan for N={validated.num_shards}: {problem}",
            source=validated.plan.source,
        )
    sizes = padded_sizes(validated)
    if not sizes:
        return {}
    keys = worker_share(validated, 0).record.get("config_keys") or {}
    return _nested({keys.get(attr, attr): value for attr, value in sizes.items()})


def working_sizes(checkpoint, up_to: int = 8, experts: str = "tp") -> list[tuple[int, bool]]:
    """The tensor-parallel sizes from 1 to ``up_to`` vLLM can run with shardload: (N, padded).
    An N the planner's plan fits unpadded is vLLM's usual layout, known from one planning; only
    the others are planned, each for its own N."""
    from ..frontdoor import planned_fits, resolve_plan

    unpadded = set(planned_fits(checkpoint)) if experts == "tp" else set()
    works = []
    for n in range(1, up_to + 1):
        if n in unpadded:
            works.append((n, False))
            continue
        try:
            validated = resolve_plan(checkpoint, n, experts=experts).validated
        except PlanError:
            continue
        if vllm_layout_problem(validated) is None:
            works.append((n, "tensor_parallel" in validated.plan.metadata))
    return works


def describe_working(checkpoint, up_to: int = 8, experts: str = "tp") -> str:
    works = working_sizes(checkpoint, up_to, experts)
    if not works:
        return f"no N from 1 to {up_to} works"
    return "N that work: " + ", ".join(f"{n} (padded)" if padded else str(n) for n, padded in works)


def vllm_overrides(
    checkpoint: Any, tensor_parallel_size: int, shard_info: Any = None, *, experts: str = "tp"
) -> dict[str, Any]:
    """The ``hf_overrides`` vLLM needs to run ``checkpoint`` at ``tensor_parallel_size`` with
    shardload (``experts="ep"``: under ``--enable-expert-parallel``): {} where N divides the
    model, the padded sizes where shardload's exact padding is a layout vLLM holds, else
    ``PlanError`` naming the N that work.

    >>> vllm_overrides("SmolLM2-135M/", 4)                                   # doctest: +SKIP
    {'num_attention_heads': 12, 'num_key_value_heads': 4, 'head_dim': 64}
    """
    return overrides_for(
        validated_for_vllm(checkpoint, tensor_parallel_size, shard_info, experts=experts)
    )


def validated_for_vllm(
    checkpoint: Any, tensor_parallel_size: int, shard_info: Any = None, *, experts: str = "tp"
) -> ValidatedPlan:
    """The plan shardload loads into vLLM at N (the front door's; with ``experts``, as the
    loader plans under vLLM's expert parallelism), validated, where vLLM's model can hold its
    layout; else ``PlanError`` naming the N that work."""
    from ..frontdoor import resolve_plan
    from ..readers import as_checkpoint

    ckpt = as_checkpoint(checkpoint)
    try:
        validated = resolve_plan(ckpt, tensor_parallel_size, shard_info, experts=experts).validated
        overrides_for(validated)  # refuses a layout vLLM cannot hold
        return validated
    except PlanError as exc:
        # the N that work for shardload alone (exc.working) give way to vLLM's
        raise PlanError(
            f"{exc.constraint.rstrip('.')}; {describe_working(ckpt, experts=experts)}",
            source=exc.source,
            param=exc.param,
            step=exc.step,
        ) from None


def check_built(validated: ValidatedPlan, hf_config: Any) -> None:
    """The model vLLM builds (``hf_config``: its text config, ``hf_overrides`` applied) must be
    the one the plan loads: the padded one for a padded plan, the checkpoint's own otherwise;
    else ``PlanError`` with the exact flag to start vLLM with. Run before vLLM's own checks
    (``preflight.py``) and again by the loader."""
    wanted = padded_sizes(validated)
    if not wanted:
        record = worker_share(validated, 0).record
        wanted = {k: v for k, v in record["sizes"].items() if k in _HEAD_SIZES[:2]}
    built = {k: getattr(hf_config, k, None) for k in wanted}
    wrong = {k: v for k, v in wanted.items() if built[k] is not None and built[k] != v}
    if not wrong:
        return
    overrides = overrides_for(validated) if padded_sizes(validated) else {}
    raise PlanError(
        f"vLLM at tensor-parallel size {validated.num_shards} builds the model with "
        f"{', '.join(f'{k}={built[k]}' for k in wrong)}, but shardload's plan loads "
        f"{', '.join(f'{k}={v}' for k, v in wrong.items())}, its zero-padded model: "
        + (
            f"add --hf-overrides '{json.dumps(overrides)}'"
            if overrides
            else "start vLLM without --hf-overrides of these sizes"
        ),
        source=validated.plan.source,
    )
