"""The Llama-family planner: which tensors split along which axis, in which units.

Column-parallel layers (q, k, v, gate, up, and their fused forms) split their output rows N;
row-parallel layers (o, down) split their input columns K. Attention splits in whole heads:
query heads are never replicated, KV heads are replicated to the workers whose query heads use
them when the workers outnumber them (GQA, MQA). Every stored tensor of a layer gets the same
logical split, converted into its own units (``layouts.py``). Each such split is recorded as a
``fit.Constraint`` (its units, what they are and which keys say so), so the planner knows,
for every tensor group, which N it allows without binding its plan: a split that would cut a
head, a packed word, a quantization group or a GGUF block is a constraint that N breaks
(``Planned.constraints``). For an N the heads or the MLP do not divide, ``padding_layout``
says whether zero-padding can be exact, and how. Norms, routers and everything unknown are
replicated; embeddings and lm_head too, unless ``vocab_parallel``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Union

from ..errors import FormatError, PlanError
from ..plan import step_json
from ..readers.base import Checkpoint
from .experts import EXPERT_ROLES, ExpertParallel, expert_kind
from .fit import Constraint, Constraints
from .layouts import Axis, Scheme, TensorAxes, tensor_axes
from .model import ModelSpec
from .tp_layout import MAX_LAYOUT, HeadLayout, head_layout, unit_layout

# last component of a module name -> role
HF_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "qkv_proj": "qkv", "o_proj": "o",
            "gate_proj": "gate", "up_proj": "up", "gate_up_proj": "gate_up", "down_proj": "down",
            "w1": "gate", "w3": "up", "w2": "down", "embed_tokens": "embed", "lm_head": "lm_head"}
GGUF_ROLES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_qkv": "qkv", "attn_output": "o",
              "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down", "ffn_gate_exps": "gate",
              "ffn_up_exps": "up", "ffn_down_exps": "down", "ffn_gate_up_exps": "gate_up",
              "ffn_gate_shexp": "gate",
              "ffn_up_shexp": "up", "ffn_down_shexp": "down", "token_embd": "embed",
              "output": "lm_head"}
#: norms split like the rows of a projection (``Architecture.split_norms``: OLMo-2's q_norm and
#: k_norm, which normalise the whole projection): role -> the projection's role
NORM_OF = {"q_norm": "q", "k_norm": "k"}
#: roles of ``Architecture.roles`` / ``.tensors``: DeepSeek's MLA ``q_b_proj`` (query heads,
#: from the q latent) and ``kv_b_proj`` (key-and-value heads, from the kv latent); gpt-oss's
#: attention ``sinks`` (one value per query head)
ARCH_ROLES = {"q_b", "kv_b", "sinks"}
COLUMN = {"q", "k", "v", "qkv", "gate", "up", "gate_up", *NORM_OF, *ARCH_ROLES}
ROW = {"o", "down"}
#: roles whose units are attention heads
HEAD_ROLES = {"q", "k", "v", "qkv", "o", *NORM_OF, *ARCH_ROLES}

Segments = list[tuple[int, int]]   # (logical size, units); units < 0: replicable (KV heads)


def module_role(name: str, spec: ModelSpec, gguf_names: bool) -> Optional[str]:
    """The role of the tensor ``name`` (``model.layers.0.self_attn.q_proj.weight`` -> ``q``),
    or ``None``: replicated. Only tensors of the model the architecture splits have one
    (``Architecture.prefixes``: a multimodal checkpoint's language model)."""
    module = name.rpartition(".")[0]
    last = module.rpartition(".")[2]
    if gguf_names:   # model.GGUF_ARCHITECTURES: split norms and roles of this architecture
        norm_of = spec.rules.split_norms.get(last)
        if norm_of is not None:
            return f"{norm_of}_norm"
        return spec.rules.roles.get(last, GGUF_ROLES.get(last))
    rules = spec.rules
    if not rules.in_model(name):
        return None
    rule = tensor_rule(name, spec)
    if rule is not None:
        return rule.role
    projection = rules.split_norms.get(last)
    if projection is not None:
        return f"{projection}_norm"
    return rules.roles.get(last, HF_ROLES.get(last))


def tensor_rule(name: str, spec: ModelSpec):
    """The architecture's own rule for the tensor ``name`` (``Architecture.tensors``), if any."""
    if not spec.rules.tensors:
        return None
    return spec.rules.tensors.get(".".join(name.rsplit(".", 2)[-2:]))


def _role_axes(scheme: Scheme, role: str, name: str, meta, fmt: Optional[dict],
               spec: ModelSpec) -> Optional[TensorAxes]:
    """Where N and K lie in a tensor of a layer with ``role``: as the architecture's own rule
    says; a split norm's ``weight`` is one vector along N (never quantized); anything else as
    its format stores it."""
    rule = tensor_rule(name, spec)
    if rule is not None:
        return rule.axes
    suffix = name.rpartition(".")[2]
    if role in NORM_OF or role == "sinks":     # one vector over the heads' rows
        return TensorAxes(Axis(0), None) if suffix == "weight" else None
    return tensor_axes(scheme, suffix, meta, fmt)


@dataclass(frozen=True)
class Padding:
    """A layout for one N that the heads or the MLP do not divide: zero heads and zero MLP
    blocks fill every worker up to the same size (``tp_layout.py``)."""

    num_shards: int
    heads: HeadLayout
    mlp_unit: int                              # logical MLP rows per block
    mlp: dict[int, list[list[int]]]            # intermediate size -> blocks per worker

    def metadata(self, spec: ModelSpec) -> dict:
        """What an engine needs to run the padded shards (recorded in the plan)."""
        meta = {"num_shards": self.num_shards, "head_dim": spec.head_dim,
                **self.heads.as_dict(), "mlp_block": self.mlp_unit,
                "mlp_blocks": {str(k): v for k, v in self.mlp.items()}}
        if spec.mla is not None:
            # MLA: heads of other widths in kv_b_proj and o_proj than head_dim (q's)
            meta["mla"] = {"qk_nope_head_dim": spec.mla.qk_nope_head_dim,
                           "qk_rope_head_dim": spec.mla.qk_rope_head_dim,
                           "v_head_dim": spec.v_head_dim, "kv_lora_rank": spec.mla.kv_lora_rank,
                           "q_lora_rank": spec.mla.q_lora_rank}
        if spec.rules.split_norms:
            # OLMo-2: these norms' mean runs over the whole, unpadded projection (padded rows
            # are zero and add nothing to the sum of squares; divide by this width)
            meta["projection_norms"] = {
                norm: spec.q_size if role == "q" else spec.kv_size
                for norm, role in spec.rules.split_norms.items()}
        return meta


@dataclass
class Planned:
    """A plan in the making: steps by tensor, what the planner noticed, and (for a plan
    symbolic in num_shards) the constraints its splits put on N."""

    steps: dict[str, list] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)
    #: expert parallelism: tensors of experts held whole by one worker (``experts.py``)
    placed: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    constraints: Constraints = field(default_factory=Constraints)


def _intermediate_attr(spec: ModelSpec, module: str) -> str:
    """Which of the spec's MLP sizes the module ``module`` has."""
    if "shexp" in module or "shared_expert" in module:
        return "shared_expert_intermediate_size"
    if ("experts" in module or "_exps" in module) and spec.moe_intermediate_size:
        return "moe_intermediate_size"
    return "intermediate_size"


def _intermediate(spec: ModelSpec, module: str) -> int:
    attr = _intermediate_attr(spec, module)
    size = getattr(spec, attr)
    if not size:
        raise PlanError(f"{module}: the model config gives no intermediate size for it "
                        f"({spec.keys.get(attr, attr)} is absent)", source=spec.file or None)
    return size


# ---- the metadata must agree with the tensors it is applied to ---------------------------------
#
# The planner splits each tensor by sizes read from the metadata (heads x head_dim, the MLP
# size, the vocabulary, the hidden size, the quantization's bits and groups). Where they disagree
# with a tensor's own shape, a plan would cut it in the wrong places and the load would still
# succeed: silent corruption. So, as llama.cpp does when it loads a model, every such size is
# checked against every tensor it is applied to, and a disagreement is refused, naming the
# tensor, its shape and the keys. The one size that is only a hint is a GGUF's absent
# ``<arch>.vocab_size``: the vocabulary is then the embeddings' rows (``vocab_from_tensors``).

Extent = tuple[int, str]      # a logical size along one axis, and where it came from

#: stored tensors holding a layer's quantization groups along K (one row or column per group)
_GROUP_TENSORS = {"scales", "qzeros", "weight_scale", "weight_zero_point"}
#: the formats whose ``group_size`` is a group of K (one scale per ``group_size`` inputs)
_GROUPED = ("gptq", "awq", "pack-quantized", "int-quantized", "nvfp4", "mxfp4",
            "modelopt-nvfp4")


def _extents(role: str, spec: ModelSpec, module: str) -> tuple[Extent, Extent]:
    """(output features N, input features K) of a layer, each with its provenance."""
    hidden = (spec.hidden_size, spec.explain("hidden_size"))
    heads = f"{spec.explain('num_heads')} heads of {spec.explain('head_dim')}"
    kv_heads = f"{spec.explain('num_kv_heads')} heads of {spec.explain('head_dim')}"
    value_attr = "value_head_dim" if spec.value_head_dim else "head_dim"
    v_heads = f"{spec.explain('num_kv_heads')} heads of {spec.explain(value_attr)}"
    o_heads = f"{spec.explain('num_heads')} heads of {spec.explain(value_attr)}"
    q, kv = (spec.q_size, heads), (spec.kv_size, kv_heads)
    v = (spec.num_kv_heads * spec.v_head_dim, v_heads)
    if role in ("gate", "up", "down", "gate_up"):
        attr = _intermediate_attr(spec, module)
        inter = (getattr(spec, attr), spec.explain(attr))
        if role == "down":
            return hidden, inter
        if role == "gate_up":
            return (2 * inter[0], f"2 x {inter[1]}"), hidden
        return inter, hidden
    if role in ("embed", "lm_head"):
        return (spec.vocab_size, spec.explain("vocab_size")), hidden
    if role in NORM_OF:      # a vector over the projection's rows: no input features
        return {"q": q, "k": kv}[NORM_OF[role]], (0, "")
    if role == "sinks":      # one value per query head
        return (spec.num_heads, spec.explain("num_heads")), (0, "")
    if role in ("q_b", "kv_b"):     # MLA: from the q or kv latent
        mla = spec.mla
        assert mla is not None, "q_b and kv_b are MLA roles"
        if role == "q_b":
            return q, (mla.q_lora_rank, repr("q_lora_rank"))
        width = mla.qk_nope_head_dim + spec.v_head_dim
        return ((spec.num_heads * width, f"{spec.explain('num_heads')} heads of "
                 f"'qk_nope_head_dim' + 'v_head_dim' = {width}"),
                (mla.kv_lora_rank, repr("kv_lora_rank")))
    if role == "o":
        return hidden, (spec.num_heads * spec.v_head_dim, o_heads)
    if role == "qkv":
        return (q[0] + kv[0] + v[0], f"{heads}, plus {kv_heads}, plus {v_heads}"), hidden
    return {"q": q, "k": kv, "v": v}[role], hidden


def _packing(axis: Axis, scheme: Scheme, fmt: Optional[dict], spec: ModelSpec) -> str:
    """How the tensor stores the axis, when not one element per unit, and the keys saying so."""
    if axis.elems == 1 and axis.width == 1:
        return ""
    stored = (f"{axis.elems} per stored unit" if axis.width == 1
              else f"{axis.elems} per {axis.width} stored units")
    if scheme.method == "gguf":
        return f", {stored} ({(fmt or {}).get('ggml_type', 'quantized')} blocks)"
    how = scheme.explain("bits", "group_size", "block")
    if not how:
        return f", {stored}"
    source = scheme.source
    return f", {stored} ({how}{f' in {source}' if source and source != spec.file else ''})"


def check_shapes(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, *,
                 gguf_names: bool) -> None:
    """``FormatError`` unless every size the planner will use agrees with the shape of every
    tensor it is applied to (see above). Reads no tensor data, but for compressed-tensors'
    two-element ``weight_shape`` tensors."""
    planned = 0
    for name, meta in ckpt.metadata().items():
        module, _, suffix = name.rpartition(".")
        role = module_role(name, spec, gguf_names)
        if role is None:
            continue
        planned += 1
        fmt = ckpt.tensor_format(name)
        axes = _role_axes(scheme, role, name, meta, fmt, spec)
        if axes is None:
            continue
        (n_out, n_why), (k_in, k_why) = _extents(role, spec, module)

        def refuse(message: str) -> FormatError:
            return FormatError(message, file=spec.file or None, tensor=name)

        if role in NORM_OF and len(meta.shape) != 1:
            raise refuse(f"has shape {list(meta.shape)}: a {spec.architecture} "
                         f"{module.rpartition('.')[2]} weight is one vector over the "
                         f"projection's {n_out} rows ({n_why}), so it must be [{n_out}]")

        disagree = ("; the metadata and the tensors must agree, or the plan would cut the "
                    "tensors in the wrong places")

        if axes.special == "shape":
            values = [int(v) for v in ckpt.read(name).reshape(-1).tolist()]
            if values != [n_out, k_in] and n_out and k_in:
                raise refuse(f"holds the weight shape {values}, but the metadata gives "
                             f"[{n_out}, {k_in}]: {n_out} output features ({n_why}) and "
                             f"{k_in} input features ({k_why}){disagree}")
            continue
        for axis, size, why, what in ((axes.n, n_out, n_why, "output features"),
                                      (axes.k, k_in, k_why, "input features")):
            if axis is None or not size:
                continue        # not held by this tensor, or a size the metadata lacks
            want = -(-size // axis.elems) * axis.width
            got = meta.shape[axis.dim] if axis.dim < len(meta.shape) else None
            if got != want:
                found = "none" if got is None else got
                raise refuse(f"has shape {list(meta.shape)}, which disagrees with the metadata: "
                             f"its dim {axis.dim} holds the layer's {what}, {size} by "
                             f"{why}{_packing(axis, scheme, fmt, spec)}, so it must be {want}, "
                             f"not {found}{disagree}")
        group = scheme.group_size
        if (axes.k is not None and suffix in _GROUP_TENSORS and group > 0 and k_in
                and scheme.method in _GROUPED and k_in % group):
            raise refuse(f"is quantized in groups of {scheme.explain('group_size')}, which do "
                         f"not tile the layer's {k_in} input features ({k_why}); the group size "
                         "must divide them")
    if spec.rules.prefixes and not gguf_names and not planned:
        raise PlanError(f"model_type {spec.architecture!r} keeps its language model's tensors "
                        f"under {', '.join(map(repr, spec.rules.prefixes))}, and the checkpoint "
                        "has no projection or embedding there: nothing to split",
                        source=spec.file or None)
    if spec.v_head_dim != spec.head_dim and spec.mla is None:
        raise PlanError(f"value heads of {spec.explain('value_head_dim')} differ from the key "
                        f"heads of {spec.explain('head_dim')}: attention with value heads of "
                        "another width is not supported by the planner", source=spec.file or None)


def vocab_from_tensors(ckpt: Checkpoint, spec: ModelSpec, *, gguf_names: bool) -> ModelSpec:
    """``spec`` with the vocabulary taken from the embeddings' rows where the metadata gives
    none (a GGUF without ``<arch>.vocab_size``); unchanged otherwise."""
    if spec.vocab_size:
        return spec
    for name, meta in ckpt.metadata().items():
        if module_role(name, spec, gguf_names) in ("embed", "lm_head") and meta.shape:
            keys = dict(spec.keys)
            keys["vocab_size"] = (f"{keys.get('vocab_size', 'vocab_size')} (absent, so the "
                                  f"rows of {name})")
            return dataclasses.replace(spec, vocab_size=meta.shape[0], keys=keys)
    return spec


def _kv_b_width(spec: ModelSpec) -> int:
    """MLA: one head of ``kv_b_proj``'s output, its key part and its value."""
    assert spec.mla is not None
    return spec.mla.qk_nope_head_dim + spec.v_head_dim


def segments_for(role: str, spec: ModelSpec, module: str) -> Segments:
    """The logical split of a layer along the axis its role splits."""
    role = NORM_OF.get(role, role)
    if role in ("q", "q_b"):
        return [(spec.q_size, spec.num_heads)]
    if role == "o":
        return [(spec.num_heads * spec.v_head_dim, spec.num_heads)]
    if role == "sinks":
        return [(spec.num_heads, spec.num_heads)]
    if role == "kv_b":
        return [(spec.num_heads * _kv_b_width(spec), spec.num_heads)]
    if role in ("k", "v"):
        return [(spec.kv_size, -spec.num_kv_heads)]
    if role == "qkv":
        return [(spec.q_size, spec.num_heads), (spec.kv_size, -spec.num_kv_heads),
                (spec.kv_size, -spec.num_kv_heads)]
    if role in ("gate", "up", "down"):
        size = _intermediate(spec, module)
        return [(size, size)]
    if role == "gate_up":
        size = _intermediate(spec, module)
        return [(size, size), (size, size)]
    if role in ("embed", "lm_head"):
        return [(spec.vocab_size, spec.vocab_size)]
    raise AssertionError(role)


def segment_labels(role: str, spec: ModelSpec, module: str) -> list[str]:
    """What the units of each of ``segments_for``'s segments are, with the keys saying so."""
    role = NORM_OF.get(role, role)
    if role in ("q", "o", "k", "v", "qkv", *ARCH_ROLES):
        heads = f"the {spec.num_heads} query heads ({spec.explain('num_heads')})"
        kv = f"the {spec.num_kv_heads} KV heads ({spec.explain('num_kv_heads')})"
        if role in ARCH_ROLES or role in ("q", "o"):
            return [heads]
        return {"k": [kv], "v": [kv], "qkv": [heads, kv, kv]}[role]
    if role in ("gate", "up", "down", "gate_up"):
        attr = _intermediate_attr(spec, module)
        label = f"the {_intermediate(spec, module)} MLP rows ({spec.explain(attr)})"
        return [label] * (2 if role == "gate_up" else 1)
    if role in ("embed", "lm_head"):
        return [f"the {spec.vocab_size} vocabulary rows ({spec.explain('vocab_size')})"]
    raise AssertionError(role)


@dataclass(frozen=True)
class _Group:
    """The tensor being planned, for the constraints its split puts on N: its name, what its
    logical segments are, and how its quantization stores them."""

    name: str
    labels: list[str]
    paddable: bool
    held: str                       # " ('quantization_config.bits' = 4, ...)", " (Q4_K blocks)"
    constraints: Constraints

    def note(self, segments: Segments, in_units: Segments, axis: Axis) -> None:
        """One constraint per segment, in the units the tensor stores it in."""
        for (size, logical), (_, units), label in zip(segments, in_units, self.labels):
            blocks = size // axis.elems
            if units == logical:
                stored = ""
            elif abs(units) == blocks:
                stored = f"stored in {blocks} blocks of {axis.elems}{self.held}"
            else:   # units grouped until they fill whole blocks (llama._in_units)
                stored = (f"stored in {blocks} blocks of {axis.elems}{self.held}, so split in "
                          f"{abs(units)} groups of {abs(logical) // abs(units)} that fill "
                          f"{blocks // abs(units)} whole blocks each")
            self.constraints.add(Constraint(abs(units), units < 0, label, self.name,
                                            self.paddable, stored))

    def note_rows(self, rows: int, segments: Segments) -> None:
        """A tensor split in whole rows of the layer's input (GPTQ's g_idx)."""
        in_rows = len(segments) == 1 and tuple(segments[0]) == (rows, rows)   # MLP rows
        label = self.labels[0] if in_rows else f"the {rows} input rows of the layer"
        self.constraints.add(Constraint(rows, False, label, self.name, self.paddable))


def _held(scheme: Scheme, fmt: Optional[dict]) -> str:
    """How the tensor's quantization stores its elements in blocks, for messages."""
    if scheme.method == "gguf":
        return f" ({(fmt or {}).get('ggml_type', 'quantized')} blocks)"
    how = scheme.explain("bits", "group_size", "block")
    return f" ({how})" if how else ""


def _in_units(segments: Segments, axis: Axis, tensor: str) -> Segments:
    """The logical segments in the tensor's own units along ``axis``.

    A unit (a head) that is a whole number of the tensor's blocks keeps its count; blocks that
    each hold whole units become the units (a split between blocks is also between heads); a
    unit that straddles blocks cannot be split exactly and is refused.
    """
    out = []
    for size, units in segments:
        if size % axis.elems:
            raise PlanError(f"{tensor}: a segment of {size} elements is not a whole number of "
                            f"the {axis.elems}-element blocks this tensor is stored in")
        stored = size // axis.elems * axis.width
        per_unit = size // abs(units)
        together = math.lcm(per_unit, axis.elems)     # the fewest whole units in whole blocks
        if per_unit % axis.elems == 0:
            out.append((stored, units))
        elif units > 0 and size % together == 0:
            # e.g. DeepSeek-V3's 192-row query heads in 128-row FP8 scale blocks: two heads
            # are three whole blocks, so workers split in pairs of heads
            out.append((stored, size // together))
        else:
            raise PlanError(f"{tensor}: its {abs(units)} units of {per_unit} elements straddle "
                            f"the {axis.elems}-element blocks it is stored in (e.g. FP8 128-row "
                            "scale blocks across KV heads); it cannot be split exactly")
    return out


def _per_worker(segments: Segments) -> str:
    """An expression of num_shards: what one worker keeps of these segments."""
    parts = [f"{size} // num_shards" if units > 0 else f"{size} // min(num_shards, {-units})"
             for size, units in segments]
    return " + ".join(parts)


def split_step(shape: tuple[int, ...], dtype: str, dim: int, segments: Segments) -> list:
    """One step splitting ``dim`` of a tensor into the given segments (in its units)."""
    out = ["num_shards", *shape]
    out[dim + 1] = _per_worker(segments)
    if len(segments) == 1 and segments[0][0] == segments[0][1]:
        return step_json("shardload.split", out, dtype, (dim,))
    return step_json("shardload.split_segments", out, dtype,
                     (dim, *[v for pair in segments for v in pair]))


def _trivial_g_idx(ckpt: Checkpoint, name: str, group_size: int) -> bool:
    """GPTQ without act-order stores g_idx = k // G; anything else reorders rows."""
    import torch

    g_idx = ckpt.read(name).to(torch.int64)
    if group_size <= 0:
        return bool((g_idx == 0).all())
    return bool((g_idx == torch.arange(len(g_idx)) // group_size).all())


def _linears(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, gguf_names: bool,
             vocab_parallel: bool):
    """(name, meta, module, suffix, role, axes) for every tensor; role/axes None: replicated."""
    for name, meta in ckpt.metadata().items():
        module, _, suffix = name.rpartition(".")
        role = module_role(name, spec, gguf_names)
        if role is None or (role in ("embed", "lm_head") and not vocab_parallel):
            yield name, meta, module, suffix, None, None
            continue
        yield (name, meta, module, suffix, role,
               _role_axes(scheme, role, name, meta, ckpt.tensor_format(name), spec))


def padding_layout(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, num_shards: int, *,
                   gguf_names: bool, whole_experts: bool = False) -> Union[Padding, PlanError]:
    """The zero-padded layout for N workers, or (returned, not raised) the ``PlanError`` saying
    why zero-padding cannot be exact for this checkpoint: every tensor ``_padded_step`` would
    pad is judged here, before a padded plan is written (with ``whole_experts``, expert
    parallelism, routed experts are not split, so not padded)."""
    if type(num_shards) is not int or not 1 <= num_shards <= MAX_LAYOUT:
        return PlanError(f"cannot zero-pad for num_shards={num_shards!r}: a padded plan lists "
                         f"every worker's heads, for at most {MAX_LAYOUT} workers",
                         source=spec.file or None)
    mlp_unit, sizes = 1, set()
    for name, meta, module, suffix, role, axes in _linears(ckpt, spec, scheme, gguf_names,
                                                           False):
        if axes is None:
            continue
        if whole_experts and role in EXPERT_ROLES and expert_kind(name, module, gguf_names):
            continue
        if axes.special == "g_idx":
            return PlanError(f"{name}: zero-padding cannot be exact for tensors with a g_idx "
                             "(GPTQ, compressed-tensors act-order): padded rows would use real "
                             "groups' scales")
        axis = axes.n if role in COLUMN else axes.k
        if axis is None:
            if (role in COLUMN and axes.special != "shape" and meta.numel > 1
                    and len(meta.shape) <= 1):
                return PlanError(f"{name}: per-part scales of a fused layer cannot be padded "
                                 "yet")
            continue
        if role in HEAD_ROLES:
            width = _head_width(role, spec)
            if width % axis.elems:
                return PlanError(f"{name}: a {width}-element head is not a whole "
                                 f"number of the {axis.elems}-element blocks it is stored in, "
                                 "so heads cannot be padded")
        else:
            mlp_unit = math.lcm(mlp_unit, axis.elems)
            sizes.add(_intermediate(spec, module))
    mlp = {}
    for size in sizes:
        if size % mlp_unit:
            return PlanError(f"an MLP of {size} rows is not a whole number of {mlp_unit}-row "
                             "blocks")
        mlp[size] = unit_layout(size // mlp_unit, num_shards)
    return Padding(num_shards, head_layout(spec.num_heads, spec.num_kv_heads, num_shards),
                   mlp_unit, mlp)


def padding_for(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, num_shards: int, *,
                gguf_names: bool, whole_experts: bool = False) -> Padding:
    """The zero-padded layout for N workers, or ``PlanError`` saying why there is none."""
    padding = padding_layout(ckpt, spec, scheme, num_shards, gguf_names=gguf_names,
                             whole_experts=whole_experts)
    if isinstance(padding, PlanError):
        raise padding
    return padding


def _head_width(role: str, spec: ModelSpec) -> int:
    """The elements one head takes in a tensor of a head role."""
    role = NORM_OF.get(role, role)
    if role == "o":
        return spec.v_head_dim
    if role == "sinks":
        return 1
    if role == "kv_b":
        return _kv_b_width(spec)
    return spec.head_dim


def _padded_units(role: str, spec: ModelSpec, padding: Padding, module: str,
                  worker: int) -> tuple[int, list[int]]:
    """(logical elements per unit, the units worker ``worker`` takes) for a padded layer."""
    heads = padding.heads
    shift = lambda units, by: [u + by if u >= 0 else -1 for u in units]  # noqa: E731
    q, kv = heads.q_heads[worker], heads.kv_heads[worker]
    role = NORM_OF.get(role, role)
    if role in ("q", "q_b", "o", "sinks", "kv_b"):
        return _head_width(role, spec), q
    if role in ("k", "v"):
        return spec.head_dim, kv
    if role == "qkv":
        n_q, n_kv = spec.num_heads, spec.num_kv_heads
        return spec.head_dim, q + shift(kv, n_q) + shift(kv, n_q + n_kv)
    size = _intermediate(spec, module)
    blocks = padding.mlp[size][worker]
    if role == "gate_up":
        return padding.mlp_unit, blocks + shift(blocks, size // padding.mlp_unit)
    return padding.mlp_unit, blocks


def _padded_step(name, meta, role, axes: TensorAxes, spec, padding: Padding, module,
                 split_n: bool, ckpt) -> Optional[list]:
    n = padding.num_shards
    if axes.special == "shape":
        unit, units = _padded_units(role, spec, padding, module, 0)
        n_out, k_in = (int(v) for v in ckpt.read(name).tolist())
        rows = len(units) * unit
        return step_json("shardload.constant", [n, 2], meta.dtype,
                         [rows, k_in] if split_n else [n_out, rows])
    axis = axes.n if split_n else axes.k
    if axis is None:   # per-part scales of fused layers were refused by padding_layout
        return None
    unit, _ = _padded_units(role, spec, padding, module, 0)
    if unit % axis.elems:   # padding_layout refused these: heads and MLP blocks are whole blocks
        raise AssertionError(f"{name}: {unit}-element units straddle its {axis.elems}-element "
                             "blocks")
    stored = unit // axis.elems * axis.width
    indices = [_padded_units(role, spec, padding, module, r)[1] for r in range(n)]
    out = [n, *meta.shape]
    out[axis.dim + 1] = len(indices[0]) * stored
    return step_json("shardload.take_units", out, meta.dtype,
                     (axis.dim, stored, *[u for worker in indices for u in worker]))


def plan_llama(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, *, gguf_names: bool,
               vocab_parallel: bool = False, padding: Optional[Padding] = None,
               experts: Optional[ExpertParallel] = None) -> Planned:
    """The steps for every tensor of a Llama-family checkpoint: symbolic in num_shards, with
    the constraints they put on N (``Planned.constraints``), or, with ``padding``, for its one N
    with zero heads and blocks where N does not divide. With ``experts``, routed experts go
    whole to workers (expert parallelism, ``experts.py``) and put no constraint on N."""
    planned = Planned()
    metadata = ckpt.metadata()
    act_order: dict[str, bool] = {}
    for name, meta, module, suffix, role, axes in _linears(ckpt, spec, scheme, gguf_names,
                                                           vocab_parallel):
        if role is None:
            planned.replicated.append(name)
            continue
        kind = (expert_kind(name, module, gguf_names)
                if experts is not None and role in EXPERT_ROLES else None)
        if kind is not None:
            if kind[0] == "one":
                experts.place(name, kind[1], kind[2])
                planned.placed.append(name)
            else:
                planned.steps[name] = [experts.stacked_step(name, meta.shape, meta.dtype)]
            continue
        if axes is None:
            planned.unknown.append(name)
            planned.replicated.append(name)
            continue
        split_n = role in COLUMN or role in ("embed", "lm_head")
        if padding is not None and role not in ("embed", "lm_head"):
            step = _padded_step(name, meta, role, axes, spec, padding, module, split_n, ckpt)
        else:
            segments = segments_for(role, spec, module)
            group = _Group(name, segment_labels(role, spec, module),
                           role not in ("embed", "lm_head"),
                           _held(scheme, ckpt.tensor_format(name)), planned.constraints)
            step = _tensor_step(ckpt, name, meta, suffix, axes, segments, split_n, scheme,
                                metadata, act_order, module, group)
        if step is None:
            planned.replicated.append(name)
        else:
            planned.steps[name] = step if isinstance(step[0], list) else [step]
    return planned


def _tensor_step(ckpt, name, meta, suffix, axes: TensorAxes, segments: Segments, split_n: bool,
                 scheme: Scheme, metadata, act_order: dict, module: str,
                 group: _Group) -> Optional[list]:
    """The step for one tensor; the split it makes is noted in ``group``'s constraints."""
    if axes.special == "shape":
        return _shape_step(ckpt, name, meta, segments, split_n)   # a constant: any N
    if axes.special == "g_idx":
        if split_n:
            return None  # every output column needs the whole K ordering
        rows = meta.shape[0]
        group.note_rows(rows, segments)
        func = ("shardload.split" if _is_act_order(ckpt, module, name, scheme, act_order)
                else "shardload.split_rebase")
        return step_json(func, ["num_shards", f"{rows} // num_shards"], meta.dtype, (0,))
    axis = axes.n if split_n else axes.k
    if (axis is None and split_n and len(segments) > 1 and meta.numel == len(segments)
            and suffix in ("weight_scale", "weight_scale_inv")):
        group.note(segments, segments, Axis(0))
        return _per_part_scales(meta, segments, name)
    if axis is None:
        return None
    if (not split_n and suffix in ("scales", "qzeros", "weight_scale", "weight_zero_point")
            and scheme.method in ("gptq", "pack-quantized")
            and _is_act_order(ckpt, module, None, scheme, act_order)):
        return None  # act-order: any row may use any group, so every worker needs them all
    in_units = _in_units(segments, axis, name)
    group.note(segments, in_units, axis)
    return split_step(meta.shape, meta.dtype, axis.dim, in_units)


def _per_part_scales(meta, segments: Segments, name: str) -> list:
    """A fused layer with one per-tensor scale per part ([q, k, v] -> 3 scales): expand them to
    per-channel scales, one per row, then split those rows like the weight. Exact: every row
    keeps the scale it was quantized with; nothing is re-quantized."""
    rows = sum(size for size, _ in segments)
    expand = step_json("shardload.repeat_segments", [rows, 1], meta.dtype,
                       [size for size, _ in segments])
    return [expand, split_step((rows, 1), meta.dtype, 0, segments)]


def _is_act_order(ckpt, module: str, g_idx_name: Optional[str], scheme: Scheme,
                  cache: dict) -> bool:
    if module not in cache:
        candidates = [f"{module}.g_idx", f"{module}.weight_g_idx"]
        found = next((c for c in candidates if c in ckpt.metadata()), None)
        cache[module] = (scheme.act_order if found is None
                         else not _trivial_g_idx(ckpt, found, scheme.group_size))
    return cache[module]


def _shape_step(ckpt, name, meta, segments: Segments, split_n: bool) -> list:
    """compressed-tensors' ``weight_shape`` [N, K]: each worker's own shape, as expressions."""
    n_out, k_in = (int(v) for v in ckpt.read(name).tolist())
    per_worker = _per_worker(segments)
    values = [per_worker, k_in] if split_n else [n_out, per_worker]
    return step_json("shardload.constant", ["num_shards", 2], meta.dtype, values)


__all__ = ["plan_llama", "padding_for", "padding_layout", "Padding", "Planned", "segments_for",
           "segment_labels", "split_step"]
