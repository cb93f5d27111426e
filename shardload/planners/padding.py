"""Zero-padding for an N the heads or the MLP do not divide.

For such an N, a plan for that N alone gives every worker the same number of query heads, KV
heads and MLP blocks, filling up with zero units (``tp_layout.py``: which heads each worker
holds; ``-1`` is a zero unit), read with ``shardload.take_units``. Zero weights with zero scales
dequantize to exact zeros, so the model's output is unchanged. ``padding_layout`` first judges
every tensor it would pad, and refuses where padding cannot be exact: heads that no run of
whole heads fills whole storage blocks with, an MLP that is not a whole number of blocks,
per-part scales of a fused layer, rows of a per-channel row-parallel layer whose columns do not
share one zero code (asymmetric zero points). Where they share one that is not 0 (symmetric
GPTQ's 2^(b-1), compressed-tensors' offset), the padded rows are filled with it
(``shardload.take_units_fill``): the column's scale then multiplies zeros. Heads that straddle
blocks (DeepSeek-V3's 192-row query heads in 128-row FP8 blocks) pad in runs that fill whole
blocks (two heads, three blocks): ``together``.
Rows of a layer with a ``g_idx`` (GPTQ, compressed-tensors act-order) pad in whole zero-scaled
groups of their own (``padded_step``), heads narrower than a group in runs that fill whole
groups. With act-order every worker holds all the layer's group scales plus zero groups for its
zero rows, so padding past twice the heads (or MLP blocks) is refused: each worker would hold
more than twice the layer's scales, past the loader's bound on a piece's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ShardloadError
from ..formats import Scheme, TensorAxes
from ..plan import step_json
from ..tp_layout import MAX_LAYOUT, HeadLayout, head_layout, unit_layout
from .roles import mlp_size
from .tensors import Tensor, Walk

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..readers.base import Checkpoint
    from .spec import ModelSpec

__all__ = ["CannotPad", "Padding", "padded_step", "padding_layout"]


class CannotPad(ShardloadError):
    """Zero-padding cannot be exact for this checkpoint at this N, or cannot be held; the
    message says why (``padding_layout``). The planner words it into its refusal of N."""


@dataclass(frozen=True)
class Padding:
    """A layout for one N that the heads or the MLP do not divide: zero heads and zero MLP
    blocks fill every worker up to the same size (``tp_layout.py``)."""

    num_shards: int
    heads: HeadLayout
    mlp_unit: int  # logical MLP rows per block
    mlp: dict[int, list[list[int]]]  # intermediate size -> blocks per worker
    #: module -> the stored element its padded rows are filled with, where 0 is no zero weight
    fills: dict[str, int] = field(default_factory=dict)

    def metadata(self, spec: ModelSpec) -> dict:
        """What an engine needs to run the padded shards (recorded in the plan as
        ``__metadata__.tensor_parallel``)."""
        meta = {
            "num_shards": self.num_shards,
            "head_dim": spec.head_dim,
            **self.heads.as_dict(),
            "mlp_block": self.mlp_unit,
            "mlp_blocks": {str(k): v for k, v in self.mlp.items()},
        }
        if spec.mla is not None:
            # MLA: heads of other widths in kv_b_proj and o_proj than head_dim (q's)
            meta["mla"] = {
                "qk_nope_head_dim": spec.mla.qk_nope_head_dim,
                "qk_rope_head_dim": spec.mla.qk_rope_head_dim,
                "v_head_dim": spec.v_head_dim,
                "kv_lora_rank": spec.mla.kv_lora_rank,
                "q_lora_rank": spec.mla.q_lora_rank,
            }
        if spec.rules.split_norms:
            # OLMo-2: these norms' mean runs over the whole, unpadded projection (padded rows
            # are zero and add nothing to the sum of squares; divide by this width)
            meta["projection_norms"] = {
                norm: spec.q_size if role == "q" else spec.kv_size
                for norm, role in spec.rules.split_norms.items()
            }
        return meta


def padding_layout(
    ckpt: Checkpoint,
    spec: ModelSpec,
    scheme: Scheme,
    num_shards: int,
    walked: Walk,
    act_order: Callable[[str], bool],
    *,
    whole_experts: bool = False,
) -> Padding:
    """The zero-padded layout for N workers, else ``CannotPad`` saying why zero-padding cannot
    be exact for this checkpoint, or cannot be held: every tensor of
    ``walked`` (``tensors.walk``) that ``padded_step`` would pad is judged here, before a
    padded plan is written (``act_order(module)``: its rows are reordered; with
    ``whole_experts``, expert parallelism, routed experts are not split, so not padded)."""
    if type(num_shards) is not int or not 1 <= num_shards <= MAX_LAYOUT:
        raise CannotPad(
            f"cannot zero-pad for num_shards={num_shards!r}: a padded plan lists "
            f"every worker's heads, for at most {MAX_LAYOUT} workers"
        )
    naming = spec.rules.naming
    mlp_unit, sizes, together, fills = 1, set(), 1, {}
    modules: dict[str, set[str]] = {}
    act_order_scales: dict[str, str] = {}  # role kind -> a row-parallel act-order tensor

    def reader(module: str) -> Callable[[str], torch.Tensor]:
        """A reader of ``module``'s parts (its ``weight_zero_point``, ...) by suffix."""
        return lambda part: ckpt.read(f"{module}.{part}")

    def parts_of(module: str) -> set[str]:
        if not modules:  # once, and only for a layer that asks
            for name in ckpt.metadata():
                prefix, _, suffix = name.rpartition(".")
                modules.setdefault(prefix, set()).add(suffix)
        return modules.get(module, set())

    judged: set[int] = set()  # kinds judged already, where the module decides nothing
    for meta, kind in walked.rows():
        role, axes = kind.role, kind.axes  # the tensor's, as its kind's
        if role is None or axes is None or not role.paddable:  # the vocabulary is never padded
            continue
        by_module = not role.column and (axes.act_order or (axes.grouped and axes.k is None))
        if not by_module and not whole_experts:
            if id(kind) in judged:
                continue
            judged.add(id(kind))
        t = walked.tensor(meta, kind)
        if whole_experts and role.kind == "mlp" and naming.expert_kind(t.name, t.module):
            continue
        if not role.column and axes.grouped and axes.k is None and t.module not in fills:
            fill = scheme.format.zero_weight_fill(scheme, parts_of(t.module), reader(t.module))
            if fill is None:
                raise CannotPad(
                    f"{t.name}: a row-parallel layer quantized per channel "
                    f"({scheme.describe()}) keeps one scale for real and padded "
                    "rows, and no one stored element is a zero weight in every "
                    "column (zero points that differ by column, or 3-bit codes "
                    "straddling words), so padded rows would not be zeros"
                )
            fills[t.module] = fill
        if not role.column and axes.act_order and act_order(t.module):
            act_order_scales.setdefault(role.kind, t.name)
        axis = axes.n if role.column else axes.k
        if axis is None:
            if (
                role.column
                and axes.special not in ("shape", "g_idx")
                and t.meta.numel > 1
                and len(t.meta.shape) <= 1
            ):
                raise CannotPad(f"{t.name}: per-part scales of a fused layer cannot be padded yet")
            continue
        if role.kind == "heads":
            width = role.head_width(spec)
            run = math.lcm(width, axis.elems) // width  # the fewest heads in whole blocks
            together = math.lcm(together, run)
            if spec.num_heads % together or spec.num_kv_heads % together:
                raise CannotPad(
                    f"{t.name}: its {width}-element heads fill whole "
                    f"{axis.elems}-element blocks only {together} at a time, and "
                    f"{spec.num_heads} query and {spec.num_kv_heads} KV heads are "
                    f"not whole runs of {together}, so heads cannot be padded"
                )
        else:
            mlp_unit = math.lcm(mlp_unit, axis.elems)
            sizes.add(mlp_size(spec, t.mlp, t.module))
    mlp = {}
    for size in sizes:
        if size % mlp_unit:
            raise CannotPad(f"an MLP of {size} rows is not a whole number of {mlp_unit}-row blocks")
        mlp[size] = unit_layout(size // mlp_unit, num_shards)
    heads = head_layout(spec.num_heads, spec.num_kv_heads, num_shards, together=together)
    # (units held by all workers, the model's, what they are), by role kind
    padded = {
        "heads": [(num_shards * len(heads.q_heads[0]), spec.num_heads, "query heads")],
        "mlp": [
            (
                num_shards * len(blocks[0]),
                size // mlp_unit,
                f"{mlp_unit}-row blocks of the {size}-row MLP",
            )
            for size, blocks in mlp.items()
        ],
    }
    for role_kind, name in act_order_scales.items():
        for held, real, what in padded.get(role_kind, []):
            if held > 2 * real:
                # every worker holds every group's scales plus zero groups for the padded
                # rows (replicate_padded): N times the padded layer's, which the plan's own
                # bound refuses past twice N times the stored tensor
                raise CannotPad(
                    f"{name}: act-order keeps every group's scales on every "
                    f"worker, and {real} {what} zero-padded to {held} over "
                    f"{num_shards} workers would more than double them on each"
                )
    return Padding(
        num_shards, heads, mlp_unit, mlp, {module: fill for module, fill in fills.items() if fill}
    )


def padded_step(
    t: Tensor,
    axes: TensorAxes,
    spec: ModelSpec,
    padding: Padding,
    ckpt: Checkpoint,
    *,
    group_size: int = -1,
    act_order: bool = False,
) -> list | None:
    """The step taking worker by worker the units of ``padding`` (zeros for ``-1``).

    A row-parallel layer with a ``g_idx`` (``group_size``; ``act_order``: its ``g_idx``
    reorders rows) gets zero rows that are whole zero-scaled groups of their own: without
    act-order each worker's scales take zero groups where its rows are zero and its ``g_idx``
    counts its own groups; with act-order every worker holds every real group plus zero groups
    appended (``shardload.replicate_padded``), and its zero rows point at those
    (``shardload.take_g_idx``). A zero scale dequantizes any code to exactly 0."""
    role = t.role
    assert role is not None, "a padded tensor has a role"  # padding_layout judged it so
    n, split_n = padding.num_shards, role.column
    if axes.special == "shape":
        unit, units = role.padded_units(spec, padding, t.mlp, t.module, 0)
        n_out, k_in = (int(v) for v in ckpt.read_array(t.name).tolist())
        rows = len(units) * unit
        return step_json(
            "shardload.constant", [n, 2], t.meta.dtype, [rows, k_in] if split_n else [n_out, rows]
        )
    axis = axes.n if split_n else axes.k
    if axis is None:  # per-part scales of fused layers were refused by padding_layout
        return None
    unit, _ = role.padded_units(spec, padding, t.mlp, t.module, 0)
    indices = [role.padded_units(spec, padding, t.mlp, t.module, r)[1] for r in range(n)]
    if axes.special == "g_idx" and group_size <= 0:  # per channel: every row in group 0
        return step_json(
            "shardload.take_units",
            [n, len(indices[0]) * unit],
            t.meta.dtype,
            (0, unit, *[u for w in indices for u in w]),
        )
    if axes.special == "g_idx":  # row-parallel: the layer's input rows, one per element
        if unit % group_size:  # heads narrower than a group: in runs of whole groups, as
            unit, indices = _runs(t.name, unit, group_size, indices)  # the scales take them
        rows = t.meta.shape[0]
        zero_group = -(-rows // group_size) if act_order else -1
        return step_json(
            "shardload.take_g_idx",
            [n, len(indices[0]) * unit],
            t.meta.dtype,
            (unit, group_size, zero_group, *[u for w in indices for u in w]),
        )
    if not split_n and axes.act_order and act_order:
        # every real group on every worker, then zero groups for the zero rows: as many as
        # the padded layer's input has groups (what an engine sizes a replicated scale by)
        out = [n, *t.meta.shape]
        out[axis.dim + 1] = n * len(indices[0]) * unit // axis.elems * axis.width
        return step_json(
            "shardload.replicate_padded", out, t.meta.dtype, (axis.dim, out[axis.dim + 1])
        )
    if unit % axis.elems:  # heads in runs that fill whole blocks (padding_layout's together)
        unit, indices = _runs(t.name, unit, axis.elems, indices)
    stored = unit // axis.elems * axis.width
    out = [n, *t.meta.shape]
    out[axis.dim + 1] = len(indices[0]) * stored
    taken = [u for worker in indices for u in worker]
    fill = padding.fills.get(t.module) if not split_n and not axes.special else None
    if fill:  # the codes of a per-channel layer whose zero weight is not a stored 0
        return step_json(
            "shardload.take_units_fill", out, t.meta.dtype, (axis.dim, stored, fill, *taken)
        )
    return step_json("shardload.take_units", out, t.meta.dtype, (axis.dim, stored, *taken))


def _runs(name: str, unit: int, elems: int, indices: list[list[int]]) -> tuple[int, list]:
    """Heads of ``unit`` elements taken in runs that fill whole ``elems``-element blocks: each
    worker's heads, read ``run`` at a time, are one aligned run of real heads (its index) or of
    zero heads (-1), as ``head_layout(..., together)`` lays them out."""
    run = math.lcm(unit, elems) // unit
    out = []
    for heads in indices:
        runs = [heads[i : i + run] for i in range(0, len(heads), run)]
        if any(
            len(r) != run
            or not (
                all(h < 0 for h in r) or (r[0] % run == 0 and r == list(range(r[0], r[0] + run)))
            )
            for r in runs
        ):  # padding_layout made them so
            raise AssertionError(f"{name}: heads {heads} are not whole runs of {run}")
        out.append([r[0] // run if r[0] >= 0 else -1 for r in runs])
    return unit * run, out
