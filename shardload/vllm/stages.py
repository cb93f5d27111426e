"""Pipeline parallel: which checkpoint tensors one stage's model holds.

Under ``--pipeline-parallel-size P`` vLLM builds on each stage only its own decoder layers, the
embeddings on the first stage (and on the last where they are tied to ``lm_head``), the final
norm and ``lm_head`` on the last; every other module is a ``PPMissingLayer`` placeholder, whose
weights the model's ``load_weights`` skips (``is_pp_missing_parameter``). A checkpoint tensor
belongs to the module its name is under (``model.layers.5.self_attn.q_proj.qweight`` to
``model.layers.5``; vLLM's fused ``qkv_proj`` and ``gate_up_proj`` live under the same layer),
so a stage holds every tensor whose name, in vLLM's naming (the model's ``hf_to_vllm_mapper``
where it has one), is under none of its placeholders: what its ``load_weights`` would not skip.
A tensor two stages need (tied embeddings) is held by both.

``Stage.restrict`` keeps of a worker's read plan the pieces of those tensors (through the
loader's ``reads=`` hook: the loader takes a ``ValidatedPlan`` only whole, validated against
every tensor of the checkpoint), so the stage reads, keeps and reports only its own
(``model_loader.py``); the plan is the one of the stage's tensor-parallel group, as without
pipeline parallelism. Only pipeline placeholders count: vLLM's ``StageMissingLayer`` (a
multimodal model's tower left out, with or without pipeline parallelism) is not judged here.

>>> stage = Stage(rank=1, size=2, missing=("model.embed_tokens.", "model.layers.0."),
...               layers=(1, 2))
>>> [stage.holds(n) for n in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
...                           "model.layers.1.mlp.up_proj.weight", "lm_head.weight")]
[False, False, True, True]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from ..readplan import ReadPlan

__all__ = ["Stage", "layer_range", "placeholders", "stage_of"]


@dataclass(frozen=True)
class Stage:
    """Stage ``rank`` of ``size``: the module prefixes its model does not hold (``missing``,
    each ending in ``.``, as vLLM's ``get_pp_missing_layer_names`` writes them), the decoder
    layers it holds (``layers``: ``[start, end)``, None where the model does not say), and
    ``rename``: a checkpoint name as vLLM names it (the model's ``hf_to_vllm_mapper``)."""

    rank: int
    size: int
    missing: tuple[str, ...]
    layers: tuple[int, int] | None = None
    rename: Callable[[str], str | None] | None = None

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is under a module this stage's model holds.
        A name the mapper drops (vLLM ignores it) is judged as it is written."""
        if self.rename is not None:
            name = self.rename(name) or name
        return not name.startswith(self.missing)  # one call over every prefix

    def names(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, those this stage holds, in their order."""
        return [name for name in names if self.holds(name)]

    def restrict(self, plan: ReadPlan) -> ReadPlan:
        """``plan`` (one worker's read plan) with only the pieces of the tensors this stage
        holds: nothing else is read, kept or counted."""
        from ..readplan import Pieces

        held = self.names(p.name for p in plan.pieces)
        if len(held) == len(plan.pieces):
            return plan
        keep = set(held)
        return dataclasses.replace(plan, pieces=Pieces.of(p for p in plan.pieces if p.name in keep))

    def describe(self) -> dict:
        """The stage in the statistics line: ``pp_rank``, ``pp_size`` and the held layers."""
        return {
            "pp_rank": self.rank,
            "pp_size": self.size,
            "layers": list(self.layers) if self.layers is not None else None,
        }


def placeholders(modules: Iterable[tuple[str, Any]], kinds: tuple[type, ...]) -> tuple[str, ...]:
    """The prefixes (``name.``) of the modules among ``modules`` (``named_modules()``) that are
    placeholders (instances of ``kinds``); the trailing dot keeps ``model.layers.1.`` from
    matching ``model.layers.11``."""
    return tuple(name + "." for name, module in modules if isinstance(module, kinds))


def layer_range(model: nn.Module, kinds: tuple[type, ...]) -> tuple[int, int] | None:
    """The decoder layers ``[start, end)`` the model holds: the ``start_layer`` and ``end_layer``
    vLLM's models keep (``make_layers``), else the members of the first list of layers that
    has placeholders which are not; None where neither says."""
    from torch import nn

    for _, module in model.named_modules():
        start, end = getattr(module, "start_layer", None), getattr(module, "end_layer", None)
        if type(start) is int and type(end) is int:
            return start, end
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            held = [isinstance(m, kinds) for m in module]
            if any(held):
                present = [i for i, missing in enumerate(held) if not missing]
                return (present[0], present[-1] + 1) if present else (0, 0)
    return None


def stage_of(model: nn.Module) -> Stage | None:
    """This process's stage of vLLM's pipeline and what its ``model`` holds; None without
    pipeline parallelism (one stage holds everything: nothing changes)."""
    from vllm.distributed import get_pp_group
    from vllm.model_executor.models.utils import PPMissingLayer

    pp = get_pp_group()
    if pp.world_size == 1:
        return None
    kinds = (PPMissingLayer,)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    rename = getattr(mapper, "map_name", None) if mapper is not None else None
    return Stage(
        pp.rank_in_group,
        pp.world_size,
        placeholders(model.named_modules(), kinds),
        layer_range(model, kinds),
        rename,
    )
