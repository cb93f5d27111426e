"""Shard functions the loader tests use, at module level so worker processes register them too
(a ProcessSession re-imports this module in each worker)."""

import numpy as np

from shardload import register_shard_func


@register_shard_func("tests.disco.shard_dim_1", array="numpy")
def shard_dim_1(input, num_shards, output):
    """TVM's test function, numpy flavour: split axis 1 of a 2-D input."""
    output[...] = input.reshape(input.shape[0], num_shards, -1).transpose(1, 0, 2)


@register_shard_func("tests.disco.shard_dim_1.torch")
def shard_dim_1_torch(input, num_shards, output):
    """TVM's test function, torch flavour."""
    output.copy_(input.reshape(input.shape[0], num_shards, -1).transpose(0, 1))


@register_shard_func("tests.loader.transpose", array="numpy")
def transpose(input, output):
    """[a, b] -> [b, a]: a first step that does not produce N on axis 0."""
    output[...] = input.T


@register_shard_func("tests.loader.opaque")
def opaque(input, output):
    """Reshape into the output: a chain the loader cannot read piecewise."""
    output.copy_(input.reshape(output.shape))


@register_shard_func("tests.loader.boom")
def boom(input, output):
    """Always fails."""
    raise RuntimeError("boom in a shard function")


@register_shard_func("tests.loader.fail_numpy", array="numpy")
def fail_numpy(input, output):
    """Always fails, numpy flavour."""
    raise ValueError("bad values")


__all__ = ["np"]
