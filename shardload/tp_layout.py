"""Which heads each of N tensor-parallel workers holds, for any N, padding where needed.

With N dividing the query heads (and N dividing, or a multiple of, the KV heads) this is the
usual layout: worker r holds query heads ``[r*n_q/N, (r+1)*n_q/N)`` and the KV heads they use
(vLLM's rule). For any other N the heads are zero-padded into the smallest layout that is still
regular, the shape every engine's attention has: ``n_kv'`` KV heads (N divides them, or they
divide N and each is held by ``N / n_kv'`` workers in turn), each read by ``g'`` query heads
(``g'`` at least the model's ``n_q / n_kv``), ``n_kv' * g'`` query heads in all, divisible by N,
padded query head ``p`` reading KV head ``p // g'``. KV head ``j``'s real query heads come first
in its group, then zero query heads; KV heads past the real ones are zero heads read only by
zero query heads. Zero heads have zero weights and the o_proj columns that read them are zero,
so the model's output is unchanged. Of the regular layouts, the one with the fewest query heads
(then KV heads) is taken; where N splits the heads evenly that is the plain one.

Where even that has more than twice the model's query heads (12 heads on 11 workers would need
44), the fewest heads are taken instead: query heads padded up to ``ceil(n_q / N) * N``, each
worker holding the KV heads its query heads use (one may be held by two workers) and zero KV
heads to keep every worker's shapes equal. Only shardload's own model runs that layout.

>>> head_layout(9, 3, 2).q_heads        # SmolLM2 on 2 workers: 12 query, 4 KV heads
[[0, 1, 2, 3, 4, 5], [6, 7, 8, -1, -1, -1]]
>>> head_layout(9, 3, 2).kv_heads
[[0, 1], [2, -1]]
>>> head_layout(8, 2, 3).q_heads        # 12 query, 3 KV heads: the third worker's are zeros
[[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1]]

Heads that must stay ``together`` (DeepSeek-V3's 192-row query heads in 128-row FP8 scale
blocks: only two heads fill whole blocks, three of them) are laid out as heads ``together``
times as wide, then each is unfolded into its heads: every worker holds whole aligned runs of
``together`` real heads, or of zero heads.

>>> head_layout(8, 8, 3, together=2).q_heads     # 4 pairs over 3 workers: 6 pairs, 12 heads
[[0, 1, 2, 3], [4, 5, 6, 7], [-1, -1, -1, -1]]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HeadLayout:
    """Per worker: global query heads (-1 = padding), global KV heads (-1 = padding), and for
    each local query head the local index of the KV head it attends with."""

    q_heads: list[list[int]]
    kv_heads: list[list[int]]
    q_to_kv: list[list[int]]

    @property
    def padded(self) -> bool:
        return any(h < 0 for heads in (*self.q_heads, *self.kv_heads) for h in heads)

    def as_dict(self) -> dict:
        return asdict(self)


#: the most heads, units and workers a layout is built for: its lists grow with them, so the
#: bound is checked before anything is built (the planners' metadata bounds are within it)
MAX_LAYOUT = 1 << 22


def _count(value: object, what: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_LAYOUT:
        raise ValueError(f"{what} must be an integer from 1 to {MAX_LAYOUT}, got {value!r}")
    return value


def _regular_sizes(num_heads: int, num_kv_heads: int, num_shards: int) -> tuple[int, int]:
    """(padded KV heads, query heads per KV head) of the smallest regular layout: the fewest
    query heads in all, then the fewest KV heads (the module docstring)."""
    group, n = num_heads // num_kv_heads, num_shards
    # KV heads: the first multiple of N from the model's, or a divisor of N at least as many
    candidates = {-(-num_kv_heads // n) * n}
    d = 1
    while d * d <= n:
        candidates.update(k for k in (d, n // d) if n % d == 0 and k >= num_kv_heads)
        d += 1

    def padded(kv: int) -> tuple[int, int]:
        step = n // math.gcd(kv, n)  # kv * g is a multiple of N iff step divides g
        return kv, -(-group // step) * step

    # the first of the fewest query heads in all: the fewest KV heads among them
    return min(map(padded, sorted(candidates)), key=lambda sizes: sizes[0] * sizes[1])


def head_layout(
    num_heads: int, num_kv_heads: int, num_shards: int, *, together: int = 1
) -> HeadLayout:
    _count(num_heads, "num_heads")
    _count(num_kv_heads, "num_kv_heads")
    _count(num_shards, "num_shards")
    _count(together, "together")
    if together > 1:
        return _unfolded(num_heads, num_kv_heads, num_shards, together)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads do not group evenly onto {num_kv_heads} KV heads"
        )
    group = num_heads // num_kv_heads
    kv_pad, g_pad = _regular_sizes(num_heads, num_kv_heads, num_shards)
    if kv_pad * g_pad > 2 * num_heads:
        return _fewest_heads(num_heads, num_kv_heads, num_shards)
    q_per = kv_pad * g_pad // num_shards

    def real_query(p: int) -> int:  # padded query head p -> the model's, or -1
        kv, i = divmod(p, g_pad)
        return kv * group + i if kv < num_kv_heads and i < group else -1

    q_heads = [
        [real_query(p) for p in range(r * q_per, (r + 1) * q_per)] for r in range(num_shards)
    ]
    if kv_pad >= num_shards:  # each KV head on one worker
        kv_per = kv_pad // num_shards
        first = [r * kv_per for r in range(num_shards)]
    else:  # each KV head on N / kv_pad workers in turn
        kv_per = 1
        first = [r // (num_shards // kv_pad) for r in range(num_shards)]
    kv_heads = [[h if h < num_kv_heads else -1 for h in range(f, f + kv_per)] for f in first]
    q_to_kv = [
        [p // g_pad - f for p in range(r * q_per, (r + 1) * q_per)] for r, f in enumerate(first)
    ]
    return HeadLayout(q_heads, kv_heads, q_to_kv)


def _unfolded(num_heads: int, num_kv_heads: int, num_shards: int, together: int) -> HeadLayout:
    """The layout of heads ``together`` times as wide, each unfolded into its ``together``
    heads (query and KV alike); a real query head keeps the KV head it reads, a zero one reads
    the one an engine's regular layout would give it (local ``i // (queries / KV heads)``)."""
    if num_heads % together or num_kv_heads % together:
        raise ValueError(
            f"{num_heads} query and {num_kv_heads} KV heads do not make whole runs "
            f"of {together} heads"
        )
    wide = head_layout(num_heads // together, num_kv_heads // together, num_shards)

    def unfold(heads: list[int]) -> list[int]:
        return [h * together + j if h >= 0 else -1 for h in heads for j in range(together)]

    group = num_heads // num_kv_heads
    q_heads = [unfold(heads) for heads in wide.q_heads]
    kv_heads = [unfold(heads) for heads in wide.kv_heads]
    q_to_kv = []
    for queries, keys in zip(q_heads, kv_heads):
        local = {h: i for i, h in enumerate(keys) if h >= 0}
        ratio = max(1, len(queries) // len(keys))
        q_to_kv.append(
            [
                local[h // group] if h >= 0 else min(p // ratio, len(keys) - 1)
                for p, h in enumerate(queries)
            ]
        )
    return HeadLayout(q_heads, kv_heads, q_to_kv)


def _fewest_heads(num_heads: int, num_kv_heads: int, num_shards: int) -> HeadLayout:
    """Query heads padded at the end to ``ceil(n_q / N) * N``; each worker's KV heads those
    use, zero KV heads filling every worker up to the most any holds."""
    group = num_heads // num_kv_heads
    per_worker = -(-num_heads // num_shards)
    q_heads = [
        [h if h < num_heads else -1 for h in range(r * per_worker, (r + 1) * per_worker)]
        for r in range(num_shards)
    ]
    needed = [sorted({h // group for h in heads if h >= 0}) for heads in q_heads]
    width = max(1, max(len(kv) for kv in needed))
    kv_heads = [kv + [-1] * (width - len(kv)) for kv in needed]
    q_to_kv = []
    for heads, kv in zip(q_heads, kv_heads):
        local = {h: i for i, h in enumerate(kv) if h >= 0}  # linear, not kv.index per head
        q_to_kv.append([local[h // group] if h >= 0 else 0 for h in heads])
    return HeadLayout(q_heads, kv_heads, q_to_kv)


def unit_layout(num_units: int, num_shards: int) -> list[list[int]]:
    """Units (e.g. 32-row blocks of the MLP) per worker, padded with -1 to equal counts."""
    _count(num_units, "num_units")
    _count(num_shards, "num_shards")
    per_worker = -(-num_units // num_shards)
    return [
        [u if u < num_units else -1 for u in range(r * per_worker, (r + 1) * per_worker)]
        for r in range(num_shards)
    ]


def expert_layout(num_experts: int, num_shards: int) -> list[list[int]]:
    """Whole experts per worker for expert parallelism: contiguous, balanced (the first
    ``num_experts % num_shards`` workers take one more, as vLLM assigns them), padded with -1
    to equal counts (a stacked expert tensor gives every worker the same number of slots).

    >>> expert_layout(6, 4)
    [[0, 1], [2, 3], [4, -1], [5, -1]]
    """
    _count(num_experts, "num_experts")
    _count(num_shards, "num_shards")
    base, extra = divmod(num_experts, num_shards)
    width = base + (extra > 0)
    out, start = [], 0
    for r in range(num_shards):
        count = base + (r < extra)
        out.append(list(range(start, start + count)) + [-1] * (width - count))
        start += count
    return out
