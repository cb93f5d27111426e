"""The four built-in shard functions, checked against numpy references written from the spec.

The references below (``ref_split``, ``ref_segments``, ``ref_replicate``, ``ref_rebase``) are
written from the written contract of each function, not from its implementation, and use only
numpy slicing, ``np.split`` and ``np.concatenate``:

* ``shardload.split(input, dim, output)``: worker i keeps the i-th of N equal slices along dim.
* ``shardload.split_segments(input, dim, size_0, units_0, ..., output)``: each segment is split
  on its own into whole units, and each worker's pieces are concatenated in segment order.
  ``units > 0``: N equal slices, N must divide units, never replicated (N > units is an error).
  ``units < 0`` (replicable, GQA's KV heads): with U = -units, N <= U: N equal slices (N must
  divide U); N > U: N must be a multiple of U and unit ``i // (N // U)`` goes to worker i.
  ``units == 0`` is an error, and every size must be a multiple of ``|units|``.
* ``shardload.replicate(input, output)``: every worker gets the whole input.
* ``shardload.split_rebase(input, dim, output)``: split, then subtract each piece's own first
  (flattened) element from the piece; integer dtypes only.

Tensors are compared bit for bit: each dtype is paired with a numpy integer dtype of the same
width (``bool`` stays ``bool``), inputs are made from random bits of that width and outputs are
viewed back as those bits. So NaN payloads, bfloat16, float8 and uint32 are all checked exactly.
"""

from __future__ import annotations

import re
from functools import reduce

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardload

NAMES = (
    "shardload.split",
    "shardload.split_segments",
    "shardload.replicate",
    "shardload.split_rebase",
)
# Worker counts of the example-based grids below, each for a path it takes: 1 = no split (every
# worker's piece is the whole axis), 3 = an odd prime (a middle piece; sizes no power of two
# divides), 4 = a power of two above 2 (the usual TP sizes; with 4 the segment layouts also have
# a proper divisor, 2, so KV heads are replicated to groups of workers, not to all of them).
# 2 and 8 take the same paths as 4; the hypothesis tests at the end draw N from 1 to 16.
NS = (1, 3, 4)

# dtype name -> (torch dtype, numpy dtype holding the same bits)
DTYPES: dict[str, tuple[torch.dtype, type]] = {
    "float16": (torch.float16, np.int16),
    "bfloat16": (torch.bfloat16, np.int16),
    "float32": (torch.float32, np.int32),
    "int32": (torch.int32, np.int32),
    "int8": (torch.int8, np.int8),
    "uint8": (torch.uint8, np.uint8),
    "uint32": (torch.uint32, np.int32),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.uint8),
    "bool": (torch.bool, np.bool_),
    "int16": (torch.int16, np.int16),
    "int64": (torch.int64, np.int64),
}
# Every dtype the element-moving functions must move bit for bit (the hypothesis tests draw
# from all of them).
MOVE_DTYPES = (
    "float16",
    "bfloat16",
    "float32",
    "int32",
    "int8",
    "uint8",
    "uint32",
    "float8_e4m3fn",
    "bool",
    "int16",
    "int64",
)
# The dtypes the example grids run (each at one shape and N: the functions' shape handling does
# not depend on the dtype, and dtypes.movable_view is applied to the whole tensor before any
# shape work). One per itemsize class, plus each dtype that takes its own path:
#   uint8 (1 byte, moved as is), float16 (2 bytes; a float, so random bits include NaN payloads
#   that must survive), float32 (4 bytes, float), int64 (8 bytes), bfloat16 (a 2-byte float
#   torch handles apart from float16), float8_e4m3fn and bool (moved through a uint8 view,
#   dtypes.movable_view), uint32 (moved through an int32 view: MLC's packed words).
# int8, int16 and int32 move like uint8, float16 and float32: the same width, no view.
GRID_DTYPES = (
    "uint8",
    "float16",
    "float32",
    "int64",
    "bfloat16",
    "float8_e4m3fn",
    "bool",
    "uint32",
)
# integer dtypes whose subtraction torch supports everywhere; uint32 has its own test below
REBASE_DTYPES = ("int8", "uint8", "int16", "int32", "int64")
_BITS_TORCH = {
    np.int8: torch.int8,
    np.uint8: torch.uint8,
    np.int16: torch.int16,
    np.int32: torch.int32,
    np.int64: torch.int64,
}

HYPOTHESIS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ----------------------------------------------------------------------------------------------
# helpers


def func(name: str):
    return shardload.get_shard_func(name).func


def rule(name: str):
    return shardload.get_shard_func(name).shape_rule


def make_input(shape, dtype: str, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """A torch tensor of ``dtype`` made of random bits, and a numpy copy of those bits."""
    tdtype, bits = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    if bits is np.bool_:
        arr = rng.integers(0, 2, size=shape).astype(np.bool_)
        return torch.from_numpy(arr.copy()), arr
    info = np.iinfo(bits)
    arr = rng.integers(info.min, info.max, size=shape, dtype=bits, endpoint=True)
    return torch.from_numpy(arr.copy()).view(tdtype), arr


def to_bits(t: torch.Tensor) -> np.ndarray:
    """The bits of ``t`` as the numpy dtype paired with its dtype."""
    name = str(t.dtype).removeprefix("torch.")
    bits = DTYPES[name][1]
    if bits is np.bool_:
        return t.numpy().copy()
    return t.contiguous().view(_BITS_TORCH[bits]).numpy().copy()


def alloc(shape, dtype: str) -> torch.Tensor:
    """An output buffer filled with a sentinel, so elements nobody wrote stand out."""
    out = torch.empty(tuple(shape), dtype=DTYPES[dtype][0])
    if dtype == "bool":
        out.fill_(True)
    else:
        out.view(torch.uint8).fill_(0xA5)
    return out


def sl(ndim: int, axis: int, start: int, stop: int) -> tuple:
    return (slice(None),) * axis + (slice(start, stop),)


def assert_bits_equal(out: torch.Tensor, expected: np.ndarray) -> None:
    got = to_bits(out)
    assert got.shape == expected.shape
    assert got.dtype == expected.dtype
    if not np.array_equal(got, expected):
        bad = np.argwhere(got != expected)
        raise AssertionError(
            f"{len(bad)} of {got.size} elements differ; first at "
            f"{tuple(bad[0])}: got {got[tuple(bad[0])]!r}, expected "
            f"{expected[tuple(bad[0])]!r}"
        )


def assert_value_error(call, *patterns: str) -> str:
    """``call()`` raises ValueError whose message matches every regex in ``patterns``."""
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    for pat in patterns:
        assert re.search(pat, msg), f"message {msg!r} does not mention {pat!r}"
    return msg


def num(n: int) -> str:
    """A regex for the integer ``n`` standing on its own in a message."""
    return rf"(?<![\d]){re.escape(str(n))}(?![\d])"


# ---- numpy references, from the spec -----------------------------------------------------------


def ref_split(x: np.ndarray, dim: int, n: int) -> np.ndarray:
    axis = dim % x.ndim
    assert x.shape[axis] % n == 0
    return np.stack(np.split(x, n, axis=axis))


def ref_plan(segs, n: int) -> list[tuple[bool, int]]:
    """Per segment, from the spec: (replicated, |units|); ValueError where the spec forbids it."""
    plan = []
    for size, units in segs:
        if units == 0 or size < 0:
            raise ValueError(f"ref: units {units} / size {size}")
        count = abs(units)
        if size % count:
            raise ValueError(f"ref: size {size} is not a multiple of {count}")
        if n <= count or units > 0:  # split; positive units are never replicated
            if count % n:
                raise ValueError(f"ref: {n} does not divide {count}")
            plan.append((False, count))
        else:  # negative units, more workers than units: replicate
            if n % count:
                raise ValueError(f"ref: {n} is not a multiple of {count}")
            plan.append((True, count))
    return plan


def ref_segments(x: np.ndarray, dim: int, segs, n: int) -> np.ndarray:
    """The spec's result; raises ValueError where the spec makes (segs, n) an error."""
    axis = dim % x.ndim
    plan = ref_plan(segs, n)
    assert sum(size for size, _ in segs) == x.shape[axis]
    pieces: list[list[np.ndarray]] = [[] for _ in range(n)]
    start = 0
    for (size, _), (replicated, count) in zip(segs, plan):
        seg = x[sl(x.ndim, axis, start, start + size)]
        if not replicated:
            parts = np.split(seg, n, axis=axis)
            for i in range(n):
                pieces[i].append(parts[i])
        else:
            unit_parts = np.split(seg, count, axis=axis)
            replicas = n // count
            for i in range(n):
                pieces[i].append(unit_parts[i // replicas])
        start += size
    return np.stack([np.concatenate(p, axis=axis) for p in pieces])


def ref_replicate(x: np.ndarray, n: int) -> np.ndarray:
    return np.stack([x] * n)


def ref_rebase(x: np.ndarray, dim: int, n: int) -> np.ndarray:
    """Split, then subtract each piece's first element, wrapping in the input's own dtype."""
    pieces = ref_split(x, dim, n).copy()
    for i in range(n):
        if pieces[i].size:
            pieces[i] = pieces[i] - pieces[i].reshape(-1)[0]
    return pieces


def segment_args(segs) -> list[int]:
    """``[size_0, units_0, size_1, units_1, ...]``, signs of the units kept."""
    return [v for pair in segs for v in pair]


# ---- round trips, from the spec ----------------------------------------------------------------


def check_split_round_trip(out_bits: np.ndarray, x_bits: np.ndarray, dim: int) -> None:
    axis = dim % x_bits.ndim
    back = np.concatenate(list(out_bits), axis=axis)
    assert np.array_equal(back, x_bits)


def check_segments_round_trip(
    out_bits: np.ndarray, x_bits: np.ndarray, dim: int, segs, n: int
) -> None:
    """Re-assemble every segment from the workers' pieces.

    Without replication the N pieces of a segment concatenate back to it; with GQA replication
    (negative units, fewer than N) the workers of each replica group hold identical pieces and
    one per group gives it back.
    """
    axis = dim % x_bits.ndim
    offset = 0  # where this segment's piece starts in each worker's output
    start = 0  # where this segment starts in the input
    for size, units in segs:
        if n <= abs(units):
            length, replicas = size // n, 1
        else:
            assert units < 0, "positive units are never replicated"
            length, replicas = size // -units, n // -units
        worker_pieces = [
            out_bits[i][sl(x_bits.ndim, axis, offset, offset + length)] for i in range(n)
        ]
        groups = [worker_pieces[g * replicas : (g + 1) * replicas] for g in range(n // replicas)]
        for group in groups:
            for piece in group[1:]:
                assert np.array_equal(piece, group[0]), "replicas differ"
        back = np.concatenate([group[0] for group in groups], axis=axis)
        assert np.array_equal(back, x_bits[sl(x_bits.ndim, axis, start, start + size)])
        offset += length
        start += size
    assert offset == out_bits.shape[1 + axis]


# ----------------------------------------------------------------------------------------------
# the registry


def test_list_shard_funcs_has_the_builtins():
    funcs = {f.name: f for f in shardload.list_shard_funcs()}
    for name in NAMES:
        assert name in funcs, f"{name} is not registered"
        entry = funcs[name]
        assert callable(entry.shape_rule), f"{name} has no shape rule"
        assert isinstance(entry.doc, str) and entry.doc.strip(), f"{name} has no doc"
        assert "\n" not in entry.doc, f"{name}'s doc is not one line: {entry.doc!r}"
        assert shardload.get_shard_func(name) is entry or shardload.get_shard_func(name) == entry


# ----------------------------------------------------------------------------------------------
# shardload.split

# (ndim, dim): the split dim is given size N * 3; the others are small and distinct. Each case
# is a different reshape/movedim in split: 1-D with a negative dim (nothing before or after the
# axis), the last axis of 2-D (dims before it only), a middle axis (dims on both sides), the
# first axis of 4-D (three dims after it, one of size 1), and a negative middle axis of 4-D.
# Dims counted from either end are normalised once (_axis), so one negative case per position
# class is enough; the hypothesis test draws any ndim and sign.
SPLIT_CASES = [(1, -1), (2, 1), (3, 1), (4, 0), (4, -2)]
# the shape and N the dtype grids use: a middle axis, an odd N
DTYPE_CASE = dict(n=3, ndim=3, dim=1)


def split_shape(ndim: int, dim: int, n: int, per: int = 3) -> tuple[int, ...]:
    shape = [2, 5, 1, 3][:ndim]
    shape[dim % ndim] = n * per
    return tuple(shape)


def check_split(n: int, ndim: int, dim: int, dtype: str) -> None:
    shape = split_shape(ndim, dim, n)
    x, xb = make_input(shape, dtype, seed=n * 100 + ndim * 10 + dim)
    expected = ref_split(xb, dim, n)
    out = alloc(expected.shape, dtype)
    func("shardload.split")(x, dim, out)
    assert_bits_equal(out, expected)
    assert np.array_equal(to_bits(x), xb), "input was modified"
    check_split_round_trip(to_bits(out), xb, dim)
    out_shape, out_dtype = rule("shardload.split")(shape, dtype, dim, num_shards=n)
    assert tuple(out_shape) == expected.shape
    assert out_dtype == dtype


@pytest.mark.parametrize("ndim,dim", SPLIT_CASES)
@pytest.mark.parametrize("n", NS)
def test_split_matches_reference(n, ndim, dim):
    check_split(n, ndim, dim, "int32")


@pytest.mark.parametrize("dtype", GRID_DTYPES)
def test_split_moves_every_dtype_bit_for_bit(dtype):
    check_split(dtype=dtype, **DTYPE_CASE)


@pytest.mark.parametrize("n", NS)
def test_split_empty_slices(n):
    x, xb = make_input((0, 4), "float16")
    expected = ref_split(xb, 0, n)
    out = alloc(expected.shape, "float16")
    func("shardload.split")(x, 0, out)
    assert tuple(out.shape) == expected.shape
    assert tuple(rule("shardload.split")((0, 4), "float16", 0, num_shards=n)[0]) == expected.shape


# (10, 4): N and the size share a factor but N does not divide it; (10, 3): coprime; (7, 16):
# more workers than elements. (12, 8), (5, 2) and (1, 2) took the same check (size % N).
@pytest.mark.parametrize("size,n", [(10, 3), (10, 4), (7, 16)])
def test_split_indivisible_is_an_error(size, n):
    shape = (4, size)
    assert_value_error(
        lambda: rule("shardload.split")(shape, "float16", 1, num_shards=n),
        r"(?i)divi|equal",
        num(size),
        num(n),
    )
    x, _ = make_input(shape, "float16")
    # the function checks its arguments itself (a direct caller has no validated plan): the
    # dim, its size and N, not an IndexError from the copy
    with pytest.raises(ValueError, match=rf"dim 1 has size {size}\b.* {n} equal shards"):
        func("shardload.split")(x, 1, alloc((n, 4, size // n), "float16"))


# the first dim out of range at each end of a 2-D input (an off-by-one in either bound of the
# range check fails one of them); 3 and -4 took the same two comparisons
@pytest.mark.parametrize("dim", [2, -3])
def test_split_dim_out_of_range_is_an_error(dim):
    assert_value_error(
        lambda: rule("shardload.split")((4, 6), "int32", dim, num_shards=2),
        r"(?i)dim|axis|range",
        num(abs(dim)),
    )
    x, _ = make_input((4, 6), "int32")
    with pytest.raises(ValueError, match=rf"dim {dim} is out of range for a 2-D input"):
        func("shardload.split")(x, dim, alloc((2, 2, 6), "int32"))


# ----------------------------------------------------------------------------------------------
# shardload.split_segments


def segment_layouts(n: int) -> list[list[tuple[int, int]]]:
    """Layouts (size, units) valid for n workers: plain splits and, where n has proper divisors,
    replicated (GQA) segments; unit sizes vary between segments. Query/gate/up units are
    positive (split only), KV units negative (replicable)."""
    layouts = [
        [(2 * n * 3, 2 * n)],  # one segment
        [(2 * n * 2, 2 * n), (n * 3, -n), (n * 3, -n)],  # q, k, v with kv units == n
        [(n * 4, n), (n * 4, 4 * n)],  # gate, up with different units
        [(n * 2, -n), (n * 6, -2 * n)],  # replicable units that still split
    ]
    proper = [d for d in range(1, n) if n % d == 0]
    for d in proper:  # kv heads fewer than workers: each replicated n // d times
        layouts.append([(2 * n * 2, 2 * n), (d * 3, -d), (d * 3, -d)])
    if n > 1:
        layouts.append([(n * 2, n), (0, -1), (2, -1)])  # an empty and an MQA segment
    return layouts


# Every layout for each N in NS, on a middle axis of a 3-D input: the layouts are where the
# paths differ (plain splits, unit counts differing between segments, replicable units that
# still split, KV heads replicated to all workers (N = 3, 4) or to pairs of them (N = 4: its
# proper divisor 2), an empty segment). Then the other axis positions, on the N = 4 layout with
# KV heads replicated to pairs: segments are cut with narrow() on the axis, so where the axis
# lies does not interact with the layout.
LAYOUT_AXIS = (3, 1)
REPLICATED_TO_PAIRS = (4, 5)  # (n, k): segment_layouts(4)[5] is q, k, v with 2 KV heads


def _layout_cases():
    cases = [(n, k, *LAYOUT_AXIS) for n in NS for k in range(len(segment_layouts(n)))]
    cases += [(*REPLICATED_TO_PAIRS, ndim, dim) for ndim, dim in [(1, 0), (2, 0), (2, -1), (4, -2)]]
    return cases


def test_the_layout_grid_has_the_cases_its_comment_names():
    n, k = REPLICATED_TO_PAIRS
    assert segment_layouts(n)[k] == [(4 * n, 2 * n), (2 * 3, -2), (2 * 3, -2)]
    assert any(
        d < -1 and n % -d == 0 and n > -d
        for n in NS
        for layout in segment_layouts(n)
        for _, d in layout
    ), "no N replicates KV heads to groups of workers"


@pytest.mark.parametrize("n,k,ndim,dim", _layout_cases())
def test_split_segments_layouts_match_reference(n, k, ndim, dim):
    segs = segment_layouts(n)[k]
    shape = [3, 2, 1, 2][:ndim]
    shape[dim % ndim] = sum(s for s, _ in segs)
    x, xb = make_input(tuple(shape), "int32", seed=n * 7 + k)
    expected = ref_segments(xb, dim, segs, n)
    out = alloc(expected.shape, "int32")
    func("shardload.split_segments")(x, dim, *segment_args(segs), out)
    assert_bits_equal(out, expected)
    assert np.array_equal(to_bits(x), xb), "input was modified"
    check_segments_round_trip(to_bits(out), xb, dim, segs, n)
    out_shape, out_dtype = rule("shardload.split_segments")(
        tuple(shape), "int32", dim, *segment_args(segs), num_shards=n
    )
    assert tuple(out_shape) == expected.shape
    assert out_dtype == "int32"


@pytest.mark.parametrize("dtype", GRID_DTYPES)
def test_split_segments_dtypes_match_reference(dtype):
    # q: 2n units of 2, k/v: one replicable unit each, replicated to all n = 3 workers, on dim 1
    # of a 3-D input: a split and a replicated segment in every dtype (the copies go through
    # dtypes.movable_view, before any segment is cut)
    n = 3
    segs = [(4 * n, 2 * n), (3, -1), (3, -1)]
    shape = (2, sum(s for s, _ in segs), 3)
    x, xb = make_input(shape, dtype, seed=n)
    expected = ref_segments(xb, -2, segs, n)
    out = alloc(expected.shape, dtype)
    func("shardload.split_segments")(x, -2, *segment_args(segs), out)
    assert_bits_equal(out, expected)
    check_segments_round_trip(to_bits(out), xb, -2, segs, n)
    out_shape, out_dtype = rule("shardload.split_segments")(
        shape, dtype, -2, *segment_args(segs), num_shards=n
    )
    assert tuple(out_shape) == expected.shape
    assert out_dtype == dtype


def _segments_error_cases():
    # (name, in_shape, dim, segment args, n, regexes the message must match)
    return [
        ("odd number of args", (12, 2), 0, [8, 2, 4], 2, [r"(?i)pair|odd|even"]),
        ("single arg", (12, 2), 0, [12], 2, [r"(?i)pair|odd|even"]),
        (
            "size not a multiple of units",
            (12, 2),
            0,
            [7, 2, 5, 1],
            1,
            [r"(?i)unit", num(7), num(2)],
        ),
        (
            "size not a multiple of units, second segment",
            (12, 2),
            0,
            [4, 2, 8, 3],
            2,
            [r"(?i)unit", num(8), num(3)],
        ),
        (
            "sizes sum short",
            (12, 2),
            0,
            [4, 2, 4, 2],
            2,
            [r"(?i)add up|sum|total", num(8), num(12)],
        ),
        (
            "sizes sum long",
            (2, 12),
            1,
            [8, 2, 8, 2],
            2,
            [r"(?i)add up|sum|total", num(16), num(12)],
        ),
        (
            "units not divisible by n",
            (12, 2),
            0,
            [6, 6, 6, 2],
            4,
            [r"(?i)divi|multiple", num(6), num(4)],
        ),
        (
            "n not a multiple of units",
            (12, 2),
            0,
            [8, -4, 4, -2],
            3,
            [r"(?i)divi|multiple", num(3)],
        ),
        (
            "n not a multiple of units (gqa)",
            (25, 2),
            0,
            [16, 8, 9, -3],
            4,
            [r"(?i)divi|multiple", num(3), num(4)],
        ),
        (
            "replicable units not divisible by n",
            (12, 2),
            0,
            [6, -6, 6, -2],
            4,
            [r"(?i)divi|multiple", num(6), num(4)],
        ),
        (
            "positive units fewer than n",
            (12, 2),
            0,
            [4, 4, 8, 2],
            4,
            [r"(?i)divi|multiple|replic", num(2), num(4)],
        ),
        (
            "positive single unit (mqa without the sign)",
            (10, 2),
            0,
            [8, 8, 1, 1, 1, 1],
            2,
            [r"(?i)divi|multiple|replic", num(1), num(2)],
        ),
        ("units zero", (12, 2), 0, [12, 0], 2, [r"(?i)unit", num(0)]),
        (
            "units zero, replicable neighbours",
            (12, 2),
            0,
            [4, -1, 4, 0, 4, -2],
            2,
            [r"(?i)unit", num(0)],
        ),
        (
            "units negative, size not a multiple",
            (12, 2),
            0,
            [12, -5],
            1,
            [r"(?i)unit", num(12), num(5)],
        ),
        ("dim out of range", (12, 2), 2, [12, 2], 2, [r"(?i)dim|axis|range"]),
    ]


@pytest.mark.parametrize("case", _segments_error_cases(), ids=lambda c: c[0])
def test_split_segments_errors(case):
    _, shape, dim, args, n, patterns = case
    msg = assert_value_error(
        lambda: rule("shardload.split_segments")(shape, "int32", dim, *args, num_shards=n),
        *patterns,
    )
    x, _ = make_input(shape, "int32")
    out_shape = list(shape)
    out_shape[dim % len(shape) if -len(shape) <= dim < len(shape) else 0] //= n
    # the function refuses the same arguments with the same message (it checks them itself)
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        func("shardload.split_segments")(x, dim, *args, alloc((n, *out_shape), "int32"))


# ----------------------------------------------------------------------------------------------
# shardload.replicate

# Replication is one expand-and-copy of the whole tensor, so the shape grid needs only: a 1-D
# input, one with a size-1 dim (which expand could broadcast by mistake), a 4-D one, and an empty
# one; at N = 1 (a new leading axis of 1) and N = 3 (real copies). (3, 4) and (0,) took the
# same paths as (2, 3, 1, 2) and (3, 0); N = 4 the same as N = 3.
REPLICATE_SHAPES = [(5,), (2, 1, 3), (2, 3, 1, 2), (3, 0)]
REPLICATE_NS = (1, 3)


def check_replicate(n: int, shape: tuple, dtype: str) -> None:
    x, xb = make_input(shape, dtype, seed=n + len(shape))
    expected = ref_replicate(xb, n)
    out = alloc(expected.shape, dtype)
    func("shardload.replicate")(x, out)
    assert_bits_equal(out, expected)
    assert np.array_equal(to_bits(x), xb), "input was modified"
    out_shape, out_dtype = rule("shardload.replicate")(shape, dtype, num_shards=n)
    assert tuple(out_shape) == (n, *shape)
    assert out_dtype == dtype


@pytest.mark.parametrize("shape", REPLICATE_SHAPES, ids=str)
@pytest.mark.parametrize("n", REPLICATE_NS)
def test_replicate_matches_reference(n, shape):
    check_replicate(n, shape, "int32")


@pytest.mark.parametrize("dtype", GRID_DTYPES)
def test_replicate_moves_every_dtype_bit_for_bit(dtype):
    check_replicate(3, (2, 3, 1, 2), dtype)


# ----------------------------------------------------------------------------------------------
# shardload.split_rebase


def check_split_rebase(n: int, ndim: int, dim: int, dtype: str) -> None:
    shape = split_shape(ndim, dim, n)
    x, xb = make_input(shape, dtype, seed=n * 100 + ndim * 10 + dim)
    expected = ref_rebase(xb, dim, n)
    out = alloc(expected.shape, dtype)
    func("shardload.split_rebase")(x, dim, out)
    assert_bits_equal(out, expected)
    assert np.array_equal(to_bits(x), xb), "input was modified"
    out_shape, out_dtype = rule("shardload.split_rebase")(shape, dtype, dim, num_shards=n)
    assert tuple(out_shape) == expected.shape
    assert out_dtype == dtype


# split_rebase is split (the same axis handling, checked on the same SPLIT_CASES) and then, per
# piece, "minus its first flattened element": the multi-dim cases check that it is the piece's
# first element, not each row's. The dtypes are a separate grid: every integer width, since
# the subtraction is done in int64 and wrapped back into each dtype (int64 itself is not
# widened).
@pytest.mark.parametrize("ndim,dim", SPLIT_CASES)
@pytest.mark.parametrize("n", NS)
def test_split_rebase_matches_reference(n, ndim, dim):
    check_split_rebase(n, ndim, dim, "int32")


@pytest.mark.parametrize("dtype", REBASE_DTYPES)
def test_split_rebase_wraps_in_every_integer_dtype(dtype):
    check_split_rebase(dtype=dtype, **DTYPE_CASE)


# N = 16 gives each worker 6 rows: groups of 4 straddle the workers, so their rebased indices
# differ; N = 1 and 3 give whole groups (every worker the same indices)
@pytest.mark.parametrize("n", [1, 3, 16])
def test_split_rebase_gptq_g_idx(n):
    """Row-parallel GPTQ without act-order: g_idx = k // group, each worker counts from 0."""
    k, group = 96, 4
    g_idx = (np.arange(k) // group).astype(np.int32)
    out = torch.empty(n, k // n, dtype=torch.int32)
    func("shardload.split_rebase")(torch.from_numpy(g_idx.copy()), 0, out)
    for i in range(n):
        k0, k1 = i * k // n, (i + 1) * k // n
        assert out[i].tolist() == (g_idx[k0:k1] - g_idx[k0]).tolist()
    if (k // n) % group == 0:  # whole groups per worker: every worker sees the same indices
        assert all(out[i].tolist() == out[0].tolist() for i in range(n))


def test_split_rebase_uint32():
    """uint32 is an integer dtype the spec lists for all four functions."""
    x = torch.tensor([7, 7, 8, 9, 3, 4, 4, 5], dtype=torch.int32).view(torch.uint32)
    out_shape, out_dtype = rule("shardload.split_rebase")((8,), "uint32", 0, num_shards=2)
    assert tuple(out_shape) == (2, 4) and out_dtype == "uint32"
    out = alloc((2, 4), "uint32")
    func("shardload.split_rebase")(x, 0, out)
    assert to_bits(out).tolist() == [[0, 0, 1, 2], [0, 1, 1, 2]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn", "bool"])
def test_split_rebase_rejects_non_integer(dtype):
    assert_value_error(
        lambda: rule("shardload.split_rebase")((8,), dtype, 0, num_shards=2),
        r"(?i)integer|int",
        re.escape(dtype),
    )


def test_split_rebase_indivisible_is_an_error():
    assert_value_error(
        lambda: rule("shardload.split_rebase")((10,), "int32", 0, num_shards=4),
        r"(?i)divi|equal",
        num(10),
        num(4),
    )
    x, _ = make_input((10,), "int32")
    with pytest.raises(ValueError, match=r"dim 0 has size 10\b.* 4 equal shards"):
        func("shardload.split_rebase")(x, 0, alloc((4, 2), "int32"))


# ----------------------------------------------------------------------------------------------
# shape rules given a worker count that is not one


@pytest.mark.parametrize(
    "name,extra",
    [
        ("shardload.split", (0,)),
        ("shardload.split_segments", (0, 8, 2)),
        ("shardload.replicate", ()),
        ("shardload.split_rebase", (0,)),
    ],
)
def test_shape_rules_reject_nonpositive_num_shards(name, extra):
    """Not in the written spec, but the registry's contract: arguments that don't fit raise
    ValueError. Zero or negative workers never fit."""
    for n in (0, -1):
        with pytest.raises(ValueError):
            rule(name)((8,), "int32", *extra, num_shards=n)


# ----------------------------------------------------------------------------------------------
# mis-sized outputs: the function itself must refuse them

# input (8, 1, 3) int32 split on dim 0 into 2: the right output is (2, 4, 1, 3)
MIS_SIZED = {
    "shardload.split": (
        (0,),
        (2, 4, 1, 3),
        [
            ("split dim too long", (2, 5, 1, 3)),
            ("split dim too short", (2, 3, 1, 3)),
            ("size-1 dim too long", (2, 4, 2, 3)),
            ("last dim too long", (2, 4, 1, 4)),
            ("extra dim", (2, 1, 4, 1, 3)),
            ("missing dim", (2, 4, 3)),
        ],
    ),
    "shardload.split_rebase": (
        (0,),
        (2, 4, 1, 3),
        [
            ("split dim too long", (2, 5, 1, 3)),
            ("split dim too short", (2, 3, 1, 3)),
            ("size-1 dim too long", (2, 4, 2, 3)),
            ("missing dim", (2, 4, 3)),
        ],
    ),
    "shardload.split_segments": (
        (0, 4, 2, 4, 2),
        (2, 4, 1, 3),
        [
            ("split dim too long", (2, 5, 1, 3)),
            ("split dim too short", (2, 3, 1, 3)),
            ("size-1 dim too long", (2, 4, 2, 3)),
            ("last dim too long", (2, 4, 1, 4)),
            ("missing dim", (2, 4, 3)),
        ],
    ),
    "shardload.replicate": (
        (),
        (2, 8, 1, 3),
        [
            ("first dim too long", (2, 9, 1, 3)),
            ("size-1 dim too long", (2, 8, 2, 3)),
            ("extra dim", (2, 2, 8, 1, 3)),
            ("missing dim", (2, 8, 3)),
        ],
    ),
}


def _mis_sized_cases():
    return [
        pytest.param(name, extra, bad, good, id=f"{name}-{label}")
        for name, (extra, good, cases) in MIS_SIZED.items()
        for label, bad in cases
    ]


@pytest.mark.parametrize("name", sorted(MIS_SIZED))
def test_right_sized_output_is_accepted(name):
    extra, good, _ = MIS_SIZED[name]
    x, _ = make_input((8, 1, 3), "int32")
    func(name)(x, *extra, alloc(good, "int32"))


@pytest.mark.parametrize("name,extra,bad,good", _mis_sized_cases())
def test_mis_sized_output_raises(name, extra, bad, good):
    x, _ = make_input((8, 1, 3), "int32")
    # the shape it got and the shape it needs, not an error from inside the copy
    with pytest.raises(
        ValueError, match=re.escape(f"output is {list(bad)} int32, expected {list(good)} int32")
    ):
        func(name)(x, *extra, alloc(bad, "int32"))


# ----------------------------------------------------------------------------------------------
# realistic layouts

HEAD = 128
Q_HEADS, KV_HEADS = 32, 8
# query heads split only (positive units), KV heads replicable (negative units)
QKV_SEGS = [(Q_HEADS * HEAD, Q_HEADS), (KV_HEADS * HEAD, -KV_HEADS), (KV_HEADS * HEAD, -KV_HEADS)]


def heads_of(worker: int, n: int, units: int) -> list[int]:
    """Which heads of a segment of ``units`` (signed) heads worker ``worker`` of ``n`` holds
    (spec); only negative units may be replicated."""
    heads = abs(units)
    if n <= heads:
        return list(range(worker * heads // n, (worker + 1) * heads // n))
    assert units < 0, "positive units are never replicated"
    return [worker // (n // heads)]


def expected_qkv_rows(worker: int, n: int, q_units: int, kv_units: int, head: int) -> list[int]:
    """Rows of a fused [q, k, v] worker ``worker`` keeps; kv_units negative to replicate."""
    rows = []
    base = 0
    for units in (q_units, kv_units, kv_units):
        for h in heads_of(worker, n, units):
            rows.extend(range(base + h * head, base + (h + 1) * head))
        base += abs(units) * head
    return rows


# 32 query and 8 KV heads: N = 1 splits nothing, 4 splits both, 8 gives each worker exactly one
# KV head (the boundary of the replication rule, n <= units), 16 replicates each KV head to two
# workers. N = 2 took the same path as 4.
@pytest.mark.parametrize("n", [1, 4, 8, 16])
def test_fused_qkv(n):
    """Llama-style GQA qkv_proj weight [(32 + 8 + 8) * 128, hidden] on dim 0; at N = 16 each KV
    head goes to two consecutive workers."""
    rows, hidden = sum(s for s, _ in QKV_SEGS), 4
    x = torch.arange(rows, dtype=torch.int32)[:, None].repeat(1, hidden)
    shape_rule = rule("shardload.split_segments")
    out_shape, _ = shape_rule((rows, hidden), "int32", 0, *segment_args(QKV_SEGS), num_shards=n)
    per_worker = (Q_HEADS // n) * HEAD + 2 * max(KV_HEADS // n, 1) * HEAD
    assert tuple(out_shape) == (n, per_worker, hidden)
    out = alloc(out_shape, "int32")
    func("shardload.split_segments")(x, 0, *segment_args(QKV_SEGS), out)
    for i in range(n):
        want = expected_qkv_rows(i, n, Q_HEADS, -KV_HEADS, HEAD)
        assert out[i][:, 0].tolist() == want, f"worker {i}"
        assert torch.equal(out[i], out[i][:, :1].expand(-1, hidden))
    assert_bits_equal(out, ref_segments(to_bits(x), 0, QKV_SEGS, n))
    check_segments_round_trip(to_bits(out), to_bits(x), 0, QKV_SEGS, n)
    # the same with a float16 weight, bit for bit
    w, wb = make_input((rows, hidden), "float16", seed=n)
    out16 = alloc(out_shape, "float16")
    func("shardload.split_segments")(w, 0, *segment_args(QKV_SEGS), out16)
    assert_bits_equal(out16, ref_segments(wb, 0, QKV_SEGS, n))


def pack_int4(z: np.ndarray) -> np.ndarray:
    """GPTQ-style packing along the last dim: word j holds z[..., 8j + k] in bits 4k..4k+3."""
    z = z.astype(np.uint32).reshape(*z.shape[:-1], -1, 8)
    words = reduce(np.bitwise_or, [z[..., k] << np.uint32(4 * k) for k in range(8)])
    return words.astype(np.uint32).view(np.int32)


def unpack_int4(p: np.ndarray) -> np.ndarray:
    w = p.view(np.uint32)[..., None]
    nibbles = (w >> (np.uint32(4) * np.arange(8, dtype=np.uint32))) & np.uint32(15)
    return nibbles.reshape(*p.shape[:-1], -1).astype(np.int32)


# N as in test_fused_qkv (one worker, KV split, one KV head each, KV replicated), each with the
# packed axis named from one end or the other (normalised once, so not crossed with every N)
@pytest.mark.parametrize("n,dim", [(1, 1), (4, -1), (8, 1), (16, -1)])
def test_fused_qkv_packed_units(n, dim):
    """GPTQ qzeros [K/G, N_out/8] int32: the same fused QKV in packed units (sizes / 8, heads
    unchanged) must give every worker the same heads as the unpacked zeros."""
    groups = 3
    rng = np.random.default_rng(n)
    zeros = rng.integers(0, 16, size=(groups, sum(s for s, _ in QKV_SEGS))).astype(np.int32)
    packed = pack_int4(zeros)
    assert np.array_equal(unpack_int4(packed), zeros)
    packed_segs = [(size // 8, units) for size, units in QKV_SEGS]

    seg = func("shardload.split_segments")
    shape_rule = rule("shardload.split_segments")
    out_shape, out_dtype = shape_rule(
        packed.shape, "int32", dim, *segment_args(packed_segs), num_shards=n
    )
    assert out_dtype == "int32"
    out_packed = alloc(out_shape, "int32")
    seg(torch.from_numpy(packed.copy()), dim, *segment_args(packed_segs), out_packed)
    assert_bits_equal(out_packed, ref_segments(packed, dim, packed_segs, n))

    unpacked_shape, _ = shape_rule(zeros.shape, "int32", dim, *segment_args(QKV_SEGS), num_shards=n)
    out_zeros = alloc(unpacked_shape, "int32")
    seg(torch.from_numpy(zeros.copy()), dim, *segment_args(QKV_SEGS), out_zeros)
    for i in range(n):
        assert np.array_equal(unpack_int4(to_bits(out_packed[i])), to_bits(out_zeros[i])), (
            f"worker {i} holds different heads in packed and unpacked units"
        )
        cols = expected_qkv_rows(i, n, Q_HEADS, -KV_HEADS, HEAD)
        assert np.array_equal(to_bits(out_zeros[i]), zeros[:, cols])


# a plain two-segment split: N = 1 (nothing split) and 8 (the most pieces); 2 and 4 took the
# same path. N = 3 does not divide 11008: test_fused_gate_up_indivisible.
@pytest.mark.parametrize("n", [1, 8])
def test_fused_gate_up(n):
    """Llama-7B gate_up_proj weight [2 * 11008, hidden]: worker i gets its slice of gate, then
    the same slice of up."""
    inter, hidden = 11008, 2
    segs = [(inter, inter), (inter, inter)]
    x = torch.arange(2 * inter, dtype=torch.int32)[:, None].repeat(1, hidden)
    out_shape, _ = rule("shardload.split_segments")(
        (2 * inter, hidden), "int32", 0, *segment_args(segs), num_shards=n
    )
    assert tuple(out_shape) == (n, 2 * inter // n, hidden)
    out = alloc(out_shape, "int32")
    func("shardload.split_segments")(x, 0, *segment_args(segs), out)
    piece = inter // n
    for i in range(n):
        want = [
            *range(i * piece, (i + 1) * piece),
            *range(inter + i * piece, inter + (i + 1) * piece),
        ]
        assert out[i][:, 0].tolist() == want, f"worker {i}"
    check_segments_round_trip(to_bits(out), to_bits(x), 0, segs, n)


def test_fused_gate_up_indivisible():
    segs = [11008, 11008, 11008, 11008]
    assert_value_error(
        lambda: rule("shardload.split_segments")((2 * 11008, 2), "float16", 0, *segs, num_shards=3),
        r"(?i)divi|multiple",
        num(3),
    )


# N = 1: the one KV head is not replicated; N = 4: it goes to every worker (2 and 8 the same)
@pytest.mark.parametrize("n", [1, 4])
def test_mqa_kv_replicated_to_all(n):
    """Multi-query attention: 8 query heads, one replicable KV head that every worker gets
    whole."""
    head, q_heads = 16, 8
    segs = [(q_heads * head, q_heads), (head, -1), (head, -1)]
    rows = sum(s for s, _ in segs)
    x, xb = make_input((rows, 3), "bfloat16", seed=n)
    out_shape, _ = rule("shardload.split_segments")(
        (rows, 3), "bfloat16", 0, *segment_args(segs), num_shards=n
    )
    assert tuple(out_shape) == (n, q_heads * head // n + 2 * head, 3)
    out = alloc(out_shape, "bfloat16")
    func("shardload.split_segments")(x, 0, *segment_args(segs), out)
    ob = to_bits(out)
    q_rows = q_heads * head // n
    k = xb[q_heads * head : q_heads * head + head]
    v = xb[q_heads * head + head :]
    for i in range(n):
        assert np.array_equal(ob[i][:q_rows], xb[i * q_rows : (i + 1) * q_rows])
        assert np.array_equal(ob[i][q_rows : q_rows + head], k)
        assert np.array_equal(ob[i][q_rows + head :], v)
    assert_bits_equal(out, ref_segments(xb, 0, segs, n))


# ----------------------------------------------------------------------------------------------
# strict mode: positive units split, never replicate; negative units may replicate


# (1, 2): one positive unit (MQA without the sign); (4, 8): N a multiple of the units, where the
# replicable spelling would be fine; (2, 3): N not a multiple of them; (6, 8): neither divides
# the other. (2, 4), (8, 16), (3, 6) and (1, 16) took the paths of (4, 8) and (1, 2).
@pytest.mark.parametrize("units,n", [(1, 2), (4, 8), (2, 3), (6, 8)])
def test_positive_units_fewer_than_n_is_an_error(units, n):
    """Positive units are never replicated: N > units fails, naming the units and N, in the
    shape rule and in the function itself."""
    head = 4
    segs = [(units * head, units)]
    shape = (units * head, 3)
    assert_value_error(
        lambda: rule("shardload.split_segments")(
            shape, "float16", 0, *segment_args(segs), num_shards=n
        ),
        r"(?i)divi|multiple|replic",
        num(units),
        num(n),
    )
    with pytest.raises(ValueError):
        ref_segments(np.zeros(shape, np.int16), 0, segs, n)
    x, _ = make_input(shape, "float16")
    for rows in (head, max(units * head // n, 1)):  # neither a replicated nor a split output
        with pytest.raises(ValueError, match=rf"segment 0 has {units} units\b.* {n} workers"):
            func("shardload.split_segments")(
                x, 0, *segment_args(segs), alloc((n, rows, 3), "float16")
            )
    if n % units == 0:  # the same segment, marked replicable, is fine
        out_shape, _ = rule("shardload.split_segments")(
            shape, "float16", 0, units * head, -units, num_shards=n
        )
        assert tuple(out_shape) == (n, head, 3)


# N = 1; N equal to the units (one unit each); more units than N, a power of two; and an odd N
# (12 units, 3 workers). (2, 1), (4, 2), (4, 4), (8, 8) and (16, 16) repeated those. Both axes
# of a 2-D input: rows, and the last axis named from the end.
@pytest.mark.parametrize("units,n", [(1, 1), (2, 2), (8, 4), (12, 3)])
@pytest.mark.parametrize("dim", [0, -1])
def test_positive_units_dividing_n_split_evenly(units, n, dim):
    """Positive units that N divides: worker i keeps the i-th of N equal slices, the same as
    ``shardload.split`` and as the replicable (negative) spelling."""
    unit = 3
    size = units * unit
    shape = (size, 2) if dim == 0 else (2, size)
    x, xb = make_input(shape, "bfloat16", seed=units * 31 + n)
    out_shape, _ = rule("shardload.split_segments")(
        shape, "bfloat16", dim, size, units, num_shards=n
    )
    expected = ref_split(xb, dim, n)
    assert tuple(out_shape) == expected.shape
    out = alloc(out_shape, "bfloat16")
    func("shardload.split_segments")(x, dim, size, units, out)
    assert_bits_equal(out, expected)
    assert_bits_equal(out, ref_segments(xb, dim, [(size, units)], n))
    neg = alloc(out_shape, "bfloat16")
    func("shardload.split_segments")(x, dim, size, -units, neg)
    assert_bits_equal(neg, expected)


# (N, q heads, kv heads): what each case puts q and k/v through
STRICT_QKV = [
    (1, 8, 8),  # one worker: nothing split
    (4, 8, 8),  # q and kv split
    (8, 8, 8),  # one q and one kv head each: N at the bound of both (n <= units splits)
    (16, 8, 8),  # more workers than q heads: refused
    (4, 8, 2),  # q split, each kv head replicated to 2 workers
    (8, 8, 2),  # N equal to the q heads, each kv head replicated to 4 workers
    (16, 8, 2),  # refused, although the kv heads alone could be replicated
    (16, 32, 8),  # 2 q heads each, each kv head replicated to 2 workers
    (2, 16, 1),  # MQA: the one kv head replicated to every worker
    (16, 16, 1),  # MQA with one q head each
]


@pytest.mark.parametrize("n,q_heads,kv_heads", STRICT_QKV)
def test_fused_qkv_strict(n, q_heads, kv_heads):
    """Fused QKV with positive q units and negative k/v units: q is only ever split, k/v are
    replicated once workers outnumber them; N above the q heads is an error."""
    head = 4
    segs = [(q_heads * head, q_heads), (kv_heads * head, -kv_heads), (kv_heads * head, -kv_heads)]
    rows = sum(s for s, _ in segs)
    shape_rule = rule("shardload.split_segments")
    x = torch.arange(rows, dtype=torch.int32)[:, None].repeat(1, 2)
    if n > q_heads:
        assert_value_error(
            lambda: shape_rule((rows, 2), "int32", 0, *segment_args(segs), num_shards=n),
            num(q_heads),
            num(n),
        )
        with pytest.raises(ValueError):
            ref_segments(to_bits(x), 0, segs, n)
        with pytest.raises(ValueError, match=rf"segment 0 has {q_heads} units\b.* {n} workers"):
            func("shardload.split_segments")(
                x,
                0,
                *segment_args(segs),
                alloc((n, head + 2 * max(kv_heads // n, 1) * head, 2), "int32"),
            )
        return
    out_shape, _ = shape_rule((rows, 2), "int32", 0, *segment_args(segs), num_shards=n)
    q_rows, kv_rows = q_heads * head // n, max(kv_heads // n, 1) * head
    assert tuple(out_shape) == (n, q_rows + 2 * kv_rows, 2)
    out = alloc(out_shape, "int32")
    func("shardload.split_segments")(x, 0, *segment_args(segs), out)
    assert_bits_equal(out, ref_segments(to_bits(x), 0, segs, n))
    check_segments_round_trip(to_bits(out), to_bits(x), 0, segs, n)
    q_parts = [out[i][:q_rows, 0].tolist() for i in range(n)]
    # q is split: the workers' pieces are disjoint and cover q in order
    assert [row for part in q_parts for row in part] == list(range(q_heads * head))
    for i in range(n):
        assert out[i][:, 0].tolist() == expected_qkv_rows(i, n, q_heads, -kv_heads, head)
        k_part = out[i][q_rows : q_rows + kv_rows, 0].tolist()
        if n > kv_heads:  # replicated: worker i holds kv head i // (n // kv_heads)
            h = i // (n // kv_heads)
            base = q_heads * head
            assert k_part == list(range(base + h * head, base + (h + 1) * head))


def test_fused_qkv_strict_replicates_kv_only():
    """32 q heads, 8 kv heads, 16 workers: each worker its own 2 q heads, KV heads shared by
    consecutive pairs of workers."""
    head, n = 4, 16
    segs = [(32 * head, 32), (8 * head, -8), (8 * head, -8)]
    rows = sum(s for s, _ in segs)
    x, xb = make_input((rows, 3), "float16", seed=16)
    out_shape, _ = rule("shardload.split_segments")(
        (rows, 3), "float16", 0, *segment_args(segs), num_shards=n
    )
    assert tuple(out_shape) == (n, 2 * head + 2 * head, 3)
    out = alloc(out_shape, "float16")
    func("shardload.split_segments")(x, 0, *segment_args(segs), out)
    ob = to_bits(out)
    assert_bits_equal(out, ref_segments(xb, 0, segs, n))
    for i in range(n):
        assert np.array_equal(ob[i][: 2 * head], xb[i * 2 * head : (i + 1) * 2 * head])
        h = i // 2
        assert np.array_equal(
            ob[i][2 * head : 3 * head], xb[32 * head + h * head : 32 * head + (h + 1) * head]
        )
        assert np.array_equal(
            ob[i][3 * head :], xb[40 * head + h * head : 40 * head + (h + 1) * head]
        )
    for i in range(0, n, 2):  # kv equal within a pair, q never
        assert np.array_equal(ob[i][2 * head :], ob[i + 1][2 * head :])
        assert not np.array_equal(ob[i][: 2 * head], ob[i + 1][: 2 * head])
    # the same layout with positive kv units is refused rather than silently replicated
    positive = [(size, abs(units)) for size, units in segs]
    assert_value_error(
        lambda: rule("shardload.split_segments")(
            (rows, 3), "float16", 0, *segment_args(positive), num_shards=n
        ),
        num(8),
        num(16),
    )


# where the zero is (alone, after a valid segment, before one, with a zero size, between
# replicable ones); on 2 workers only: the units are checked before anything depends on N
@pytest.mark.parametrize(
    "args", [[8, 0], [4, 2, 4, 0], [4, 0, 4, -2], [0, 0], [4, -2, 4, 0, 0, 1]], ids=str
)
def test_units_zero_is_an_error(args):
    n = 2
    size = sum(args[::2])
    assert_value_error(
        lambda: rule("shardload.split_segments")((size, 2), "int32", 0, *args, num_shards=n),
        r"(?i)unit",
        num(0),
    )
    with pytest.raises(ValueError):
        ref_segments(np.zeros((size, 2), np.int32), 0, list(zip(args[::2], args[1::2])), n)
    x, _ = make_input((size, 2), "int32")
    k = args[1::2].index(0)  # the segment with zero units, named by the function's message
    with pytest.raises(ValueError, match=rf"segment {k}: size {args[2 * k]} .*units 0 non-zero"):
        func("shardload.split_segments")(x, 0, *args, alloc((n, size // n, 2), "int32"))


# ----------------------------------------------------------------------------------------------
# property tests

ANY_DTYPE = st.sampled_from(MOVE_DTYPES)
OTHER_DIM = st.sampled_from([1, 2, 3, 1, 2, 3, 0])


@st.composite
def shapes_with_dim(draw, axis_size):
    """(shape, dim) with ``shape[dim] == axis_size``, 1-4 dims, dim possibly negative."""
    ndim = draw(st.integers(1, 4))
    shape = [draw(OTHER_DIM) for _ in range(ndim)]
    axis = draw(st.integers(0, ndim - 1))
    shape[axis] = axis_size
    dim = axis - ndim if draw(st.booleans()) else axis
    return tuple(shape), dim


@st.composite
def split_cases(draw):
    n = draw(st.integers(1, 16))
    per = draw(st.integers(0, 4))
    shape, dim = draw(shapes_with_dim(n * per))
    return n, shape, dim


@given(case=split_cases(), dtype=ANY_DTYPE, seed=st.integers(0, 2**16))
@HYPOTHESIS
def test_split_property(case, dtype, seed):
    n, shape, dim = case
    x, xb = make_input(shape, dtype, seed)
    expected = ref_split(xb, dim, n)
    out_shape, out_dtype = rule("shardload.split")(shape, dtype, dim, num_shards=n)
    assert tuple(out_shape) == expected.shape and out_dtype == dtype
    out = alloc(expected.shape, dtype)
    func("shardload.split")(x, dim, out)
    assert_bits_equal(out, expected)
    check_split_round_trip(to_bits(out), xb, dim)


@given(case=split_cases(), dtype=st.sampled_from(REBASE_DTYPES), seed=st.integers(0, 2**16))
@HYPOTHESIS
def test_split_rebase_property(case, dtype, seed):
    n, shape, dim = case
    x, xb = make_input(shape, dtype, seed)
    expected = ref_rebase(xb, dim, n)
    out_shape, out_dtype = rule("shardload.split_rebase")(shape, dtype, dim, num_shards=n)
    assert tuple(out_shape) == expected.shape and out_dtype == dtype
    out = alloc(expected.shape, dtype)
    func("shardload.split_rebase")(x, dim, out)
    assert_bits_equal(out, expected)


@given(
    n=st.integers(1, 16),
    shape=st.lists(OTHER_DIM, min_size=1, max_size=4).map(tuple),
    dtype=ANY_DTYPE,
    seed=st.integers(0, 2**16),
)
@HYPOTHESIS
def test_replicate_property(n, shape, dtype, seed):
    x, xb = make_input(shape, dtype, seed)
    expected = ref_replicate(xb, n)
    out_shape, out_dtype = rule("shardload.replicate")(shape, dtype, num_shards=n)
    assert tuple(out_shape) == expected.shape and out_dtype == dtype
    out = alloc(expected.shape, dtype)
    func("shardload.replicate")(x, out)
    assert_bits_equal(out, expected)


@st.composite
def segment_layout(draw, n):
    """A valid layout for n workers: each segment either splits (units a multiple of n, of
    either sign) or, when n has a proper divisor, is replicated (negative units, a proper
    divisor of n)."""
    segs = []
    proper = [d for d in range(1, n) if n % d == 0]
    for _ in range(draw(st.integers(1, 4))):
        if proper and draw(st.booleans()):
            units = -draw(st.sampled_from(proper))
        else:
            units = n * draw(st.integers(1, 3)) * draw(st.sampled_from([1, -1]))
        unit = draw(st.sampled_from([0, 1, 1, 2, 2, 3]))
        segs.append((abs(units) * unit, units))
    return segs


@st.composite
def segment_cases(draw):
    n = draw(st.integers(1, 16))
    segs = draw(segment_layout(n))
    shape, dim = draw(shapes_with_dim(sum(s for s, _ in segs)))
    return n, segs, shape, dim


@given(case=segment_cases(), dtype=ANY_DTYPE, seed=st.integers(0, 2**16))
@HYPOTHESIS
def test_split_segments_property(case, dtype, seed):
    n, segs, shape, dim = case
    x, xb = make_input(shape, dtype, seed)
    expected = ref_segments(xb, dim, segs, n)
    out_shape, out_dtype = rule("shardload.split_segments")(
        shape, dtype, dim, *segment_args(segs), num_shards=n
    )
    assert tuple(out_shape) == expected.shape and out_dtype == dtype
    out = alloc(expected.shape, dtype)
    func("shardload.split_segments")(x, dim, *segment_args(segs), out)
    assert_bits_equal(out, expected)
    check_segments_round_trip(to_bits(out), xb, dim, segs, n)


@st.composite
def invalid_segment_cases(draw):
    """A valid layout with exactly one thing broken."""
    kind = draw(
        st.sampled_from(
            [
                "odd",
                "not_multiple",
                "sum",
                "units_vs_n",
                "units_zero",
                "negative_size",
                "positive_replicated",
            ]
        )
    )
    n = draw(st.integers(2 if kind in ("units_vs_n", "positive_replicated") else 1, 16))
    segs = draw(segment_layout(n))
    k = draw(st.integers(0, len(segs) - 1))
    sign = draw(st.sampled_from([1, -1]))
    if kind == "not_multiple":
        units = draw(st.integers(2, 3)) * n  # fits n, so only the size is wrong
        segs[k] = (units * draw(st.integers(0, 3)) + draw(st.integers(1, units - 1)), sign * units)
    elif kind == "units_vs_n":  # neither divides the other: wrong with either sign
        units = draw(st.integers(2, 3 * n).filter(lambda u: u % n and n % u))
        segs[k] = (units * draw(st.integers(1, 3)), sign * units)
    elif kind == "positive_replicated":  # fine if negative; positive units never replicate
        units = draw(st.sampled_from([d for d in range(1, n) if n % d == 0]))
        segs[k] = (units * draw(st.integers(0, 3)), units)
    elif kind == "units_zero":
        segs[k] = (segs[k][0], 0)
    elif kind == "negative_size":
        # a negative size, with a valid segment added so the sizes still add up to the dim
        units, m = segs[k][1], draw(st.integers(1, 3))
        segs[k] = (-abs(units) * m, units)
        segs.append((abs(units) * m * n, n))
    total = sum(s for s, _ in segs)
    axis_size = total
    if kind == "sum":
        axis_size = total + draw(st.integers(-total, 5).filter(lambda d: d != 0))
    args = segment_args(segs)
    if kind == "odd":
        args = args[:-1] if draw(st.booleans()) else args + [draw(st.integers(1, 4))]
    shape, dim = draw(shapes_with_dim(axis_size))
    return kind, n, args, shape, dim


@given(case=invalid_segment_cases(), dtype=ANY_DTYPE)
@HYPOTHESIS
def test_split_segments_invalid_property(case, dtype):
    kind, n, args, shape, dim = case
    with pytest.raises(ValueError):
        rule("shardload.split_segments")(shape, dtype, dim, *args, num_shards=n)


@st.composite
def signed_segment_cases(draw):
    """Any signs, any unit counts: valid or not, the function must agree with the reference."""
    n = draw(st.integers(1, 16))
    segs = []
    for _ in range(draw(st.integers(1, 4))):
        units = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16])) * draw(st.sampled_from([1, -1]))
        segs.append((abs(units) * draw(st.integers(0, 2)), units))
    shape, dim = draw(shapes_with_dim(sum(s for s, _ in segs)))
    return n, segs, shape, dim


@given(case=signed_segment_cases(), dtype=ANY_DTYPE, seed=st.integers(0, 2**16))
@HYPOTHESIS
def test_split_segments_mixed_signs_property(case, dtype, seed):
    n, segs, shape, dim = case
    x, xb = make_input(shape, dtype, seed)
    shape_rule = rule("shardload.split_segments")
    try:
        expected = ref_segments(xb, dim, segs, n)
    except ValueError:
        with pytest.raises(ValueError):
            shape_rule(shape, dtype, dim, *segment_args(segs), num_shards=n)
        return
    out_shape, out_dtype = shape_rule(shape, dtype, dim, *segment_args(segs), num_shards=n)
    assert tuple(out_shape) == expected.shape and out_dtype == dtype
    out = alloc(expected.shape, dtype)
    func("shardload.split_segments")(x, dim, *segment_args(segs), out)
    assert_bits_equal(out, expected)
    check_segments_round_trip(to_bits(out), xb, dim, segs, n)
    # flipping a positive segment's sign changes nothing where n divides its units
    flipped = [(size, -units if n <= abs(units) else units) for size, units in segs]
    assert np.array_equal(ref_segments(xb, dim, flipped, n), expected)
    out2 = alloc(expected.shape, dtype)
    func("shardload.split_segments")(x, dim, *segment_args(flipped), out2)
    assert_bits_equal(out2, expected)


@given(n=st.integers(2, 16), data=st.data())
@HYPOTHESIS
def test_positive_units_are_never_replicated_property(n, data):
    """A positive segment with fewer units than workers is an error, even where the same
    segment with negative units replicates fine."""
    units = data.draw(st.sampled_from([d for d in range(1, n) if n % d == 0] or [1]))
    unit = data.draw(st.integers(1, 3))
    q = n * data.draw(st.integers(1, 2))
    segs = [(q * 2, q), (units * unit, units)]
    shape = (sum(s for s, _ in segs), 2)
    assert_value_error(
        lambda: rule("shardload.split_segments")(
            shape, "int32", 0, *segment_args(segs), num_shards=n
        ),
        num(units),
        num(n),
    )
    with pytest.raises(ValueError):
        ref_segments(np.zeros(shape, np.int32), 0, segs, n)
    replicable = [segs[0], (units * unit, -units)]
    out_shape, _ = rule("shardload.split_segments")(
        shape, "int32", 0, *segment_args(replicable), num_shards=n
    )
    assert tuple(out_shape) == (n, 2 * q // n + unit, 2)


@st.composite
def invalid_split_cases(draw):
    n = draw(st.integers(2, 16))
    size = n * draw(st.integers(0, 3)) + draw(st.integers(1, n - 1))
    shape, dim = draw(shapes_with_dim(size))
    if draw(st.integers(0, 4)) == 0:  # or a dim that is not there
        dim = draw(st.sampled_from([len(shape), len(shape) + 1, -len(shape) - 1]))
    return n, shape, dim


@given(
    case=invalid_split_cases(), name=st.sampled_from(["shardload.split", "shardload.split_rebase"])
)
@HYPOTHESIS
def test_split_invalid_property(case, name):
    n, shape, dim = case
    with pytest.raises(ValueError):
        rule(name)(shape, "int32", dim, num_shards=n)
