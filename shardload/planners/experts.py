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

An EP plan is for one N (the placement names workers). Which tensors hold routed experts, and
how, is the naming scheme's (``naming.NamingScheme.expert_kind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PlanError
from ..plan import step_json
from ..tp_layout import expert_layout

MODES = ("tp", "ep")


@dataclass
class ExpertParallel:
    """The expert assignment for one N, built while planning: which worker holds each expert,
    and the placement and steps that say so."""

    num_shards: int
    #: experts per layer, for experts stored one per tensor (``NamingScheme.count_experts``)
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
        return step_json(
            "shardload.take_units", out, dtype, (0, 1, *[e for held in slots for e in held])
        )

    def metadata(self) -> dict:
        """What an engine needs: each worker's experts, per expert count."""
        return {
            "mode": "ep",
            "num_shards": self.num_shards,
            "experts_per_worker": {str(n): slots for n, slots in self.layouts.items()},
        }


__all__ = ["MODES", "ExpertParallel"]
