"""The decoder planner: which tensors of a decoder-only model split along which axis, in which
units. Every architecture the planner knows goes through it (Llama and its relatives, Gemma,
Phi, the MoE families, gpt-oss, DeepSeek's MLA, OLMo-2): an architecture is a row of
``architectures.py`` naming its tensors' roles, never a branch here.

For each tensor (``tensors.walk``, classified once per decision and passed in: its role, MLP
kind and axes), in storage order (each kind of tensor stepped once, ``plan_decoder``):

1. no role, or no axes (a norm, a router, a tensor the format does not know): replicated;
2. under expert parallelism, a routed expert's tensor goes whole to its worker (one per
   tensor: ``__placement__``) or is split along its expert axis (stacked: ``experts.py``);
3. with a zero-padded layout (``padding.py``), the units each worker takes, zeros included
   (a row-parallel ``g_idx`` layer's zero rows in zero-scaled groups of their own);
4. otherwise the role's logical split (``roles.py``: its segments of heads, KV heads, MLP or
   vocabulary rows) converted into the tensor's own units along the axis the role splits
   (``_in_units``: packed words, quantization groups, FP8 or GGUF blocks), as one
   ``shardload.split`` or ``shardload.split_segments`` step, symbolic in ``num_shards``. The
   split is recorded as a ``fit.Constraint`` (its units, what they are and which keys say so),
   so the planner knows which N the plan allows without binding it. A tensor whose segments
   end in a partial block (192 KV rows in 128-row FP8 blocks) is one unit: N = 1 only, or any
   N for a single KV head.

The format's rules ride on the axes (``formats.TensorAxes``): a ``g_idx`` is whole on a column
split and sliced (rebased unless act-order) on a row split; act-order scales are replicated on
a row split; per-part scales of a fused layer are expanded to rows; compressed-tensors'
``weight_shape`` is rewritten per worker.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import PlanError
from ..formats import Axis, Scheme, TensorAxes
from ..plan import step_json
from .checks import held
from .experts import ExpertParallel
from .fit import Constraint, Constraints
from .padding import Padding, padded_step
from .roles import Segments
from .tensors import Tensor, Walk

if TYPE_CHECKING:  # pragma: no cover
    from ..readers.base import Checkpoint
    from .spec import ModelSpec

__all__ = ["ActOrder", "Planned", "plan_decoder", "split_step"]


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


@dataclass(frozen=True)
class _TensorGroup:
    """The tensor being planned, for the constraints its split puts on N: its name, what its
    logical segments are, and how its quantization stores them."""

    name: str
    labels: list[str]
    paddable: bool
    held: str  # " ('quantization_config.bits' = 4, ...)", " (Q4_K blocks)"
    constraints: Constraints

    def note(self, segments: Segments, in_units: Segments, axis: Axis) -> None:
        """One constraint per segment, in the units the tensor stores it in."""
        for (size, logical), (_, units), label in zip(segments, in_units, self.labels):
            blocks = size // axis.elems
            if units == logical:
                stored = ""
            elif abs(units) == blocks:
                per_block = abs(logical) // abs(units)  # heads that share one block
                stored = f"stored in {blocks} blocks of {axis.elems}{self.held}" + (
                    f", {per_block} to a block" if 1 < per_block < axis.elems else ""
                )
            else:  # units grouped until they fill whole blocks (_in_units)
                stored = (
                    f"stored in {blocks} blocks of {axis.elems}{self.held}, so split in "
                    f"{abs(units)} groups of {abs(logical) // abs(units)} that fill "
                    f"{blocks // abs(units)} whole blocks each"
                )
            self.constraints.add(
                Constraint(abs(units), units < 0, label, self.name, self.paddable, stored)
            )

    def note_partial(self, segments: Segments, axis: Axis, units: int) -> None:
        """A tensor held whole (``_partial_blocks``): N = 1, or any N for one KV head."""
        size, label = next(
            (size, label) for (size, _), label in zip(segments, self.labels) if size % axis.elems
        )
        self.constraints.add(
            Constraint(
                1,
                units < 0,
                label,
                self.name,
                self.paddable,
                f"whose {size} elements end in a partial {axis.elems}-element block{self.held}, so "
                "they are never split",
            )
        )

    def note_rows(self, rows: int, segments: Segments) -> None:
        """A tensor split in whole rows of the layer's input (GPTQ's g_idx)."""
        in_rows = len(segments) == 1 and tuple(segments[0]) == (rows, rows)  # MLP rows
        label = self.labels[0] if in_rows else f"the {rows} input rows of the layer"
        self.constraints.add(Constraint(rows, False, label, self.name, self.paddable))


def _in_units(segments: Segments, axis: Axis, tensor: str) -> Segments:
    """The logical segments in the tensor's own units along ``axis``.

    A unit (a head) that is a whole number of the tensor's blocks keeps its count; blocks that
    each hold whole units become the units (a split between blocks is also between heads); a
    unit that straddles blocks cannot be split exactly and is refused.
    """
    out = []
    for size, units in segments:  # whole blocks: _partial_blocks takes the rest
        stored = size // axis.elems * axis.width
        per_unit = size // abs(units)
        together = math.lcm(per_unit, axis.elems)  # the fewest whole units in whole blocks
        if per_unit % axis.elems == 0:
            out.append((stored, units))
        elif size % together == 0:
            # e.g. DeepSeek-V3's 192-row query heads in 128-row FP8 scale blocks: two heads
            # are three whole blocks, so workers split in pairs of heads. KV heads in runs are
            # no longer replicable (a worker past their count would hold a run, not one head):
            # N must divide the runs
            out.append((stored, size // together))
        else:
            raise PlanError(
                f"{tensor}: its {abs(units)} units of {per_unit} elements straddle "
                f"the {axis.elems}-element blocks it is stored in (e.g. FP8 128-row "
                "scale blocks across KV heads); it cannot be split exactly"
            )
    return out


def _per_worker(segments: Segments) -> str:
    """An expression of num_shards: what one worker keeps of these segments."""
    parts = [
        f"{size} // num_shards" if units > 0 else f"{size} // min(num_shards, {-units})"
        for size, units in segments
    ]
    return " + ".join(parts)


def split_step(shape: tuple[int, ...], dtype: str, dim: int, segments: Segments) -> list:
    """One step splitting ``dim`` of a tensor into the given segments (in its units)."""
    out = ["num_shards", *shape]
    out[dim + 1] = _per_worker(segments)
    if len(segments) == 1 and segments[0][0] == segments[0][1]:
        return step_json("shardload.split", out, dtype, (dim,))
    return step_json(
        "shardload.split_segments", out, dtype, (dim, *[v for pair in segments for v in pair])
    )


def plan_decoder(
    ckpt: Checkpoint,
    spec: ModelSpec,
    scheme: Scheme,
    walked: Walk,
    act_order: ActOrder,
    *,
    vocab_parallel: bool = False,
    padding: Padding | None = None,
    experts: ExpertParallel | None = None,
) -> Planned:
    """The steps for every tensor of a decoder checkpoint (``walked``: ``tensors.walk``):
    symbolic in num_shards, with the constraints they put on N (``Planned.constraints``), or,
    with ``padding``, for its one N with zero heads and blocks where N does not divide. With
    ``experts``, routed experts go whole to workers (expert parallelism, ``experts.py``) and put
    no constraint on N. Embeddings and lm_head are replicated unless ``vocab_parallel``.

    Each kind of tensor is stepped once and its steps (one list, shared) stamped on every tensor
    of the kind, in storage order; what a tensor's own module decides (act-order, a padded
    fill) is part of the key, and what its own data decides (a stored ``weight_shape``) is
    stepped for each tensor.
    """
    planned = Planned()
    naming = spec.rules.naming
    stepped: dict[Any, list | None] = {}
    decides: dict[int, str] = {}  # by kind: what decides its tensors' steps (_decided_by)
    for meta, kind in walked.rows():
        name, role, axes = meta.name, kind.role, kind.axes
        if role is None or (role.kind == "vocab" and not vocab_parallel):
            planned.replicated.append(name)
            continue
        if experts is not None and role.kind == "mlp":
            expert = naming.expert_kind(name, name.rpartition(".")[0])
            if expert is not None:
                if expert[0] == "one":
                    experts.place(name, expert[1], expert[2])
                    planned.placed.append(name)
                else:
                    planned.steps[name] = [experts.stacked_step(name, meta.shape, meta.dtype)]
                continue
        if axes is None:
            planned.unknown.append(name)
            planned.replicated.append(name)
            continue
        by = decides.get(id(kind))
        if by is None:
            by = decides[id(kind)] = _decided_by(kind, padding)
        key = (
            id(kind)
            if by == "kind"
            else None
            if by == "tensor"
            else _module_key(kind, name, act_order, padding)
        )
        steps = stepped.get(key, _UNSTEPPED) if key is not None else _UNSTEPPED
        if steps is _UNSTEPPED:
            steps = _steps(
                ckpt,
                spec,
                scheme,
                walked.tensor(meta, kind),
                act_order,
                padding,
                planned.constraints,
            )
            if key is not None:
                stepped[key] = steps
        if steps is None:
            planned.replicated.append(name)
        else:
            planned.steps[name] = steps
    return planned


_UNSTEPPED: Any = object()


def _decided_by(kind: Tensor, padding: Padding | None) -> str:
    """What decides the steps of a tensor of ``kind``: the kind alone (``"kind"``); also its
    module (``"module"``: its rows reordered, a padded row-parallel layer's fill); or its own
    data (``"tensor"``: compressed-tensors' ``weight_shape``, stepped for each tensor)."""
    role, axes = kind.split()
    if axes.special == "shape":
        return "tensor"
    if role.column or not (
        axes.special == "g_idx" or axes.act_order or (padding is not None and padding.fills)
    ):
        return "kind"
    return "module"


def _module_key(kind: Tensor, name: str, act_order: ActOrder, padding: Padding | None) -> tuple:
    """The key of the steps of tensor ``name`` of a kind its module decides too."""
    _, axes = kind.split()
    module = name.rpartition(".")[0]
    reorders = (axes.special == "g_idx" or axes.act_order) and act_order(module)
    fill = padding.fills.get(module) if padding is not None and not axes.special else None
    return id(kind), reorders, fill


def _steps(
    ckpt: Checkpoint,
    spec: ModelSpec,
    scheme: Scheme,
    t: Tensor,
    act_order: ActOrder,
    padding: Padding | None,
    constraints: Constraints,
) -> list | None:
    """The steps of one tensor (None: replicated); the split it makes noted in
    ``constraints``."""
    role, axes = t.split()
    if padding is not None and role.paddable:
        reorders = (
            not role.column and (axes.special == "g_idx" or axes.act_order) and act_order(t.module)
        )
        step = padded_step(
            t, axes, spec, padding, ckpt, group_size=scheme.group_size, act_order=reorders
        )
    else:
        segments = role.segments(spec, t.mlp, t.module)
        group = _TensorGroup(
            t.name,
            role.labels(spec, t.mlp, t.module),
            role.paddable,
            held(scheme, t.fmt),
            constraints,
        )
        step = _tensor_step(ckpt, t, axes, segments, act_order, group)
    if step is None:
        return None
    return step if isinstance(step[0], list) else [step]


def _tensor_step(
    ckpt: Checkpoint,
    t: Tensor,
    axes: TensorAxes,
    segments: Segments,
    act_order: ActOrder,
    group: _TensorGroup,
) -> list | None:
    """The step for one tensor; the split it makes is noted in ``group``'s constraints."""
    split_n, meta = t.split()[0].column, t.meta
    if axes.special == "shape":
        return _shape_step(ckpt, t, segments)  # a constant: any N
    if axes.special == "g_idx":
        if split_n:
            return None  # every output column needs the whole K ordering
        rows = meta.shape[0]
        group.note_rows(rows, segments)
        func = "shardload.split" if act_order(t.module) else "shardload.split_rebase"
        return step_json(func, ["num_shards", f"{rows} // num_shards"], meta.dtype, (0,))
    axis = axes.n if split_n else axes.k
    if (
        axis is None
        and split_n
        and axes.per_part
        and len(segments) > 1
        and meta.numel == len(segments)
    ):
        group.note(segments, segments, Axis(0))
        return _per_part_scales(meta, segments)
    if axis is None:
        return None
    if not split_n and axes.act_order and act_order(t.module):
        return None  # act-order: any row may use any group, so every worker needs them all
    if any(size % axis.elems for size, _ in segments):
        return _partial_blocks(meta, axis, segments, group)
    in_units = _in_units(segments, axis, t.name)
    group.note(segments, in_units, axis)
    return split_step(meta.shape, meta.dtype, axis.dim, in_units)


def _partial_blocks(meta, axis: Axis, segments: Segments, group: _TensorGroup) -> list:
    """A tensor whose segments are not whole storage blocks (a KV projection of 192 rows in
    128-row FP8 blocks; vLLM loads such a model only unsplit too): no split is exact, so it is
    held whole, one unit: the plan fits N = 1, or any N when the tensor is one KV head, the
    head every worker needs."""
    units = -1 if len(segments) == 1 and segments[0][1] == -1 else 1
    group.note_partial(segments, axis, units)
    return split_step(meta.shape, meta.dtype, axis.dim, [(meta.shape[axis.dim], units)])


def _per_part_scales(meta, segments: Segments) -> list:
    """A fused layer with one per-tensor scale per part ([q, k, v] -> 3 scales): expand them to
    per-channel scales, one per row, then split those rows like the weight. Exact: every row
    keeps the scale it was quantized with; nothing is re-quantized."""
    rows = sum(size for size, _ in segments)
    expand = step_json(
        "shardload.repeat_segments", [rows, 1], meta.dtype, [size for size, _ in segments]
    )
    return [expand, split_step((rows, 1), meta.dtype, 0, segments)]


#: what each open checkpoint's ``g_idx`` tensors said, by (tensor, group size): a checkpoint's
#: tensors do not change while it is open (readers check), and deciding for several N (or
#: for vLLM's N and the planner's) reads each once
_G_IDX_SEEN: weakref.WeakKeyDictionary[Checkpoint, dict[tuple[str, int], bool]] = (
    weakref.WeakKeyDictionary()
)


class ActOrder:
    """Whether a module's input rows are reordered (act-order): its ``g_idx`` is not the
    trivial ``k // G`` (read once per module and open checkpoint), or, without one, the config
    says so."""

    def __init__(self, ckpt: Checkpoint, scheme: Scheme):
        self.ckpt, self.scheme = ckpt, scheme
        self.part = scheme.format.g_idx_part
        self.cache: dict[str, bool] = {}
        self.seen = _G_IDX_SEEN.setdefault(ckpt, {})

    def __call__(self, module: str) -> bool:
        if module not in self.cache:
            name = f"{module}.{self.part}" if self.part else None
            if name is not None and name in self.ckpt.metadata():
                key = (name, self.scheme.group_size)
                if key not in self.seen:
                    self.seen[key] = not _trivial_g_idx(self.ckpt, name, self.scheme.group_size)
                self.cache[module] = self.seen[key]
            else:
                self.cache[module] = self.scheme.act_order
        return self.cache[module]


def _trivial_g_idx(ckpt: Checkpoint, name: str, group_size: int) -> bool:
    """GPTQ without act-order stores g_idx = k // G; anything else reorders rows."""
    g_idx = ckpt.read_array(name).astype(np.int64)
    if group_size <= 0:
        return bool((g_idx == 0).all())
    return bool((g_idx == np.arange(len(g_idx)) // group_size).all())


def _shape_step(ckpt: Checkpoint, t: Tensor, segments: Segments) -> list:
    """compressed-tensors' ``weight_shape`` [N, K]: each worker's own shape, as expressions."""
    n_out, k_in = (int(v) for v in ckpt.read_array(t.name).tolist())
    per_worker = _per_worker(segments)
    values = [per_worker, k_in] if t.split()[0].column else [n_out, per_worker]
    return step_json("shardload.constant", ["num_shards", 2], t.meta.dtype, values)
