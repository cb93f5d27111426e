"""What each tensor-parallel worker must hold, written from the rules (vLLM's GQA layout and
zero padding), independently of shardload's planner. Shared by the planner tests."""

import numpy as np


def rows_of(n: int, i: int, size: int, units: int, replicable: bool) -> slice:
    """Worker i's rows of a segment of ``units`` heads: an even split, or, when the workers
    outnumber replicable (KV) heads, head ``i // (n // units)``."""
    if n <= units:
        return slice(i * size // n, (i + 1) * size // n)
    assert replicable
    unit, head = size // units, i // (n // units)
    return slice(head * unit, (head + 1) * unit)


def take(w: np.ndarray, units: list[int], size: int, axis: int) -> np.ndarray:
    """The units (of ``size`` rows/columns along ``axis``) a worker holds; -1 is zeros."""
    return np.concatenate([np.take(w, range(u * size, (u + 1) * size), axis=axis) if u >= 0
                           else np.zeros_like(np.take(w, range(size), axis=axis))
                           for u in units], axis=axis)
