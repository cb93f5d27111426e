"""Parameters and plans for the fault tests: ``params`` (small float32 arrays ``p0``, ``p1``, ...)
and plans that split them with the misbehaving shard functions of ``helpers.fault_plugins``
(``hang_plan``: one parameter split by a function that hangs or stops). Imported by the tests
and by the scripts they run in a subprocess (which import ``helpers.fault_plugins`` first, to
register the functions)."""

from __future__ import annotations

import numpy as np


def split_entry(func: str, rows: int = 4, cols: int = 4) -> list:
    """A plan entry: ``func`` splits a (rows, cols) float32 tensor along dim 0."""
    return [[func, [["num_shards", f"{rows} // num_shards", cols], "float32"], 0]]


def params(count: int = 3) -> dict[str, np.ndarray]:
    """``count`` 4x4 float32 arrays: ``p<k>`` full of k."""
    return {f"p{k}": np.full((4, 4), k, np.float32) for k in range(count)}


def hang_plan(func: str = "tests.faults.hang", count: int = 3, at: int = 1) -> dict:
    """``count`` parameters split by ``tests.faults.split``, parameter ``p<at>`` by ``func``."""
    return {f"p{k}": split_entry(func if k == at else "tests.faults.split") for k in range(count)}
