"""shardload.take_units (zero-padded layouts) against a numpy reference, for N in 1..9."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardload import get_shard_func


def reference(x: np.ndarray, dim: int, unit: int, per_worker: list[list[int]]) -> np.ndarray:
    axis = dim % x.ndim
    zeros = np.zeros_like(np.take(x, range(unit), axis=axis))
    return np.stack(
        [
            np.concatenate(
                [
                    np.take(x, range(u * unit, (u + 1) * unit), axis=axis) if u >= 0 else zeros
                    for u in units
                ],
                axis=axis,
            )
            for units in per_worker
        ]
    )


def run(x: torch.Tensor, dim: int, unit: int, per_worker: list[list[int]]) -> torch.Tensor:
    func = get_shard_func("shardload.take_units")
    flat = [u for units in per_worker for u in units]
    shape, dtype = func.shape_rule(
        tuple(x.shape),
        str(x.dtype).removeprefix("torch."),
        dim,
        unit,
        *flat,
        num_shards=len(per_worker),
    )
    out = torch.full(shape, 7, dtype=x.dtype)  # stale contents must not survive
    func.func(x, dim, unit, *flat, out)
    return out


@given(data=st.data())
@settings(max_examples=80, deadline=None)
def test_matches_numpy(data):
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(-ndim, ndim - 1))
    unit = data.draw(st.integers(1, 4))
    units = data.draw(st.integers(1, 6))
    shape = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim % ndim] = unit * units
    n = data.draw(st.integers(1, 9))
    per = data.draw(st.integers(1, 4))
    per_worker = [[data.draw(st.integers(-1, units - 1)) for _ in range(per)] for _ in range(n)]
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) + 1
    got = run(torch.from_numpy(x), dim, unit, per_worker).numpy()
    assert np.array_equal(got, reference(x, dim, unit, per_worker))


@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_fill_is_take_units_with_zero_units_filled(data):
    """``take_units_fill``: the units ``take_units`` takes, every element of a zero unit the
    fill (the word of a per-channel layer's zero code), as numpy does it."""
    unit, units, n = (
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 5)),
        data.draw(st.integers(1, 5)),
    )
    fill = data.draw(st.integers(-(2**31), 2**31 - 1))
    per_worker = [[data.draw(st.integers(-1, units - 1)) for _ in range(2)] for _ in range(n)]
    x = np.arange(units * unit * 3, dtype=np.int32).reshape(units * unit, 3) + 1
    want = reference(x, 0, unit, per_worker)
    for w, wanted in enumerate(per_worker):
        for j, u in enumerate(wanted):
            if u < 0:
                want[w, j * unit : (j + 1) * unit] = fill
    func = get_shard_func("shardload.take_units_fill")
    flat = [u for units_ in per_worker for u in units_]
    shape, dtype = func.shape_rule((units * unit, 3), "int32", 0, unit, fill, *flat, num_shards=n)
    out = torch.full(shape, 7, dtype=torch.int32)
    func.func(torch.from_numpy(x), 0, unit, fill, *flat, out)
    assert np.array_equal(out.numpy(), want)


@pytest.mark.parametrize(
    "dtype, fill", [("int32", 2**31), ("int8", 128), ("float16", 0), ("uint8", -1)]
)
def test_fill_must_be_a_value_of_the_integer_dtype(dtype, fill):
    func = get_shard_func("shardload.take_units_fill")
    with pytest.raises(ValueError, match="is not a value of the integer dtype"):
        func.shape_rule((4, 2), dtype, 0, 2, fill, 0, -1, num_shards=1)


def test_padded_heads_are_zero_in_any_dtype():
    x = torch.arange(12, dtype=torch.float32).reshape(6, 2).to(torch.float8_e4m3fn)
    out = run(x, 0, 2, [[0, 1], [2, -1]])
    assert torch.equal(out[1, 2:].view(torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    assert torch.equal(out[0].view(torch.uint8), x[:4].view(torch.uint8))


@pytest.mark.parametrize(
    "args, phrase",
    [
        ((0, 4, 0, 1), "whole number of units"),
        ((0, 2, 0, 3), "out of range"),
        ((0, 2, 0, -2), "out of range"),
        ((0, 2, 0, 1, 2), "same number"),
        ((0, 0, 0, 1), "whole number of units"),
    ],
)
def test_refuses_bad_layouts(args, phrase):
    func = get_shard_func("shardload.take_units")
    with pytest.raises(ValueError, match=phrase):
        func.shape_rule((6, 2), "float32", *args, num_shards=2)
