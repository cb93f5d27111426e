"""Which heads each of N tensor-parallel workers holds, for any N, padding where needed.

With N dividing the query heads (and N dividing, or a multiple of, the KV heads) this is the
usual layout: worker r holds query heads ``[r*n_q/N, (r+1)*n_q/N)`` and the KV heads they use
(vLLM's rule). For any other N, query heads are padded with zero heads up to
``ceil(n_q / N) * N``, each worker holds the KV heads its query heads use (a KV head may then be
held by two workers), and workers holding fewer KV heads than others get zero heads to keep
every worker's shapes equal. Padded heads have zero weights, and the o_proj columns that read
them are zero, so the model's output is unchanged.

>>> head_layout(9, 3, 2).q_heads
[[0, 1, 2, 3, 4], [5, 6, 7, 8, -1]]
>>> head_layout(9, 3, 2).kv_heads
[[0, 1], [1, 2]]
"""

from __future__ import annotations

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


def head_layout(num_heads: int, num_kv_heads: int, num_shards: int) -> HeadLayout:
    _count(num_heads, "num_heads")
    _count(num_kv_heads, "num_kv_heads")
    _count(num_shards, "num_shards")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly onto {num_kv_heads} KV "
                         "heads")
    group = num_heads // num_kv_heads
    per_worker = -(-num_heads // num_shards)
    q_heads = [[h if h < num_heads else -1
                for h in range(r * per_worker, (r + 1) * per_worker)]
               for r in range(num_shards)]
    needed = [sorted({h // group for h in heads if h >= 0}) for heads in q_heads]
    width = max(1, max(len(kv) for kv in needed))
    kv_heads = [kv + [-1] * (width - len(kv)) for kv in needed]
    q_to_kv = []
    for heads, kv in zip(q_heads, kv_heads):
        local = {h: i for i, h in enumerate(kv) if h >= 0}   # linear, not kv.index per head
        q_to_kv.append([local[h // group] if h >= 0 else 0 for h in heads])
    return HeadLayout(q_heads, kv_heads, q_to_kv)


def unit_layout(num_units: int, num_shards: int) -> list[list[int]]:
    """Units (e.g. 32-row blocks of the MLP) per worker, padded with -1 to equal counts."""
    _count(num_units, "num_units")
    _count(num_shards, "num_shards")
    per_worker = -(-num_units // num_shards)
    return [[u if u < num_units else -1 for u in range(r * per_worker, (r + 1) * per_worker)]
            for r in range(num_shards)]


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
