"""The Llama-family planner: which tensors split along which axis, in which units.

Column-parallel layers (q, k, v, gate, up, and their fused forms) split their output rows N;
row-parallel layers (o, down) split their input columns K. Attention splits in whole heads:
query heads are never replicated, KV heads are replicated to the workers whose query heads use
them when the workers outnumber them (GQA, MQA). Every stored tensor of a layer gets the same
logical split, converted into its own units (``layouts.py``); a split that would cut a packed
word, a quantization group or a GGUF block is caught by the shape rules, so a plan that binds
and validates for N is exact for N. Norms, routers and everything unknown are replicated;
embeddings and lm_head too, unless ``vocab_parallel``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..errors import PlanError
from ..readers.base import Checkpoint
from .layouts import Axis, Scheme, TensorAxes, tensor_axes
from .model import ModelSpec
from .tp_layout import HeadLayout, head_layout, unit_layout

# last component of a module name -> role
HF_ROLES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "qkv_proj": "qkv", "o_proj": "o",
            "gate_proj": "gate", "up_proj": "up", "gate_up_proj": "gate_up", "down_proj": "down",
            "w1": "gate", "w3": "up", "w2": "down", "embed_tokens": "embed", "lm_head": "lm_head"}
GGUF_ROLES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_qkv": "qkv", "attn_output": "o",
              "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down", "ffn_gate_exps": "gate",
              "ffn_up_exps": "up", "ffn_down_exps": "down", "ffn_gate_shexp": "gate",
              "ffn_up_shexp": "up", "ffn_down_shexp": "down", "token_embd": "embed",
              "output": "lm_head"}
COLUMN = {"q", "k", "v", "qkv", "gate", "up", "gate_up"}
ROW = {"o", "down"}

Segments = list[tuple[int, int]]   # (logical size, units); units < 0: replicable (KV heads)


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
        return {"num_shards": self.num_shards, "head_dim": spec.head_dim,
                **self.heads.as_dict(), "mlp_block": self.mlp_unit,
                "mlp_blocks": {str(k): v for k, v in self.mlp.items()}}


@dataclass
class Planned:
    """A plan in the making: steps by tensor, and what the planner noticed."""

    steps: dict[str, list] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def _intermediate(spec: ModelSpec, module: str) -> int:
    if "shexp" in module or "shared_expert" in module:
        size = spec.shared_expert_intermediate_size
    elif "experts" in module or "_exps" in module:
        size = spec.moe_intermediate_size or spec.intermediate_size
    else:
        size = spec.intermediate_size
    if not size:
        raise PlanError(f"{module}: the model config gives no intermediate size for it")
    return size


def segments_for(role: str, spec: ModelSpec, module: str) -> Segments:
    """The logical split of a layer along the axis its role splits."""
    if role == "q" or role == "o":
        return [(spec.q_size, spec.num_heads)]
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
        if per_unit % axis.elems == 0:
            out.append((stored, units))
        elif axis.elems % per_unit == 0 and units > 0:
            out.append((stored, size // axis.elems))
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
        return ["shardload.split", [out, dtype], dim]
    return ["shardload.split_segments", [out, dtype], dim,
            *[v for pair in segments for v in pair]]


def _trivial_g_idx(ckpt: Checkpoint, name: str, group_size: int) -> bool:
    """GPTQ without act-order stores g_idx = k // G; anything else reorders rows."""
    import torch

    g_idx = ckpt.read(name).to(torch.int64)
    if group_size <= 0:
        return bool((g_idx == 0).all())
    return bool((g_idx == torch.arange(len(g_idx)) // group_size).all())


def _linears(ckpt: Checkpoint, scheme: Scheme, roles: dict, vocab_parallel: bool):
    """(name, meta, module, suffix, role, axes) for every tensor; role/axes None: replicated."""
    for name, meta in ckpt.metadata().items():
        module, _, suffix = name.rpartition(".")
        role = roles.get(module.rpartition(".")[2])
        if role is None or (role in ("embed", "lm_head") and not vocab_parallel):
            yield name, meta, module, suffix, None, None
            continue
        yield (name, meta, module, suffix, role,
               tensor_axes(scheme, suffix, meta, ckpt.tensor_format(name)))


def padding_for(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, num_shards: int, *,
                gguf_names: bool) -> Padding:
    """The zero-padded layout for N workers, or ``PlanError`` saying why there is none."""
    roles = GGUF_ROLES if gguf_names else HF_ROLES
    mlp_unit, sizes = 1, set()
    for name, meta, module, suffix, role, axes in _linears(ckpt, scheme, roles, False):
        if axes is None:
            continue
        if axes.special == "g_idx":
            raise PlanError(f"{name}: zero-padding cannot be exact for tensors with a g_idx "
                            "(GPTQ, compressed-tensors act-order): padded rows would use real "
                            "groups' scales")
        axis = axes.n if role in COLUMN else axes.k
        if axis is None:
            continue
        if role in ("q", "k", "v", "qkv", "o"):
            if spec.head_dim % axis.elems:
                raise PlanError(f"{name}: a {spec.head_dim}-element head is not a whole number "
                                f"of the {axis.elems}-element blocks it is stored in, so heads "
                                "cannot be padded")
        else:
            mlp_unit = math.lcm(mlp_unit, axis.elems)
            sizes.add(_intermediate(spec, module))
    mlp = {}
    for size in sizes:
        if size % mlp_unit:
            raise PlanError(f"an MLP of {size} rows is not a whole number of {mlp_unit}-row "
                            "blocks")
        mlp[size] = unit_layout(size // mlp_unit, num_shards)
    return Padding(num_shards, head_layout(spec.num_heads, spec.num_kv_heads, num_shards),
                   mlp_unit, mlp)


def _padded_units(role: str, spec: ModelSpec, padding: Padding, module: str,
                  worker: int) -> tuple[int, list[int]]:
    """(logical elements per unit, the units worker ``worker`` takes) for a padded layer."""
    heads = padding.heads
    shift = lambda units, by: [u + by if u >= 0 else -1 for u in units]  # noqa: E731
    q, kv = heads.q_heads[worker], heads.kv_heads[worker]
    if role in ("q", "o"):
        return spec.head_dim, q
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
        return ["shardload.constant", [[n, 2], meta.dtype],
                *([rows, k_in] if split_n else [n_out, rows])]
    axis = axes.n if split_n else axes.k
    if axis is None:
        if split_n and meta.numel > 1 and len(meta.shape) <= 1:
            raise PlanError(f"{name}: per-part scales of a fused layer cannot be padded yet")
        return None
    unit, _ = _padded_units(role, spec, padding, module, 0)
    if unit % axis.elems:
        raise PlanError(f"{name}: {unit}-element units straddle its {axis.elems}-element blocks")
    stored = unit // axis.elems * axis.width
    indices = [_padded_units(role, spec, padding, module, r)[1] for r in range(n)]
    out = [n, *meta.shape]
    out[axis.dim + 1] = len(indices[0]) * stored
    return ["shardload.take_units", [out, meta.dtype], axis.dim, stored,
            *[u for worker in indices for u in worker]]


def plan_llama(ckpt: Checkpoint, spec: ModelSpec, scheme: Scheme, *, gguf_names: bool,
               vocab_parallel: bool = False, padding: Optional[Padding] = None) -> Planned:
    """The steps for every tensor of a Llama-family checkpoint: symbolic in num_shards, or,
    with ``padding``, for its one N with zero heads and blocks where N does not divide."""
    roles = GGUF_ROLES if gguf_names else HF_ROLES
    planned = Planned()
    metadata = ckpt.metadata()
    act_order: dict[str, bool] = {}
    for name, meta, module, suffix, role, axes in _linears(ckpt, scheme, roles, vocab_parallel):
        if role is None:
            planned.replicated.append(name)
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
            step = _tensor_step(ckpt, name, meta, suffix, axes, segments, split_n, scheme,
                                metadata, act_order, module)
        if step is None:
            planned.replicated.append(name)
        else:
            planned.steps[name] = step if isinstance(step[0], list) else [step]
    return planned


def _tensor_step(ckpt, name, meta, suffix, axes: TensorAxes, segments: Segments, split_n: bool,
                 scheme: Scheme, metadata, act_order: dict, module: str) -> Optional[list]:
    if axes.special == "shape":
        return _shape_step(ckpt, name, meta, segments, split_n)
    if axes.special == "g_idx":
        if split_n:
            return None  # every output column needs the whole K ordering
        if _is_act_order(ckpt, module, name, scheme, act_order):
            return ["shardload.split", [["num_shards", f"{meta.shape[0]} // num_shards"],
                                        meta.dtype], 0]
        return ["shardload.split_rebase", [["num_shards", f"{meta.shape[0]} // num_shards"],
                                           meta.dtype], 0]
    axis = axes.n if split_n else axes.k
    if (axis is None and split_n and len(segments) > 1 and meta.numel == len(segments)
            and suffix in ("weight_scale", "weight_scale_inv")):
        return _per_part_scales(meta, segments, name)
    if axis is None:
        return None
    if (not split_n and suffix in ("scales", "qzeros", "weight_scale", "weight_zero_point")
            and scheme.method in ("gptq", "pack-quantized")
            and _is_act_order(ckpt, module, None, scheme, act_order)):
        return None  # act-order: any row may use any group, so every worker needs them all
    return split_step(meta.shape, meta.dtype, axis.dim, _in_units(segments, axis, name))


def _per_part_scales(meta, segments: Segments, name: str) -> list:
    """A fused layer with one per-tensor scale per part ([q, k, v] -> 3 scales): expand them to
    per-channel scales, one per row, then split those rows like the weight. Exact: every row
    keeps the scale it was quantized with; nothing is re-quantized."""
    rows = sum(size for size, _ in segments)
    expand = ["shardload.repeat_segments", [[rows, 1], meta.dtype],
              *[size for size, _ in segments]]
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
    return ["shardload.constant", [["num_shards", 2], meta.dtype], *values]


__all__ = ["plan_llama", "padding_for", "Padding", "Planned", "segments_for", "split_step"]
