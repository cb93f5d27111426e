"""Shard functions and session functions for tests/test_readplan.py, importable by worker
processes (``helpers.readplan_plugins``).

``tests.readplan.blocks_reversed`` is a plugin with a ``ranges`` rule: worker i keeps the i-th of
N row blocks, its rows in reverse order, then negated by a fixup. Its pieces are read straight
from the file; the function itself (used by the compute path and by the test's reference) does
the same to the whole tensor.
"""

from __future__ import annotations

import sys

import torch

from shardload import Selection, register_session_func, register_shard_func


def _rule(in_shape, in_dtype, *, num_shards):
    if in_shape[0] % num_shards:
        raise ValueError(f"{in_shape[0]} rows do not divide among {num_shards} workers")
    return (num_shards, in_shape[0] // num_shards, *in_shape[1:]), in_dtype


def _ranges(in_shape, in_dtype, *, num_shards, index):
    rows = in_shape[0] // num_shards
    first = index * rows
    return Selection(0, tuple((first + r, 1) for r in reversed(range(rows))))


def _negate(piece, *, num_shards, index):
    piece.neg_()


@register_shard_func(
    "tests.readplan.blocks_reversed", shape_rule=_rule, ranges=_ranges, fixup=_negate
)
def blocks_reversed(input, output):
    """Worker i: the i-th row block, rows reversed, negated."""
    n = output.shape[0]
    blocks = input.reshape(n, input.shape[0] // n, *input.shape[1:])
    output.copy_(-blocks.flip(1))


@register_shard_func("tests.readplan.blocks_reversed_computed", shape_rule=_rule)
def blocks_reversed_computed(input, output):
    """The same function without a ranges rule: computed whole, then sliced."""
    blocks_reversed(input, output)


@register_session_func("tests.readplan.imported")
def imported(ctx, prefixes):
    """Which of the modules named by ``prefixes`` this worker process has imported."""
    return sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in prefixes))


@register_session_func("tests.readplan.sum_of")
def sum_of(ctx, name):
    return float(ctx.shards[name].to(torch.float64).sum())


@register_session_func("tests.readplan.loads_held")
def loads_held(ctx):
    """How many loads' pieces this worker process still keeps for fetching."""
    return len(ctx.values.get("shardload.load_pieces", {}))
