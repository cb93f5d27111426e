"""How a checkpoint names its tensors: Hugging Face's names or GGUF's, as objects.

A naming scheme knows, from a tensor's name alone:

* the **role** its module's last name component has (``q_proj`` -> ``q``, ``attn_q`` -> ``q``),
  before an architecture's own overrides (``architectures.Architecture.role_of``);
* which **MLP** a module belongs to (``mlp_kind``): a dense MLP, the routed experts, or a shared
  expert (always tensor-parallel);
* whether a tensor holds **routed experts** and how (``expert_kind``): one expert per tensor
  (``mlp.experts.7.gate_proj.weight``) or stacked along dim 0 (GGUF's ``ffn_gate_exps``,
  gpt-oss's fused ``experts.gate_up_proj``).

MLC checkpoints use Hugging Face's names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import PlanError

__all__ = ["GGUF", "HF", "ExpertKind", "NamingScheme"]

#: ``("one", layer, e)`` for a tensor of routed expert ``e`` stored on its own, ``("stacked",
#: layer, 0)`` for routed experts stacked along dim 0; ``layer`` is the name up to the experts
ExpertKind = tuple[str, str, int]

#: the index of an expert stored on its own: ``....experts.7.gate_proj.weight``
_EXPERT_INDEX = re.compile(r"\.experts\.([0-9]{1,9})\.")


class NamingScheme:
    """One way of naming tensors. ``roles``: a module's last name component -> its role."""

    name: str = ""
    roles: dict[str, str] = {}
    #: substrings marking a shared expert's module, and a routed experts' module
    shared_marks: tuple[str, ...] = ()
    expert_marks: tuple[str, ...] = ()

    def base_role(self, last: str) -> str | None:
        return self.roles.get(last)

    def is_shared(self, module: str) -> bool:
        """A shared expert (always tensor-parallel): Qwen's ``shared_expert``, DeepSeek's
        ``shared_experts``, GGUF's ``*_shexp``."""
        return any(mark in module for mark in self.shared_marks)

    def mlp_kind(self, module: str) -> str:
        """``shared``, ``experts`` or ``dense``: which MLP the module ``module`` is part of."""
        if self.is_shared(module):
            return "shared"
        if any(mark in module for mark in self.expert_marks):
            return "experts"
        return "dense"

    def expert_kind(self, name: str, module: str) -> ExpertKind | None:
        raise NotImplementedError

    def count_experts(self, names: Iterable[str]) -> dict[str, int]:
        """Experts per layer, for experts stored one per tensor: 1 + the highest index, which
        must leave no index out (a missing expert would shift every other's owner)."""
        seen: dict[str, set[int]] = {}
        for name in names:
            kind = self.expert_kind(name, name.rpartition(".")[0])
            if kind is not None and kind[0] == "one":
                seen.setdefault(kind[1], set()).add(kind[2])
        counts = {}
        for layer, indices in seen.items():
            count = max(indices) + 1
            if len(indices) != count:
                missing = min(set(range(count)) - indices)
                raise PlanError(
                    f"{layer}: the checkpoint has experts up to {count - 1} but "
                    f"none numbered {missing}; every expert must be there to assign "
                    "them"
                )
            counts[layer] = count
        return counts

    def __repr__(self) -> str:
        return f"<{self.name} tensor names>"


class HFNames(NamingScheme):
    """Hugging Face's (and MLC's): ``model.layers.0.self_attn.q_proj.weight``."""

    name = "hf"
    roles = {
        "q_proj": "q",
        "k_proj": "k",
        "v_proj": "v",
        "qkv_proj": "qkv",
        "o_proj": "o",
        "gate_proj": "gate",
        "up_proj": "up",
        "gate_up_proj": "gate_up",
        "down_proj": "down",
        "w1": "gate",
        "w3": "up",
        "w2": "down",
        "embed_tokens": "embed",
        "lm_head": "lm_head",
    }
    shared_marks = ("shared_expert",)
    expert_marks = ("experts",)

    def expert_kind(self, name, module):
        if self.is_shared(module):
            return None
        found = _EXPERT_INDEX.search(name)
        if found is not None:
            return "one", name[: found.start()], int(found.group(1))
        if module.rpartition(".")[2] == "experts":  # fused: gpt-oss's experts.gate_up_proj
            return "stacked", module.rpartition(".")[0], 0
        return None


class GGUFNames(NamingScheme):
    """llama.cpp's (gguf-py's ``MODEL_TENSORS``): ``blk.0.attn_q.weight``."""

    name = "gguf"
    roles = {
        "attn_q": "q",
        "attn_k": "k",
        "attn_v": "v",
        "attn_qkv": "qkv",
        "attn_output": "o",
        "ffn_gate": "gate",
        "ffn_up": "up",
        "ffn_down": "down",
        "ffn_gate_exps": "gate",
        "ffn_up_exps": "up",
        "ffn_down_exps": "down",
        "ffn_gate_up_exps": "gate_up",
        "ffn_gate_shexp": "gate",
        "ffn_up_shexp": "up",
        "ffn_down_shexp": "down",
        "token_embd": "embed",
        "output": "lm_head",
    }
    shared_marks = ("shexp",)
    expert_marks = ("_exps",)

    def expert_kind(self, name, module):
        if self.is_shared(module):
            return None
        if module.rpartition(".")[2].endswith("_exps"):
            return "stacked", module.rpartition(".")[0], 0
        return None


HF = HFNames()
GGUF = GGUFNames()
