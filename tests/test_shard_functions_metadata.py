"""The built-ins that rewrite metadata rather than split it: shardload.constant (per-worker
weight_shape) and shardload.repeat_segments (per-part scales to per-channel), against numpy."""

import numpy as np
import pytest
import torch

from shardload import get_shard_func


def run(name, x, *extra, n):
    func = get_shard_func(name)
    shape, dtype = func.shape_rule(
        tuple(x.shape), str(x.dtype).removeprefix("torch."), *extra, num_shards=n
    )
    out = torch.empty(shape, dtype=getattr(torch, dtype))
    func.func(x, *extra, out)
    return out


# N = 1 (one row) and 3 (several rows, and 4096 // 3 is not exact); 2, 4 and 8 took the path of 3
@pytest.mark.parametrize("n", [1, 3])
def test_constant_gives_every_worker_the_values(n):
    out = run("shardload.constant", torch.tensor([4096, 11008]), 4096 // n, 11008, n=n)
    assert np.array_equal(out.numpy(), np.tile([4096 // n, 11008], (n, 1)))


@pytest.mark.parametrize(
    "shape, dtype, values",
    [((3,), torch.int64, (1, 2)), ((2,), torch.float32, (1, 2)), ((2, 1), torch.int64, (1, 2))],
)
def test_constant_refuses_what_does_not_fit(shape, dtype, values):
    with pytest.raises(ValueError):
        run("shardload.constant", torch.zeros(shape, dtype=dtype), *values, n=2)


# the sizes on a flat input (several segments, equal ones, one segment, an empty segment); the
# column input ([S, 1]) is reshaped to the same values first, so once is enough
@pytest.mark.parametrize(
    "sizes, shape",
    [
        ((4, 2, 2), "flat"),
        ((8, 8), "flat"),
        ((1,), "flat"),
        ((0, 3), "flat"),
        ((4, 2, 2), "column"),
    ],
)
def test_repeat_segments_matches_numpy(sizes, shape):
    values = torch.arange(1, len(sizes) + 1, dtype=torch.float32) / 8
    x = values if shape == "flat" else values.reshape(-1, 1)
    out = run("shardload.repeat_segments", x, *sizes, n=2)
    want = np.repeat(values.numpy(), sizes).reshape(-1, 1)
    assert out.shape == want.shape and np.array_equal(out.numpy(), want)


def test_repeat_segments_keeps_bits_of_every_dtype():
    x = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    out = run("shardload.repeat_segments", x, 2, 3, n=1)
    assert out.dtype == torch.bfloat16
    assert torch.equal(
        out.view(torch.int16).reshape(-1),
        x.view(torch.int16).repeat_interleave(torch.tensor([2, 3])),
    )


@pytest.mark.parametrize("shape, sizes", [((3,), (1, 2)), ((2, 2), (1, 1)), ((2,), (1, -1))])
def test_repeat_segments_refuses_what_does_not_fit(shape, sizes):
    with pytest.raises(ValueError):
        run("shardload.repeat_segments", torch.zeros(shape), *sizes, n=2)
