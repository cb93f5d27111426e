"""The architectures the planner knows: one table row each, naming its tensors' roles.

Every decoder shares the generic planner (``decoder.py``): modules are found by their last name
component in the checkpoint's naming scheme (``naming.py``: ``q_proj`` / ``attn_q`` ...), and
what each role means for splitting is the role object's (``roles.py``). A row here says only
what differs for one architecture; adding a Llama-like one is one row
(``register_architecture``), a structurally new one is its row plus, at most, one new role.

Three tables, one per kind of checkpoint: ``ARCHITECTURES`` (HF ``model_type``),
``GGUF_ARCHITECTURES`` (GGUF ``general.architecture``) and ``MLC_ARCHITECTURES`` (MLC
``model_type``, Llama's rules throughout). ``tests/test_planner_architectures.py`` and
``tests/test_planner_gguf_architectures.py`` check each row against transformers and gguf-py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from ..formats import Axis, TensorAxes
from .naming import GGUF, HF, NamingScheme
from .roles import ROLES, Role

__all__ = [
    "ARCHITECTURES",
    "GGUF_ARCHITECTURES",
    "LLAMA_RULES",
    "MLC_ARCHITECTURES",
    "Architecture",
    "GGUFArchitecture",
    "TensorRule",
    "architecture_tables",
    "register_architecture",
]


@dataclass(frozen=True)
class Architecture:
    """What the planner knows of one HF ``model_type``, beyond what every one of them shares.

    Shared (``decoder.py``): modules are found by their last name component, ``q_proj`` /
    ``k_proj`` / ``v_proj`` / fused ``qkv_proj`` ([q, k, v]) and ``gate_proj`` / ``up_proj`` /
    fused ``gate_up_proj`` ([gate, up]) are column-parallel, ``o_proj`` / ``down_proj``
    row-parallel; query heads split whole, KV heads split whole or are replicated (GQA); every
    other tensor (norms, routers, per-head q/k norms) is replicated, and embeddings and lm_head
    too unless ``vocab_parallel``. Per architecture (this record):

    * ``sizes_under``: the sub-object of config.json holding the language model's sizes
      (``text_config`` for a multimodal config), or ``""`` for the top level;
    * ``defaults``: sizes a config may omit, with the value its transformers config class then
      gives them (real Gemma 3 configs omit ``num_attention_heads`` and more). Every size is
      still checked against the tensors it splits;
    * ``prefixes``: the only tensors the planner splits (those whose names start with one):
      a multimodal checkpoint's language model; the rest (vision tower, projector) is
      replicated. ``()``: every tensor;
    * ``split_norms``: norm modules whose weight is split like the rows of a projection
      (``{"q_norm": "q"}``: OLMo-2 normalises the whole q projection, so each worker holds the
      norm weights of its own q rows) rather than replicated;
    * ``roles``: modules whose role is this architecture's own (DeepSeek's ``q_b_proj`` and
      ``kv_b_proj``: column-parallel in whole heads of their own width, from a low-rank input);
    * ``tensors``: tensors the format-independent rules cannot place, by the last two
      components of their name (gpt-oss's fused ``experts.gate_up_proj_blocks``): their role
      and where N and K lie in them (``TensorRule``);
    * ``experts_size``: the config key of one routed expert's MLP width;
    * ``mla``: multi-head latent attention (DeepSeek-V2/V3): the sizes of ``MLA``;
    * ``note``: what else was checked, for people (``docs/planner.md`` prints the table);
    * ``naming``: how the checkpoint names its tensors (``naming.HF``; GGUF rows ``naming.GGUF``).
    """

    model_type: str
    note: str = ""
    sizes_under: str = ""
    defaults: Mapping[str, int] = field(default_factory=dict)
    prefixes: tuple[str, ...] = ()
    split_norms: Mapping[str, str] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)
    tensors: Mapping[str, TensorRule] = field(default_factory=dict)
    experts_size: str = "moe_intermediate_size"
    mla: bool = False
    naming: NamingScheme = field(default=HF, compare=False)

    def in_model(self, name: str) -> bool:
        """Whether the tensor ``name`` belongs to the model the planner splits."""
        return not self.prefixes or name.startswith(self.prefixes)

    def tensor_rule(self, name: str) -> TensorRule | None:
        """This architecture's own rule for the tensor ``name`` (``tensors``), if any."""
        if not self.tensors:
            return None
        return self.tensors.get(".".join(name.rsplit(".", 2)[-2:]))

    def role_of(self, name: str) -> Role | None:
        """The role of the tensor ``name`` (``model.layers.0.self_attn.q_proj.weight`` -> q),
        or ``None``: replicated. Only tensors of the model the architecture splits have one
        (``prefixes``: a multimodal checkpoint's language model)."""
        if not self.in_model(name):
            return None
        rule = self.tensor_rule(name)
        if rule is not None:
            return ROLES[rule.role]
        last = name.rpartition(".")[0].rpartition(".")[2]
        projection = self.split_norms.get(last)
        if projection is not None:
            return ROLES[f"{projection}_norm"]
        found = self.roles.get(last) or self.naming.base_role(last)
        return None if found is None else ROLES[found]


@dataclass(frozen=True)
class TensorRule:
    """An architecture's own tensor: its role (a name in ``roles.ROLES``) and where the
    layer's N and K lie in it. A fused expert tensor keeps its experts along dim 0."""

    role: str
    axes: TensorAxes


def _gpt_oss_experts() -> dict[str, TensorRule]:
    """gpt-oss keeps each layer's experts fused, ``gate_up`` interleaved (gate rows even, up
    rows odd: one MLP row is two stored rows, so whole MLP rows keep each pair together).
    bf16: ``gate_up_proj`` [E, hidden, 2 x inter] and ``down_proj`` [E, inter, hidden] (K
    first); MXFP4 (the published checkpoints): ``*_blocks`` [E, rows, K / 32, 16] bytes of two
    E2M1 codes and ``*_scales`` [E, rows, K / 32] E8M0 exponents, one per 32 of K. Biases
    [E, rows]: ``down_proj_bias`` is added after the row-parallel sum, so it is replicated."""
    pair, group = Axis(1, 1, 2), Axis(2, 32)
    return {
        "experts.gate_up_proj": TensorRule("gate", TensorAxes(Axis(2, 1, 2), Axis(1))),
        "experts.gate_up_proj_bias": TensorRule("gate", TensorAxes(pair, None)),
        "experts.gate_up_proj_blocks": TensorRule("gate", TensorAxes(pair, group)),
        "experts.gate_up_proj_scales": TensorRule("gate", TensorAxes(pair, group)),
        "experts.down_proj": TensorRule("down", TensorAxes(Axis(2), Axis(1))),
        "experts.down_proj_bias": TensorRule("down", TensorAxes(Axis(1), None)),
        "experts.down_proj_blocks": TensorRule("down", TensorAxes(Axis(1), group)),
        "experts.down_proj_scales": TensorRule("down", TensorAxes(Axis(1), group)),
        # one attention sink (a learned logit) per query head
        "self_attn.sinks": TensorRule("sinks", TensorAxes(Axis(0), None)),
    }


_DEEPSEEK = (
    "MLA: q_a_proj, kv_a_proj_with_mqa and their norms replicated (the latent is "
    "shared by every head); q_proj / q_b_proj split in whole heads of qk_nope + "
    "qk_rope, kv_b_proj in whole heads of qk_nope + v_head_dim, o_proj's K in heads "
    "of v_head_dim; routed experts, shared experts (moe_intermediate_size x "
    "n_shared_experts) and the first_k_dense_replace dense MLPs split; router and "
    "e_score_correction_bias replicated"
)
_DEEPSEEK_ROLES = {"q_b_proj": "q_b", "kv_b_proj": "kv_b"}

#: transformers' ``Gemma3TextConfig`` defaults for the sizes (its ``__init__`` signature):
#: Gemma 3's multimodal configs (gemma-3-4b-it) leave them out of ``text_config``
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}

_GEMMA = (
    "pre/post-feedforward layernorms replicated; head_dim explicit (not hidden / heads); "
    "tied embeddings (no lm_head tensor)"
)

#: Every HF ``model_type`` the planner knows, and what it knows of each (checked against
#: transformers' modeling code: ``tests/test_planner_architectures.py`` saves a tiny model of each
#: with transformers and compares every shard, and the column/row roles with each config
#: class's ``base_model_tp_plan``)
ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("llama"),
        Architecture("mistral"),
        Architecture(
            "mixtral",
            "experts' w1/w3 column-, w2 row-parallel; router replicated",
            experts_size="intermediate_size",
        ),
        Architecture("qwen2", "q/k/v biases split with their rows"),
        Architecture("qwen3", "per-head q_norm/k_norm (head_dim wide) replicated"),
        Architecture("qwen2_moe", "experts and shared expert split; routers replicated"),
        Architecture("qwen3_moe", "experts split; routers, per-head q/k norms replicated"),
        Architecture("gemma2", _GEMMA),
        Architecture(
            "gemma3_text",
            _GEMMA + "; per-head q_norm/k_norm replicated",
            defaults=GEMMA3_TEXT_DEFAULTS,
        ),
        Architecture(
            "gemma3",
            "multimodal Gemma 3: the language model (model.language_model.* "
            "or language_model.model.*) is split as gemma3_text, sizes from "
            "text_config; vision tower and projector replicated",
            sizes_under="text_config",
            defaults=GEMMA3_TEXT_DEFAULTS,
            prefixes=("model.language_model.", "language_model.", "lm_head."),
        ),
        Architecture(
            "phi3",
            "Phi-3 / Phi-4: fused qkv_proj [q, k, v] and gate_up_proj "
            "[gate, up], each segment split on its own",
        ),
        Architecture(
            "olmo2",
            "q_norm/k_norm normalise the whole q/k projection: split like the "
            "q rows (whole query heads) and k rows (whole KV heads, GQA replication)",
            split_norms={"q_norm": "q", "k_norm": "k"},
        ),
        Architecture(
            "granite",
            "Llama-shaped; embedding/residual/attention multipliers and "
            "logits_scaling are forward-only",
        ),
        Architecture(
            "gpt_oss",
            "fused experts (bf16, or MXFP4 *_blocks/*_scales as published): "
            "gate_up interleaved, split in whole MLP rows (pairs), MXFP4 in whole "
            "32-element groups; q/k/v biases and attention sinks split with their heads; "
            "o_proj and down_proj biases, router replicated",
            tensors=_gpt_oss_experts(),
            experts_size="intermediate_size",
        ),
        Architecture("deepseek_v2", _DEEPSEEK, roles=_DEEPSEEK_ROLES, mla=True),
        Architecture("deepseek_v3", _DEEPSEEK, roles=_DEEPSEEK_ROLES, mla=True),
    )
}
#: the rules of a model known by its tensor names alone (MLC)
LLAMA_RULES = ARCHITECTURES["llama"]


@dataclass(frozen=True)
class GGUFArchitecture(Architecture):
    """What the planner knows of one GGUF ``general.architecture``: tensors are found by the
    last component of their name before ``.weight`` (``blk.0.attn_q`` -> ``attn_q``), with the
    roles of ``naming.GGUF``; ``split_norms`` as for HF, by GGUF name; ``roles``: names
    whose role differs in this architecture (Phi-3's ``ffn_up`` holds [gate, up]).

    The names are gguf-py's (``MODEL_TENSORS[arch]``, ``TensorNameMap``); what each holds
    (fused, whole-projection norms) is not in gguf-py, so it is written here from llama.cpp's
    converter and loader, and ``tests/test_planner_gguf_architectures.py`` checks every tensor
    gguf-py lists for each architecture has the role it should. llama.cpp's converter permutes
    the q/k rows (rotary pairs) of ``LlamaModel``-derived architectures (llama, granite) within each
    head, and stores gemma2, gemma3, phi3 and olmo2 rows as HF has them: head-aligned splits
    take the same rows either way.
    """

    naming: NamingScheme = field(default=GGUF, compare=False)


_GGUF_GEMMA = (
    "post_attention_norm / post_ffw_norm replicated; head size from "
    "key_length; tied embeddings (no output tensor)"
)

#: every GGUF ``general.architecture`` the planner knows
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    a.model_type: a
    for a in (
        GGUFArchitecture("llama"),
        GGUFArchitecture("mistral"),
        GGUFArchitecture("qwen2"),
        GGUFArchitecture("qwen3", "per-head attn_q_norm/attn_k_norm replicated"),
        GGUFArchitecture("qwen2moe"),
        GGUFArchitecture("qwen3moe"),
        GGUFArchitecture("gemma2", _GGUF_GEMMA),
        GGUFArchitecture(
            "gemma3",
            _GGUF_GEMMA + "; per-head attn_q_norm/attn_k_norm replicated "
            "(the vision tower is a separate mmproj file)",
        ),
        GGUFArchitecture(
            "phi3",
            "fused attn_qkv [q, k, v]; ffn_up holds [gate, up] (llama.cpp: "
            "2 x feed_forward_length rows, no ffn_gate), each segment split on its own",
            roles={"ffn_up": "gate_up"},
        ),
        GGUFArchitecture(
            "olmo2",
            "attn_q_norm/attn_k_norm normalise the whole q/k projection: "
            "split like the q rows and k rows",
            split_norms={"attn_q_norm": "q", "attn_k_norm": "k"},
        ),
        GGUFArchitecture("granite", "Llama-shaped; its scales are forward-only"),
        GGUFArchitecture(
            "gpt-oss",
            "llama.cpp stores gate and up de-interleaved (ffn_gate_exps, "
            "ffn_up_exps) in MXFP4 blocks; expert biases [E, rows] split with their "
            "rows (ffn_down_exps' replicated); attn_sinks split with the query heads",
            roles={"attn_sinks": "sinks"},
        ),
    )
}
#: MLC model_type values whose layers are Llama-shaped (attention + gated MLP, optional MoE):
#: planned by Llama's rules, from the names alone
MLC_ARCHITECTURES: dict[str, Architecture] = {
    t: LLAMA_RULES
    for t in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
}


def architecture_tables() -> dict[str, dict[str, Architecture]]:
    """The three tables, by the kind of checkpoint they are for (for help text and docs)."""
    # the GGUF table holds GGUFArchitecture rows: register_architecture puts them there
    gguf = cast(dict[str, Architecture], GGUF_ARCHITECTURES)
    return {"hf": ARCHITECTURES, "gguf": gguf, "mlc": MLC_ARCHITECTURES}


def register_architecture(
    arch: Architecture, *, kind: str | None = None, override: bool = False
) -> Architecture:
    """Add a row to the table of its kind (``hf`` for an ``Architecture``, ``gguf`` for a
    ``GGUFArchitecture``; ``mlc`` must be asked for): a Llama-like architecture is one row.
    A taken name is refused unless ``override``.

    >>> register_architecture(Architecture("my_llama", "Llama with another name"))  # doctest: +SKIP
    """
    kind = kind or ("gguf" if isinstance(arch, GGUFArchitecture) else "hf")
    table = architecture_tables()[kind]
    if arch.model_type in table and table[arch.model_type] is not arch and not override:
        raise ValueError(
            f"{kind} architecture {arch.model_type!r} is already known; pass "
            "override=True to replace it"
        )
    for name in (*arch.roles.values(), *(rule.role for rule in arch.tensors.values())):
        if name not in ROLES:
            raise ValueError(
                f"architecture {arch.model_type!r} names the role {name!r}, which "
                f"is not one of {', '.join(ROLES)}"
            )
    table[arch.model_type] = arch
    return arch


def unregister_architecture(model_type: str, kind: str = "hf") -> None:
    """Remove a row (tests)."""
    architecture_tables()[kind].pop(model_type, None)
