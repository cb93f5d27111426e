"""The built-in shard functions: even splits, fused segments with GQA replication, replication.

They only move elements, so they work in any tensor's own units: packed int32 words, rows of
group scales, raw GGUF blocks. Which units a tensor is split in is the planner's business; these
functions just need sizes that divide.

Every function has a shape rule (checked before data is read). Those whose pieces are slices of
the input also have a ``ranges`` rule (which elements worker ``i`` keeps, so it reads only those
bytes) and, where the piece needs it, a ``fixup``; ``BUILTINS`` lists them all, and the registry
registers them. This module imports nothing of the registry: the registry imports it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict

from .. import dtypes
from ..errors import quote
from ..selection import Selection

if TYPE_CHECKING:  # pragma: no cover  (imported where used: planning needs no torch)
    import torch

Shape = tuple[int, ...]
# (start, length) ranges along the split dim that one worker keeps, concatenated in order
Ranges = list[tuple[int, int]]


def _int(value, what: str) -> int:
    """``value`` as an int; numpy integers welcome, bools and floats refused."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {quote(value, 40)}") from None


def _axis(dim: int, ndim: int) -> int:
    dim = _int(dim, "dim")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a {ndim}-D input")
    return dim % ndim


def _workers(num_shards: int) -> int:
    num_shards = _int(num_shards, "num_shards")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    return num_shards


def _check_output(rule, input: torch.Tensor, extra: tuple, output: torch.Tensor) -> None:
    """The loader allocates outputs from validated plans; a direct caller may not have."""
    shape, dtype = rule(
        tuple(input.shape),
        dtypes.from_torch(input.dtype),
        *extra,
        num_shards=output.shape[0] if output.dim() else 0,
    )
    if tuple(output.shape) != tuple(shape) or dtypes.from_torch(output.dtype) != dtype:
        raise ValueError(
            f"output is {list(output.shape)} {dtypes.from_torch(output.dtype)}, "
            f"expected {list(shape)} {dtype}"
        )


def _stack_shape(in_shape: Shape, axis: int, size: int, num_shards: int) -> Shape:
    shape = list(in_shape)
    shape[axis] = size
    return (num_shards, *shape)


# ---- shardload.split ---------------------------------------------------------------------------


def split_ranges(in_shape: Shape, dim: int, num_shards: int) -> tuple[int, list[Ranges]]:
    """The split axis and, per worker, the range it keeps, for ``shardload.split``."""
    axis = _axis(dim, len(in_shape))
    num_shards = _workers(num_shards)
    size = in_shape[axis]
    if size % num_shards:
        raise ValueError(
            f"dim {dim} has size {size}, which does not divide into {num_shards} equal shards"
        )
    piece = size // num_shards
    return axis, [[(i * piece, piece)] for i in range(num_shards)]


def _split_rule(in_shape: Shape, in_dtype: str, dim: int, *, num_shards: int):
    axis, ranges = split_ranges(in_shape, dim, num_shards)
    return _stack_shape(in_shape, axis, ranges[0][0][1], num_shards), in_dtype


def split(input: torch.Tensor, dim: int, output: torch.Tensor) -> None:
    """Split evenly along ``dim``: worker i keeps the i-th of N equal slices."""
    _check_output(_split_rule, input, (dim,), output)
    n = output.shape[0]
    axis = _axis(dim, input.dim())
    src, dst = dtypes.movable_view(input), dtypes.movable_view(output)
    pre, post = src.shape[:axis], src.shape[axis + 1 :]
    # [pre, N, piece, post] -> [N, pre, piece, post]: one strided copy, no temporaries.
    blocks = src.reshape(*pre, n, src.shape[axis] // n, *post).movedim(axis, 0)
    dst.copy_(blocks)


# ---- shardload.split_segments ------------------------------------------------------------------

#: segments of one fused tensor: real ones have a handful of parts ([q, k, v], [gate, up]); the
#: cap keeps the per-worker range lists (N x segments) small for any N
MAX_SEGMENTS = 256


def _parse_segments(extra: Sequence[int]) -> list[tuple[int, int]]:
    if len(extra) == 0 or len(extra) % 2:
        raise ValueError("segments must be given as pairs: size_0, units_0, size_1, units_1, ...")
    if len(extra) > 2 * MAX_SEGMENTS:
        raise ValueError(
            f"{len(extra) // 2} segments, more than the {MAX_SEGMENTS} a fused tensor may have"
        )
    pairs = [
        (_int(extra[k], f"segment {k // 2} size"), _int(extra[k + 1], f"segment {k // 2} units"))
        for k in range(0, len(extra), 2)
    ]
    for k, (size, units) in enumerate(pairs):
        if size < 0 or units == 0:
            raise ValueError(f"segment {k}: size {size} must be >= 0 and units {units} non-zero")
        if size % abs(units):
            raise ValueError(
                f"segment {k}: size {size} is not a whole number of its {abs(units)} units"
            )
    return pairs


def _segment_layout(
    in_shape: Shape, dim: int, segments: Sequence[int], num_shards: int
) -> tuple[int, int, list[tuple[int, int, int]]]:
    """The axis, N, and per segment ``(start, length, replicas)``: worker i keeps ``length``
    elements from ``start + i * length`` (``replicas == 0``) or from
    ``start + (i // replicas) * length`` (replicated units)."""
    axis = _axis(dim, len(in_shape))
    num_shards = _workers(num_shards)
    pairs = _parse_segments(segments)
    total = sum(size for size, _ in pairs)
    if total != in_shape[axis]:
        raise ValueError(
            f"segment sizes add up to {total}, but dim {dim} has size {in_shape[axis]}"
        )
    layout = []
    start = 0
    for k, (size, signed_units) in enumerate(pairs):
        units, replicable = abs(signed_units), signed_units < 0
        if num_shards <= units or not replicable:
            if units % num_shards:
                raise ValueError(
                    f"segment {k} has {units} units, which do not divide among {num_shards} workers"
                )
            layout.append((start, size // num_shards, 0))
        else:
            if num_shards % units:
                raise ValueError(
                    f"segment {k} has {units} units; replicating them to "
                    f"{num_shards} workers needs {num_shards} to be a multiple "
                    f"of {units}"
                )
            layout.append((start, size // units, num_shards // units))
        start += size
    return axis, num_shards, layout


def segment_ranges(
    in_shape: Shape, dim: int, segments: Sequence[int], num_shards: int
) -> tuple[int, list[Ranges]]:
    """The split axis and, per worker, the ranges it keeps, for ``shardload.split_segments``.

    Segment ``k`` is ``size_k`` elements long along the axis and made of ``|units_k|`` equal
    units (heads, packed words, quantization groups). Each worker keeps ``|units_k| / N`` whole
    units of it, so N must divide ``|units_k|``. A *negative* ``units_k`` marks a segment whose
    units may also be replicated (KV heads under GQA): when N exceeds them, N must be a multiple
    of them and worker i keeps unit ``i // (N // |units_k|)``, as vLLM's QKVParallelLinear does.
    At most ``MAX_SEGMENTS`` segments.
    """
    axis, num_shards, layout = _segment_layout(in_shape, dim, segments, num_shards)
    per_worker: list[Ranges] = [[] for _ in range(num_shards)]
    for start, length, replicas in layout:
        for i in range(num_shards):
            offset = (i // replicas) if replicas else i
            per_worker[i].append((start + offset * length, length))
    return axis, per_worker


def _segments_rule(in_shape: Shape, in_dtype: str, dim: int, *segments: int, num_shards: int):
    axis, num_shards, layout = _segment_layout(in_shape, dim, segments, num_shards)
    return _stack_shape(
        in_shape, axis, sum(length for _, length, _ in layout), num_shards
    ), in_dtype


def split_segments(input: torch.Tensor, dim: int, *segments_and_output) -> None:
    """Split a fused tensor ([q, k, v], [gate, up]) segment by segment along ``dim``.

    Extra args: ``dim, size_0, units_0, size_1, units_1, ...``; each segment is split into whole
    units on its own (negative units: replicated when workers outnumber them, as GQA's KV heads
    need), and each worker's pieces are concatenated in segment order.
    """
    *segments, output = segments_and_output
    _check_output(_segments_rule, input, (dim, *segments), output)
    n = output.shape[0]
    axis, ranges = segment_ranges(tuple(input.shape), dim, segments, n)
    src, dst = dtypes.movable_view(input), dtypes.movable_view(output)
    for i, worker_ranges in enumerate(ranges):
        offset = 0
        for start, length in worker_ranges:
            dst[i].narrow(axis, offset, length).copy_(src.narrow(axis, start, length))
            offset += length


# ---- shardload.replicate -----------------------------------------------------------------------


def _replicate_rule(in_shape: Shape, in_dtype: str, *, num_shards: int):
    return (_workers(num_shards), *in_shape), in_dtype


def replicate(input: torch.Tensor, output: torch.Tensor) -> None:
    """Give every worker the whole tensor (stacked N times along a new axis 0)."""
    _check_output(_replicate_rule, input, (), output)
    dtypes.movable_view(output).copy_(
        dtypes.movable_view(input).unsqueeze(0).expand_as(dtypes.movable_view(output))
    )


# ---- shardload.split_rebase --------------------------------------------------------------------

_INTEGER = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def _split_rebase_rule(in_shape: Shape, in_dtype: str, dim: int, *, num_shards: int):
    if in_dtype not in _INTEGER:
        raise ValueError(f"rebasing needs an integer index tensor, got {in_dtype}")
    return _split_rule(in_shape, in_dtype, dim, num_shards=num_shards)


def split_rebase(input: torch.Tensor, dim: int, output: torch.Tensor) -> None:
    """Split like ``shardload.split``, then subtract each piece's first element from it.

    For GPTQ ``g_idx`` on row-parallel layers without act-order: worker i's rows
    ``[k0, k1)`` keep group indices ``g_idx[k0:k1] - g_idx[k0]``, counted in its own
    slice of the scales and zeros.
    """
    _check_output(_split_rebase_rule, input, (dim,), output)
    split(input, dim, output)
    for piece in output:
        piece.copy_(rebase(piece))


def rebase(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` minus its first element, in its own dtype (what each worker of
    ``shardload.split_rebase`` keeps; the loader applies it to a directly read slice)."""
    import torch

    if piece.numel() == 0:
        return piece
    # torch has no arithmetic on uint16/32/64; indices fit int64 either way
    wide = piece.to(torch.int64, copy=True)
    return (wide - wide.reshape(-1)[0].item()).to(piece.dtype)


# ---- shardload.constant ------------------------------------------------------------------------


def _constant_rule(in_shape: Shape, in_dtype: str, *values: int, num_shards: int):
    if len(in_shape) != 1 or in_shape[0] != len(values):
        raise ValueError(
            f"the input must be a vector of {len(values)} values, got shape {list(in_shape)}"
        )
    if in_dtype not in _INTEGER:
        raise ValueError(f"constant values are integers, the input is {in_dtype}")
    lo, hi = dtypes.INTEGER_RANGE[in_dtype]
    for k, v in enumerate(values):
        v = _int(v, f"constant value {k}")
        if not lo <= v <= hi:
            raise ValueError(
                f"constant value {k} is {v}, which does not fit {in_dtype} [{lo}, {hi}]"
            )
    return (_workers(num_shards), len(values)), in_dtype


def constant(input: torch.Tensor, *values_and_output) -> None:
    """Give every worker the given integers instead of the stored vector (same length and dtype).

    For metadata that describes the shard itself, such as compressed-tensors' ``weight_shape``:
    each worker's ``[rows, cols]`` are written as expressions of ``num_shards``. Every value must
    fit the vector's dtype (a bool or float is refused, not converted).
    """
    import torch

    *values, output = values_and_output
    _check_output(_constant_rule, input, tuple(values), output)
    # every value fits the dtype (checked above); uint64 beyond int64 goes in by its bit pattern
    words = [int(v) - 2**64 if int(v) > 2**63 - 1 else int(v) for v in values]
    row = torch.tensor(words, dtype=torch.int64)
    if output.dtype == torch.uint64:
        row = row.view(torch.uint64)
    else:
        row = row.to(output.dtype)
    dtypes.movable_view(output).copy_(dtypes.movable_view(row).expand(output.shape))


# ---- shardload.repeat_segments -----------------------------------------------------------------


def _repeat_rule(in_shape: Shape, in_dtype: str, *sizes: int, num_shards: int):
    sizes = tuple(_int(s, "a segment size") for s in sizes)
    if not sizes or any(s < 0 for s in sizes):
        raise ValueError("give one non-negative size per segment")
    if sum(sizes) > dtypes.MAX_DIM:
        raise ValueError(
            f"the sizes add up to {sum(sizes)} rows, beyond the {dtypes.MAX_DIM} "
            "(2**53) any dim may have"
        )
    if tuple(in_shape) not in ((len(sizes),), (len(sizes), 1)):
        raise ValueError(
            f"the input must hold one value per segment ({len(sizes)}), got shape {list(in_shape)}"
        )
    _workers(num_shards)
    return (sum(sizes), 1), in_dtype


def repeat_segments(input: torch.Tensor, *sizes_and_output) -> None:
    """Expand one value per segment into one per row: ``[S] -> [sum(sizes), 1]``.

    A fused [q, k, v] weight with a per-tensor scale for each part becomes per-channel scaled,
    exactly (the same scale on every row of its part), so a worker's piece, which mixes rows of
    all parts, keeps a scale it can use; a following ``split_segments`` splits it like the
    weight. Nothing is re-quantized.
    """
    import torch

    *sizes, output = sizes_and_output
    _check_output(_repeat_rule, input, tuple(sizes), output)
    values = input.reshape(-1)
    output.copy_(
        torch.repeat_interleave(values, torch.tensor([int(s) for s in sizes])).reshape(-1, 1)
    )


# ---- shardload.take_units ----------------------------------------------------------------------


def take_ranges(
    in_shape: Shape, dim: int, unit: int, indices: Sequence[int], num_shards: int
) -> tuple[int, int, list[list[int]]]:
    """The axis, the unit length, and per worker the unit indices it takes (-1: a zero unit)."""
    axis = _axis(dim, len(in_shape))
    num_shards = _workers(num_shards)
    unit = _int(unit, "unit")
    if unit <= 0 or in_shape[axis] % unit:
        raise ValueError(
            f"dim {dim} has size {in_shape[axis]}, not a whole number of units of {unit}"
        )
    units = in_shape[axis] // unit
    indices = [_int(v, "a unit index") for v in indices]
    if not indices or len(indices) % num_shards:
        raise ValueError(
            f"{len(indices)} unit indices do not give each of {num_shards} workers the same number"
        )
    bad = [v for v in indices if not -1 <= v < units]
    if bad:
        raise ValueError(
            f"unit index {bad[0]} is out of range for {units} units (-1 is a zero unit)"
        )
    per = len(indices) // num_shards
    return axis, unit, [indices[i * per : (i + 1) * per] for i in range(num_shards)]


def _take_rule(in_shape: Shape, in_dtype: str, dim: int, unit: int, *indices: int, num_shards: int):
    axis, unit, per_worker = take_ranges(in_shape, dim, unit, indices, num_shards)
    return _stack_shape(in_shape, axis, len(per_worker[0]) * unit, num_shards), in_dtype


def take_units(input: torch.Tensor, dim: int, unit: int, *indices_and_output) -> None:
    """Give each worker chosen units of ``dim`` (heads, blocks); index -1 is a unit of zeros.

    Extra args: ``dim, unit, i_0_0, ..., i_0_m, i_1_0, ...``: N equal lists of unit indices.
    Zero units pad heads or MLP blocks when N does not divide them: a zero block dequantizes to
    exact zeros in every supported format, so padded rows and columns change no output.
    """
    *indices, output = indices_and_output
    _check_output(_take_rule, input, (dim, unit, *indices), output)
    axis, unit, per_worker = take_ranges(tuple(input.shape), dim, unit, indices, output.shape[0])
    src, dst = dtypes.movable_view(input), dtypes.movable_view(output)
    dst.zero_()
    for i, wanted in enumerate(per_worker):
        for j, u in enumerate(wanted):
            if u >= 0:
                dst[i].narrow(axis, j * unit, unit).copy_(src.narrow(axis, u * unit, unit))


# ---- shardload.take_units_fill -----------------------------------------------------------------


def _take_fill_rule(
    in_shape: Shape, in_dtype: str, dim: int, unit: int, fill: int, *indices: int, num_shards: int
):
    _fill_value(fill, in_dtype)
    return _take_rule(in_shape, in_dtype, dim, unit, *indices, num_shards=num_shards)


def _fill_value(fill: int, dtype: str) -> int:
    fill = _int(fill, "fill")
    lo, hi = dtypes.INTEGER_RANGE.get(dtype, (1, 0))
    if not lo <= fill <= hi:
        raise ValueError(f"fill {fill} is not a value of the integer dtype {dtype}")
    return fill


def _fill_zero_units(
    piece: torch.Tensor, axis: int, unit: int, units: Sequence[int], fill: int
) -> None:
    for j, u in enumerate(units):
        if u < 0:
            piece.narrow(axis, j * unit, unit).fill_(fill)


def take_units_fill(
    input: torch.Tensor, dim: int, unit: int, fill: int, *indices_and_output
) -> None:
    """As ``take_units``, with every element of a zero unit ``fill`` instead of 0.

    Extra args: ``dim, unit, fill, i_0_0, ...``. For the codes of a row-parallel layer quantized
    per channel whose zero code is not 0 (GPTQ's zero point, compressed-tensors' offset): a
    padded row shares its column's scale with the real rows, so it is a zero weight only when
    every code in it is the zero code; ``fill`` is that code in every field of a packed word
    (symmetric 4-bit: 0x88888888).
    """
    *indices, output = indices_and_output
    _check_output(_take_fill_rule, input, (dim, unit, fill, *indices), output)
    take_units(input, dim, unit, *indices, output)
    axis, unit, per_worker = take_ranges(tuple(input.shape), dim, unit, indices, output.shape[0])
    for i, wanted in enumerate(per_worker):
        _fill_zero_units(output[i], axis, unit, wanted, fill)


# ---- shardload.replicate_padded ----------------------------------------------------------------


def _replicate_padded_rule(in_shape: Shape, in_dtype: str, dim: int, size: int, *, num_shards: int):
    axis = _axis(dim, len(in_shape))
    size = _int(size, "size")
    if not in_shape[axis] <= size <= dtypes.MAX_DIM:
        raise ValueError(
            f"dim {dim} has size {in_shape[axis]}: padding it to {size} would drop elements"
            if size < in_shape[axis]
            else f"size {size} is beyond the {dtypes.MAX_DIM} (2**53) any dim may have"
        )
    return _stack_shape(in_shape, axis, size, num_shards), in_dtype


def replicate_padded(input: torch.Tensor, dim: int, size: int, output: torch.Tensor) -> None:
    """Give every worker the whole tensor with zeros appended along ``dim`` up to ``size``.

    For act-order scales and zero points of a zero-padded row-parallel layer: every worker
    needs every real group (any input row may use any group), and the zero rows padding adds
    need groups of their own, whose zero scale makes any code dequantize to exactly 0
    (``take_g_idx`` points them there).
    """
    _check_output(_replicate_padded_rule, input, (dim, size), output)
    axis = _axis(dim, input.dim())
    dst = dtypes.movable_view(output)
    dst.zero_()
    dst.narrow(axis + 1, 0, input.shape[axis]).copy_(
        dtypes.movable_view(input).unsqueeze(0).expand(output.shape[0], *input.shape)
    )


# ---- shardload.take_g_idx ----------------------------------------------------------------------


def _g_idx_args(
    in_shape: Shape,
    in_dtype: str,
    unit: int,
    group: int,
    zero_group: int,
    indices: Sequence[int],
    num_shards: int,
):
    if len(in_shape) != 1 or in_dtype not in _INTEGER:
        raise ValueError(f"a g_idx is a vector of integers, got {list(in_shape)} {in_dtype}")
    group, zero_group = _int(group, "group"), _int(zero_group, "zero_group")
    axis, unit, per_worker = take_ranges(in_shape, 0, unit, indices, num_shards)
    if group <= 0 or unit % group:
        raise ValueError(f"units of {unit} rows are not whole groups of {group}")
    if zero_group < -1:
        raise ValueError(f"zero_group is a group index, or -1, got {zero_group}")
    return unit, group, zero_group, per_worker


def _take_g_idx_rule(
    in_shape: Shape,
    in_dtype: str,
    unit: int,
    group: int,
    zero_group: int,
    *indices: int,
    num_shards: int,
):
    unit, _, _, per_worker = _g_idx_args(
        in_shape, in_dtype, unit, group, zero_group, indices, num_shards
    )
    return (len(per_worker), len(per_worker[0]) * unit), in_dtype


def _renumber(
    piece: torch.Tensor, units: Sequence[int], unit: int, group: int, zero_group: int
) -> None:
    """One worker's g_idx after its units were taken (zero units read as zeros): see
    ``take_g_idx``."""
    import torch

    if zero_group < 0:  # groups in storage order, the worker's own
        local = torch.arange(piece.numel(), dtype=torch.int64) // group
        piece.copy_(local.to(piece.dtype))
        return
    padded = 0
    for slot, u in enumerate(units):
        if u < 0:
            rows = torch.arange(padded, padded + unit, dtype=torch.int64) // group + zero_group
            piece.narrow(0, slot * unit, unit).copy_(rows.to(piece.dtype))
            padded += unit


def take_g_idx(
    input: torch.Tensor, unit: int, group: int, zero_group: int, *indices_and_output
) -> None:
    """Each worker's ``g_idx`` (a row's quantization group) for its units of the input rows,
    some of them zero units, under zero-padding of a row-parallel layer.

    Extra args: ``unit, group, zero_group, i_0_0, ...``: rows per unit (whole groups), the
    group size, and N equal lists of unit indices (-1: a zero unit), as ``take_units``.

    * ``zero_group`` -1 (no act-order: rows sit in groups in storage order, and each worker
      takes its groups' scales by the same units): worker row ``r`` is in group ``r // group``
      of its own scales, a zero unit's rows in the zero groups its scales got there.
    * ``zero_group`` g >= 0 (act-order: every worker holds every real group, and
      ``replicate_padded`` appended zero groups from g on): real rows keep their group; the
      ``j``-th zero row of a worker is in group ``g + j // group``.

    Either way a zero row's codes are 0 and its group's scale is 0, so it dequantizes to 0.
    """
    *indices, output = indices_and_output
    _check_output(_take_g_idx_rule, input, (unit, group, zero_group, *indices), output)
    unit, group, zero_group, per_worker = _g_idx_args(
        tuple(input.shape),
        dtypes.from_torch(input.dtype),
        unit,
        group,
        zero_group,
        indices,
        output.shape[0],
    )
    take_units(input, 0, unit, *indices, output)
    for i, units in enumerate(per_worker):
        _renumber(output[i], units, unit, group, zero_group)


# ---- what each worker's piece is, for reading only its bytes -----------------------------------


def _split_selection(
    in_shape: Shape, in_dtype: str, dim: int, *, num_shards: int, index: int
) -> Selection:
    axis, ranges = split_ranges(in_shape, dim, num_shards)
    return Selection(axis, tuple(ranges[index]))


def _segments_selection(
    in_shape: Shape, in_dtype: str, dim: int, *segments: int, num_shards: int, index: int
) -> Selection:
    axis, num_shards, layout = _segment_layout(in_shape, dim, segments, num_shards)
    return Selection(
        axis,
        tuple(
            (start + ((index // replicas) if replicas else index) * length, length)
            for start, length, replicas in layout
        ),
    )


def _replicate_selection(
    in_shape: Shape, in_dtype: str, *, num_shards: int, index: int
) -> Selection:
    return Selection.whole()


def _take_selection(
    in_shape: Shape, in_dtype: str, dim: int, unit: int, *indices: int, num_shards: int, index: int
) -> Selection:
    axis, unit, per_worker = take_ranges(in_shape, dim, unit, indices, num_shards)
    return Selection(axis, tuple((None if u < 0 else u * unit, unit) for u in per_worker[index]))


def _take_fill_selection(
    in_shape: Shape,
    in_dtype: str,
    dim: int,
    unit: int,
    fill: int,
    *indices: int,
    num_shards: int,
    index: int,
) -> Selection:
    return _take_selection(
        in_shape, in_dtype, dim, unit, *indices, num_shards=num_shards, index=index
    )


def _take_fill_fixup(
    piece: torch.Tensor, dim: int, unit: int, fill: int, *indices: int, num_shards: int, index: int
) -> None:
    # the ranges rule checked these args against the stored tensor before anything was read
    per = len(indices) // num_shards
    _fill_zero_units(
        piece, _axis(dim, piece.dim()), unit, indices[index * per : (index + 1) * per], fill
    )


def _replicate_padded_selection(
    in_shape: Shape, in_dtype: str, dim: int, size: int, *, num_shards: int, index: int
) -> Selection:
    axis = _axis(dim, len(in_shape))
    return Selection(axis, ((0, in_shape[axis]), (None, _int(size, "size") - in_shape[axis])))


def _take_g_idx_selection(
    in_shape: Shape,
    in_dtype: str,
    unit: int,
    group: int,
    zero_group: int,
    *indices: int,
    num_shards: int,
    index: int,
) -> Selection:
    unit, _, _, per_worker = _g_idx_args(
        in_shape, in_dtype, unit, group, zero_group, indices, num_shards
    )
    return Selection(0, tuple((None if u < 0 else u * unit, unit) for u in per_worker[index]))


def _take_g_idx_fixup(
    piece: torch.Tensor,
    unit: int,
    group: int,
    zero_group: int,
    *indices: int,
    num_shards: int,
    index: int,
) -> None:
    # the ranges rule checked these args against the stored g_idx before anything was read
    per = len(indices) // num_shards
    _renumber(piece, indices[index * per : (index + 1) * per], unit, group, zero_group)


def _rebase_fixup(piece: torch.Tensor, dim: int, *, num_shards: int, index: int) -> None:
    piece.copy_(rebase(piece))


class Rules(TypedDict, total=False):
    """A built-in's rules: the keyword arguments ``registry.register_shard_func`` takes."""

    shape_rule: Callable[..., tuple[Sequence[int], str]]
    ranges: Callable[..., Selection]
    fixup: Callable[..., None]


#: (name, function, rules) of every built-in, registered by ``shardload.registry``
BUILTINS: list[tuple[str, Callable[..., object], Rules]] = [
    ("shardload.split", split, Rules(shape_rule=_split_rule, ranges=_split_selection)),
    (
        "shardload.split_segments",
        split_segments,
        Rules(shape_rule=_segments_rule, ranges=_segments_selection),
    ),
    (
        "shardload.replicate",
        replicate,
        Rules(shape_rule=_replicate_rule, ranges=_replicate_selection),
    ),
    (
        "shardload.split_rebase",
        split_rebase,
        Rules(shape_rule=_split_rebase_rule, ranges=_split_selection, fixup=_rebase_fixup),
    ),
    # a piece made of values, not of the input's elements: computed (it is a few integers)
    ("shardload.constant", constant, Rules(shape_rule=_constant_rule)),
    # a piece larger than the input: computed (per-part scales, a handful of numbers)
    ("shardload.repeat_segments", repeat_segments, Rules(shape_rule=_repeat_rule)),
    ("shardload.take_units", take_units, Rules(shape_rule=_take_rule, ranges=_take_selection)),
    (
        "shardload.take_units_fill",
        take_units_fill,
        Rules(shape_rule=_take_fill_rule, ranges=_take_fill_selection, fixup=_take_fill_fixup),
    ),
    (
        "shardload.replicate_padded",
        replicate_padded,
        Rules(shape_rule=_replicate_padded_rule, ranges=_replicate_padded_selection),
    ),
    (
        "shardload.take_g_idx",
        take_g_idx,
        Rules(shape_rule=_take_g_idx_rule, ranges=_take_g_idx_selection, fixup=_take_g_idx_fixup),
    ),
]
