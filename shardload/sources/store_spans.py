"""Which bytes of an object to read: the spans wanted, checked, coalesced across the gaps
cheaper read than skipped (``coalesce``), and cut into GETs (``pieces``)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import quote
from .store_config import MAX_GAP, SMALL_GAP

__all__ = ["check_span", "check_within", "coalesce", "pieces"]


def check_span(span: Any) -> tuple[int, int]:
    try:
        begin, end = span
        begin, end = operator.index(begin), operator.index(end)
    except (TypeError, ValueError):
        raise TypeError(f"a span is a pair of ints (begin, end), not {quote(span)}") from None
    if not 0 <= begin <= end:
        raise ValueError(f"span [{begin}, {end}) is not 0 <= begin <= end")
    return begin, end


def coalesce(
    spans: Iterable[Sequence[int]], max_gap: int = MAX_GAP, small_gap: int | None = None
) -> list[tuple[int, int]]:
    """``[begin, end)`` byte spans sorted, overlapping and adjacent ones merged, empty ones
    dropped, and two runs of wanted bytes joined across the gap between them when the gap is
    at most ``small_gap`` (default ``SMALL_GAP``, 64 KiB), or at most ``max_gap`` (1 MiB) and
    at most a quarter of the run it joins.

    The bounded over-read rule: every byte asked for is read, and the bytes read that nobody
    asked for are at most 64 KiB per gap read through plus a quarter of the bytes asked for.
    Why read a gap at all: a ranged GET costs a round trip before its first byte (some 10-20 ms
    in-region), about what transferring 1 MiB costs one connection, so a small gap is cheaper
    read than skipped. Why not every gap under 1 MiB: on a small model the gaps between one
    worker's pieces are other workers' pieces, and reading through them would fetch the whole
    file on every worker.

    >>> coalesce([(10, 20), (0, 5), (5, 8), (21, 30), (100, 110)], max_gap=1)
    [(0, 8), (10, 30), (100, 110)]
    >>> coalesce([(0, 100), (150, 400), (420, 430)], max_gap=1000, small_gap=10)
    [(0, 400), (420, 430)]
    """
    if isinstance(max_gap, bool) or not isinstance(max_gap, int) or max_gap < 0:
        raise ValueError(f"max_gap is a whole number of bytes >= 0, not {quote(max_gap)}")
    small = min(max_gap, SMALL_GAP if small_gap is None else small_gap)
    checked = sorted(s for s in map(check_span, spans) if s[1] > s[0])
    runs: list[tuple[int, int]] = []  # maximal runs of wanted bytes
    for begin, end in checked:
        if runs and begin <= runs[-1][1]:
            if end > runs[-1][1]:
                runs[-1] = (runs[-1][0], end)
        else:
            runs.append((begin, end))
    merged: list[tuple[int, int]] = []
    for begin, end in runs:
        gap = begin - merged[-1][1] if merged else None
        if gap is not None and (gap <= small or (gap <= max_gap and 4 * gap <= end - begin)):
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    return merged


def pieces(spans: Iterable[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """Each span cut into pieces of at most ``chunk`` bytes, in order."""
    return [(b, min(b + chunk, end)) for begin, end in spans for b in range(begin, end, chunk)]


def check_within(url: str, size: int, begin: int, end: int) -> None:
    """Refuse (``ValueError``) bytes ``[begin, end)`` that are not all within the object."""
    if end > size:
        raise ValueError(f"bytes [{begin}, {end}) are outside {url}, which has {size} bytes")
