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
    return np.concatenate(
        [
            np.take(w, range(u * size, (u + 1) * size), axis=axis)
            if u >= 0
            else np.zeros_like(np.take(w, range(size), axis=axis))
            for u in units
        ],
        axis=axis,
    )


def padded_heads(num_heads: int, num_kv_heads: int, n: int) -> tuple[list, list]:
    """Zero padding for N the heads do not divide: (query heads, KV heads) per worker, -1 a
    zero head, in the smallest layout an engine's attention holds: ``K`` KV heads (at least the
    model's; N divides K, or K divides N and each is held by N / K workers in turn) each read
    by ``Q / K`` query heads (at least the model's group), ``Q`` query heads in all (N divides
    them), the fewest ``Q``, then the fewest ``K``. KV head j's query heads are j's real ones,
    then zeros; worker r holds query heads ``r*Q/N ..`` in that order. Where that ``Q`` is over
    twice the model's heads: ``c = ceil(heads / n)`` query heads each, worker r taking heads
    ``r*c .. (r+1)*c - 1`` (those past the last are zero heads) and the KV heads those use, in
    order, filled up with zero heads to the most any worker holds."""
    group = num_heads // num_kv_heads
    total = num_heads
    while True:
        fits = [
            k
            for k in range(num_kv_heads, total + 1)
            if total % n == 0
            and total % k == 0
            and total // k >= group
            and (k % n == 0 or n % k == 0)
        ]
        if fits:
            kv_total = fits[0]
            break
        total += 1
    if total > 2 * num_heads:
        c = -(-num_heads // n)
        q = [[h if h < num_heads else -1 for h in range(r * c, (r + 1) * c)] for r in range(n)]
        kv = [sorted({h // group for h in heads if h >= 0}) for heads in q]
        width = max(1, *(len(k) for k in kv))
        return q, [k + [-1] * (width - len(k)) for k in kv]
    per_group = total // kv_total
    order = []  # padded query heads, in order
    for j in range(kv_total):
        real = list(range(j * group, (j + 1) * group)) if j < num_kv_heads else []
        order += real + [-1] * (per_group - len(real))
    per = total // n
    q = [order[r * per : (r + 1) * per] for r in range(n)]
    kv_slots = [h if h < num_kv_heads else -1 for h in range(kv_total)]
    if kv_total >= n:
        width = kv_total // n
        kv = [kv_slots[r * width : (r + 1) * width] for r in range(n)]
    else:
        kv = [[kv_slots[r * kv_total // n]] for r in range(n)]
    return q, kv


def padded_head_runs(num_heads: int, num_kv_heads: int, n: int, run: int) -> tuple[list, list]:
    """``padded_heads`` for heads that only ``run`` at a time fill whole storage blocks
    (DeepSeek-V3's 192-row heads in 128-row FP8 blocks: two heads, three blocks) or groups
    (heads narrower than a quantization group): the layout of heads ``run`` times as wide, each
    unfolded into its ``run`` heads (``r*run .. r*run + run - 1``), zero ones into zeros."""
    wide_q, wide_kv = padded_heads(num_heads // run, num_kv_heads // run, n)

    def unfold(heads):
        return [h * run + j if h >= 0 else -1 for h in heads for j in range(run)]

    return [unfold(h) for h in wide_q], [unfold(h) for h in wide_kv]


def padded_units(units: int, n: int) -> list[list[int]]:
    """Units (MLP rows) per worker: ``ceil(units / n)`` each, in order, -1 past the last."""
    c = -(-units // n)
    return [[u if u < units else -1 for u in range(r * c, (r + 1) * c)] for r in range(n)]


def layer_piece(w, axis: int, segments, n: int, i: int, head_dim: int, padded=None):
    """Worker i's piece of a (possibly fused) layer's dense weight ``w`` (a torch tensor), split
    along ``axis``: each segment ``(rows, units, replicable, kind)`` (kind ``q``, ``kv`` or
    ``mlp``) on its own, concatenated. ``padded``: ``(query heads, KV heads, MLP rows)`` per
    worker for a zero-padded N (-1 a zero unit); the MLP's unit is one row, a head's
    ``head_dim`` rows."""
    import torch

    pieces, start = [], 0
    for rows, units, replicable, kind in segments:
        part = w.narrow(axis, start, rows)
        start += rows
        if padded is None:
            index = rows_of(n, i, rows, units, replicable)
            pieces.append(part[index] if axis == 0 else part[:, index])
        else:
            worker = {"q": padded[0], "kv": padded[1], "mlp": padded[2]}[kind][i]
            size = 1 if kind == "mlp" else head_dim
            pieces.append(torch.from_numpy(take(part.numpy(), worker, size, axis)))
    return torch.cat(pieces, dim=axis)


def expert_slots(num_experts: int, n: int) -> list[list[int]]:
    """Whole experts per worker for expert parallelism: contiguous, balanced (the first
    ``E % n`` workers take one more), the shorter workers filled up with -1 to the longest."""
    counts = [num_experts // n + (r < num_experts % n) for r in range(n)]
    starts = [sum(counts[:r]) for r in range(n)]
    return [list(range(s, s + c)) + [-1] * (max(counts) - c) for s, c in zip(starts, counts)]
