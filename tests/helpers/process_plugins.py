"""Shard and session functions for ``tests/test_sessions_process.py``.

ProcessSession workers are separate interpreters: the functions they run must be defined at
module level in a module they can import. This one is imported as ``helpers.process_plugins``
(``tests/`` is on ``sys.path`` under pytest, and the CLI test puts it on ``PYTHONPATH``); import
it under that name only, or its names would be registered twice with different function objects.

Shard functions (numpy, ``func(input, dim, output)``, an even split along ``dim``):

* ``tests.process.split``: just the split (an opaque chain: every worker process computes it).
* ``tests.process.fail_on_1``: raises ``ValueError`` on worker 1 (``SHARDLOAD_RANK``), splits
  elsewhere.
* ``tests.process.kill_on_1``: SIGKILLs its own process on worker 1, splits elsewhere.
* ``tests.process.slow``: sleeps ``SLOW_SECONDS`` then splits; the first call creates the file
  named by ``SHARDLOAD_TEST_PROCESS_STARTED``, if set, so a test knows the load has begun.

Session functions (``func(ctx, *args)``):

* ``tests.process.rank`` -> ``ctx.rank``; ``tests.process.env`` -> the worker's pid and its
  ``SHARDLOAD_RANK`` / ``SHARDLOAD_WORLD_SIZE``; ``tests.process.tensor`` -> a tensor built from
  the rank; ``tests.process.all_reduce`` -> the sum of ``rank + 1`` over the workers' process
  group; ``tests.process.read_value(name)`` -> ``ctx.values.get(name)``;
  ``tests.process.shard_names`` -> ``sorted(ctx.shards)``;
  ``tests.process.not_json`` -> an object that JSON cannot carry; ``tests.process.nan`` -> NaN.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import torch

from shardload import register_session_func
from shardload.registry import get_shard_func, register_shard_func

SLOW_SECONDS = 0.2
STARTED_ENV = "SHARDLOAD_TEST_PROCESS_STARTED"


def _rank() -> str:
    return os.environ.get("SHARDLOAD_RANK", "")


# an even split along dim: the built-in split's shape rule, reused
SPLIT_RULE = get_shard_func("shardload.split").shape_rule


def _split_into(input, dim, output) -> None:
    output[...] = np.stack(np.split(input, output.shape[0], axis=dim))


@register_shard_func("tests.process.split", array="numpy", shape_rule=SPLIT_RULE)
def split(input, dim, output):
    """Split evenly along dim (an opaque chain)."""
    _split_into(input, dim, output)


@register_shard_func("tests.process.fail_on_1", array="numpy", shape_rule=SPLIT_RULE)
def fail_on_1(input, dim, output):
    """Raise ValueError on worker 1, split evenly elsewhere."""
    if _rank() == "1":
        raise ValueError("fail_on_1 refuses to run on worker 1")
    _split_into(input, dim, output)


@register_shard_func("tests.process.kill_on_1", array="numpy", shape_rule=SPLIT_RULE)
def kill_on_1(input, dim, output):
    """SIGKILL this process on worker 1, split evenly elsewhere."""
    if _rank() == "1":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # not reached: the signal is delivered at once
    _split_into(input, dim, output)


@register_shard_func("tests.process.slow", array="numpy", shape_rule=SPLIT_RULE)
def slow(input, dim, output):
    """Sleep SLOW_SECONDS, then split evenly along dim."""
    marker = os.environ.get(STARTED_ENV)
    if marker and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"{os.getpid()}\n")
    time.sleep(SLOW_SECONDS)
    _split_into(input, dim, output)


@register_session_func("tests.process.rank")
def rank(ctx):
    return ctx.rank


@register_session_func("tests.process.env")
def env(ctx):
    return {
        "pid": os.getpid(),
        "rank": os.environ.get("SHARDLOAD_RANK"),
        "world_size": os.environ.get("SHARDLOAD_WORLD_SIZE"),
    }


@register_session_func("tests.process.tensor")
def tensor(ctx):
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * (ctx.rank + 1)


@register_session_func("tests.process.all_reduce")
def all_reduce(ctx):
    import torch.distributed as dist

    value = torch.tensor([ctx.rank + 1], dtype=torch.int64)
    dist.all_reduce(value)
    return {
        "sum": int(value.item()),
        "backend": str(dist.get_backend()),
        "world_size": dist.get_world_size(),
    }


@register_session_func("tests.process.read_value")
def read_value(ctx, name):
    return ctx.values.get(name)


@register_session_func("tests.process.shard_names")
def shard_names(ctx):
    return sorted(ctx.shards)


@register_session_func("tests.process.not_json")
def not_json(ctx):
    return object()


@register_session_func("tests.process.nan")
def nan(ctx):
    return float("nan")
