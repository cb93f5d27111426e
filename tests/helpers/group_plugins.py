"""Session functions that use a session's collectives (``ctx.group``), for
``tests/test_sessions.py``; at module level, so worker processes register them too."""

from __future__ import annotations

import time

import torch

from shardload import register_session_func


@register_session_func("tests.groups.rounds")
def rounds(ctx, count: int) -> list:
    """``count`` rounds of an all-reduce of ``10 ** rank + round`` and a broadcast from worker
    ``round % size``, then a barrier: every worker's results."""
    out = []
    for r in range(count):
        total = ctx.group.all_reduce(torch.tensor([10.0**ctx.rank + r]))
        sent = ctx.group.broadcast(torch.tensor([100.0 * ctx.rank + r]), src=r % ctx.world_size)
        out.append([total.item(), sent.item()])
    ctx.group.barrier()
    return out


@register_session_func("tests.groups.fail_on")
def fail_on(ctx, rank: int) -> float:
    """Worker ``rank`` fails (after a moment, so that the others are already waiting); the
    others wait in an all-reduce it never joins."""
    if ctx.rank == rank:
        time.sleep(0.2)
        raise ValueError(f"worker {rank} fails on purpose")
    return ctx.group.all_reduce(torch.ones(1)).item()
