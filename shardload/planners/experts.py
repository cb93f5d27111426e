"""Expert parallelism: each worker holds whole routed experts instead of a slice of every one.

With ``experts="tp"`` (the default) a routed expert splits across the workers like any MLP.
With ``experts="ep"`` the planner gives each worker whole experts, so a worker reads only its
own experts' bytes and runs them unsplit; attention, shared experts and dense MLPs stay
tensor-parallel, routers are replicated (every worker routes every token). Experts are assigned
contiguously and balanced (``tp_layout.expert_layout``: 60 experts on 8 workers are 8, 8, 8, 8,
7, 7, 7, 7), and the plan records the assignment under ``__metadata__.experts``:

* an expert stored on its own (``mlp.experts.7.gate_proj.weight``, ModelOpt's per-expert
  export) is held whole by its worker alone: the plan's ``__placement__``;
* experts stacked in one tensor along dim 0 (GGUF's ``ffn_gate_exps`` [E, rows, K], gpt-oss's
  fused ``experts.gate_up_proj_blocks``) split along that dim in whole experts; where the
  workers' counts differ, the shorter ones get zero slots to keep every piece one shape
  (``-1`` in ``experts_per_worker``), which the router never selects.

An EP plan is for one N (the placement names workers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ..errors import PlanError
from ..plan import step_json
from .tp_layout import expert_layout

#: the MLP roles an expert's tensors have
EXPERT_ROLES = {"gate", "up", "down", "gate_up"}
#: the index of an expert stored on its own: ``....experts.7.gate_proj.weight``
_EXPERT_INDEX = re.compile(r"\.experts\.([0-9]{1,9})\.")
MODES = ("tp", "ep")


def is_shared(module: str) -> bool:
    """A shared expert (always tensor-parallel): Qwen's ``shared_expert``, DeepSeek's
    ``shared_experts``, GGUF's ``*_shexp``."""
    return "shared_expert" in module or "shexp" in module


def expert_kind(name: str, module: str, gguf_names: bool) -> Optional[tuple[str, str, int]]:
    """``("one", layer, e)`` for a tensor of routed expert ``e`` stored on its own,
    ``("stacked", layer, 0)`` for routed experts stacked along dim 0, ``None`` for any other
    tensor; ``layer`` is the name up to the experts (``model.layers.3.mlp``)."""
    if is_shared(module):
        return None
    last = module.rpartition(".")[2]
    if gguf_names:
        return ("stacked", module.rpartition(".")[0], 0) if last.endswith("_exps") else None
    found = _EXPERT_INDEX.search(name)
    if found is not None:
        return "one", name[:found.start()], int(found.group(1))
    if last == "experts":            # fused: gpt-oss's experts.gate_up_proj[_blocks]
        return "stacked", module.rpartition(".")[0], 0
    return None


@dataclass
class ExpertParallel:
    """The expert assignment for one N, built while planning: which worker holds each expert,
    and the placement and steps that say so."""

    num_shards: int
    #: experts per layer, for experts stored one per tensor (``count_experts``)
    counts: dict[str, int] = field(default_factory=dict)
    #: num_experts -> each worker's experts (-1: a zero slot), as recorded
    layouts: dict[int, list[list[int]]] = field(default_factory=dict)
    placement: dict[str, list[int]] = field(default_factory=dict)

    def slots(self, num_experts: int) -> list[list[int]]:
        if num_experts not in self.layouts:
            self.layouts[num_experts] = expert_layout(num_experts, self.num_shards)
        return self.layouts[num_experts]

    def place(self, name: str, layer: str, expert: int) -> None:
        """An expert stored on its own goes whole to the worker holding it."""
        count = self.counts[layer]
        owner = next(w for w, held in enumerate(self.slots(count)) if expert in held)
        self.placement[name] = [owner]

    def stacked_step(self, name: str, shape: tuple[int, ...], dtype: str) -> list:
        """The step giving each worker its experts of a tensor stacking them along dim 0."""
        if not shape:
            raise PlanError(f"{name}: a 0-d tensor cannot hold stacked experts")
        slots = self.slots(shape[0])
        out = [self.num_shards, len(slots[0]), *shape[1:]]
        if all(e >= 0 for held in slots for e in held):
            return step_json("shardload.split", out, dtype, (0,))
        return step_json("shardload.take_units", out, dtype,
                         (0, 1, *[e for held in slots for e in held]))

    def metadata(self) -> dict:
        """What an engine needs: each worker's experts, per expert count."""
        return {"mode": "ep", "num_shards": self.num_shards,
                "experts_per_worker": {str(n): slots for n, slots in self.layouts.items()}}


def count_experts(names, gguf_names: bool) -> dict[str, int]:
    """Experts per layer, for experts stored one per tensor: 1 + the highest index, which must
    leave no index out (a missing expert would shift every other's owner)."""
    seen: dict[str, set[int]] = {}
    for name in names:
        kind = expert_kind(name, name.rpartition(".")[0], gguf_names)
        if kind is not None and kind[0] == "one":
            seen.setdefault(kind[1], set()).add(kind[2])
    counts = {}
    for layer, indices in seen.items():
        count = max(indices) + 1
        if len(indices) != count:
            missing = min(set(range(count)) - indices)
            raise PlanError(f"{layer}: the checkpoint has experts up to {count - 1} but none "
                            f"numbered {missing}; every expert must be there to assign them")
        counts[layer] = count
    return counts


__all__ = ["ExpertParallel", "count_experts", "expert_kind", "is_shared", "EXPERT_ROLES",
           "MODES"]
