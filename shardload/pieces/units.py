"""A load's stream units, planned from its workers' read plans (pure functions: no I/O).

A unit is one parameter: the union of every worker's byte spans of it, per object source, in
the one order every worker's plan keeps (``stream_units``). A parameter of more than
``PART_BYTES`` in one object is cut, by position in the object, into parts of about that size,
one unit each (``split_runs`` cuts each worker's runs the same way): a worker copies the first
part of a 2 GB embedding while the rest arrives, and the window need not hold it whole.

>>> units = stream_units(plans)                   # doctest: +SKIP
>>> firsts, lasts, cuts = piece_units(plans[0], units)  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..readplan import PieceRead, ReadPlan, Run
from ..sources.specs import FileSource

__all__ = [
    "PART_BYTES",
    "Cut",
    "Units",
    "object_sources",
    "piece_units",
    "split_runs",
    "stream_units",
]

#: a parameter with more bytes than this in one object is streamed in parts of about this size
PART_BYTES = 16 << 20

#: where a parameter is cut: ``(source, offsets)``, the offsets rising
Cut = tuple[int, tuple[int, ...]]
#: a unit's byte spans by object source
UnitSpans = dict[int, list[tuple[int, int]]]


def object_sources(plan: ReadPlan) -> set[int]:
    """The indices of ``plan``'s sources that are objects in object storage."""
    return {
        k
        for k, spec in enumerate(plan.sources)
        if isinstance(spec, FileSource) and spec.object is not None
    }


def _merged_order(plans: list[ReadPlan]) -> list[str]:
    """One order of every piece name that each plan's order keeps (each plan's pieces are a
    subsequence of the load's parameters, so there is one): the plans' orders merged, ties
    taken in the order names were first seen. A worker that holds some parameters only
    (expert parallelism) must not find a unit it still needs behind one the others are past."""
    first: dict[str, int] = {}
    after: dict[str, list[str]] = {}
    waiting: dict[str, int] = {}
    for plan in plans:
        prev = None
        for piece in plan.pieces:
            name = piece.name
            if name not in first:
                first[name] = len(first)
                waiting[name] = 0
            if prev is not None:
                after.setdefault(prev, []).append(name)
                waiting[name] += 1
            prev = name
    ready = [(k, name) for name, k in first.items() if not waiting[name]]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for nxt in after.get(name, ()):
            waiting[nxt] -= 1
            if not waiting[nxt]:
                heapq.heappush(ready, (first[nxt], nxt))
    if len(order) != len(first):
        raise ValueError(
            "the workers' read plans take the parameters in orders that "
            "contradict each other; they cannot share one stream"
        )
    return order


@dataclass
class Units:
    """A load's units in the workers' order (``stream_units``): ``names[u]``, the parameter
    unit ``u`` is (a part of); ``spans[u]``, its byte spans by object source (unsorted,
    overlapping as the workers' are; empty for a unit no worker reads from an object);
    ``first[name]``, a parameter's first unit; ``cuts[name]``, ``(source, offsets)`` for a
    parameter streamed in parts (``split_runs``)."""

    names: list[str]
    spans: list[UnitSpans]
    first: dict[str, int]
    cuts: dict[str, Cut]


def _cuts(plans: list[ReadPlan], part_bytes: int) -> dict[str, Cut]:
    """Where each parameter of more than ``part_bytes`` in one object is cut: every
    ``part_bytes`` from the first byte any worker reads of it. A parameter read from several
    objects stays whole."""
    bounds: dict[str, dict[int, list[int]]] = {}
    for plan in plans:
        remote = object_sources(plan)
        for piece in plan.pieces:
            for run in piece.runs:
                if run.source in remote:
                    lo, hi = run.offset, run.end
                    b = bounds.setdefault(piece.name, {}).setdefault(run.source, [lo, hi])
                    b[0], b[1] = min(b[0], lo), max(b[1], hi)
    cuts = {}
    for name, by_source in bounds.items():
        if len(by_source) == 1:
            ((source, (lo, hi)),) = by_source.items()
            if hi - lo > part_bytes:
                cuts[name] = (source, tuple(range(lo + part_bytes, hi, part_bytes)))
    return cuts


def split_runs(runs: Iterable[Run], source: int, cuts: Sequence[int]) -> list[list[Run]]:
    """``runs`` cut at the byte offsets ``cuts`` of ``source``: one list per part, part ``k``
    holding what ends before ``cuts[k]`` (and after the cut before it). A contiguous run is cut
    at the offsets themselves; a run of several blocks between its blocks, each block going
    to the part where it ends, so that a part fetched means its blocks are whole. Runs from
    other sources go with the first part."""
    parts: list[list[Run]] = [[] for _ in range(len(cuts) + 1)]
    for run in runs:
        if run.source != source:
            parts[0].append(run)
        elif run.count == 1:
            begin, end = run.offset, run.end
            k = bisect.bisect_right(cuts, begin)
            while begin < end:
                stop = min(end, cuts[k]) if k < len(cuts) else end
                parts[k].append(
                    Run(source, begin, stop - begin, 1, 0, run.dst_offset + begin - run.offset, 0)
                )
                begin, k = stop, k + 1
        else:
            step, dst_step = run.step, run.dst_step
            first = 0
            for k in range(len(cuts) + 1):
                # the blocks whose last byte lies before the cut: offset + r*step + nbytes <= cut
                last = (
                    run.count
                    if k == len(cuts)
                    else min(
                        run.count, max(first, -(-(cuts[k] - run.offset - run.nbytes + 1) // step))
                    )
                )
                if last > first:
                    parts[k].append(
                        Run(
                            source,
                            run.offset + first * step,
                            run.nbytes,
                            last - first,
                            run.stride,
                            run.dst_offset + first * dst_step,
                            run.dst_stride,
                        )
                    )
                first = last
    return parts


def _piece_parts(piece: PieceRead, cut: Cut | None) -> list[list[Run]]:
    return [list(piece.runs)] if cut is None else split_runs(piece.runs, cut[0], cut[1])


def stream_units(plans: list[ReadPlan], part_bytes: int | None = None) -> Units:
    """The load's units (``Units``) for the workers of ``plans``, parameters cut in parts of
    ``part_bytes`` (default ``PART_BYTES``)."""
    order = _merged_order(plans)
    cuts = _cuts(plans, PART_BYTES if part_bytes is None else part_bytes)
    names: list[str] = []
    first: dict[str, int] = {}
    for name in order:
        first[name] = len(names)
        names.extend([name] * (len(cuts[name][1]) + 1 if name in cuts else 1))
    spans: list[UnitSpans] = [{} for _ in names]
    for plan in plans:
        remote = object_sources(plan)
        if not remote:
            continue
        for piece in plan.pieces:
            at = first[piece.name]
            for k, runs in enumerate(_piece_parts(piece, cuts.get(piece.name))):
                for run in runs:
                    if run.source in remote:
                        spans[at + k].setdefault(run.source, []).extend(run.spans())
    return Units(names, spans, first, cuts)


def piece_units(plan: ReadPlan, units: Units) -> tuple[list[int], list[int], dict[int, Cut]]:
    """For each piece of ``plan``: its first and last unit (-1 for a piece that reads no
    object; rising: ``_merged_order``), and, for a piece streamed in parts, its cut
    (``{piece index: (source, offsets)}``)."""
    remote = object_sources(plan)
    firsts: list[int] = []
    lasts: list[int] = []
    cuts: dict[int, Cut] = {}
    for j, piece in enumerate(plan.pieces):
        if not any(r.source in remote for r in piece.runs):
            firsts.append(-1)
            lasts.append(-1)
            continue
        at = units.first[piece.name]
        cut = units.cuts.get(piece.name)
        firsts.append(at)
        lasts.append(at + (len(cut[1]) if cut else 0))
        if cut is not None:
            cuts[j] = cut
    reading = [(a, b) for a, b in zip(firsts, lasts) if a >= 0]
    if any(b[0] <= a[1] for a, b in itertools.pairwise(reading)):
        raise ValueError(f"worker {plan.rank}'s pieces are not in the stream's order")
    return firsts, lasts, cuts
