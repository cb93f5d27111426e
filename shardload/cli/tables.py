"""Plain-text tables and sizes, as the commands print them.

>>> print(table(["worker", "bytes"], [[0, human(2048)], [1, human(512)]], right=(0, 1)))
worker    bytes
------  -------
     0  2.0 KiB
     1    512 B
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any


def human(n: float) -> str:
    """``2048`` -> ``"2.0 KiB"``: bytes in the largest binary unit under 1024 of it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def table(headers: list[str], rows: list[list[Any]], right: tuple[int, ...] = ()) -> str:
    """A plain-text table; columns listed in ``right`` (numbers) are right-aligned."""
    return "\n".join(table_lines(headers, lambda: rows, right))


def table_lines(
    headers: list[str], rows: Callable[[], Iterable[list[Any]]], right: tuple[int, ...] = ()
) -> Iterator[str]:
    """``table``'s lines one at a time, from ``rows()`` made twice (the first time for the
    widths): a table of a million rows is never held whole."""
    widths = [len(h) for h in headers]
    for row in rows():
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]

    def line(row: list[Any]) -> str:
        padded = [
            str(c).rjust(w) if k in right else str(c).ljust(w)
            for k, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(padded).rstrip()

    yield line(headers)
    yield line(["-" * w for w in widths])
    yield from map(line, rows())


def workers(indices: list[int]) -> str:
    """``"worker 2"``, ``"workers 0, 3"``."""
    return ("worker " if len(indices) == 1 else "workers ") + ", ".join(map(str, indices))


def per_worker(validated) -> str:
    """``12 MiB per worker``, or, where the plan places parameters on some workers only, the
    most any worker keeps."""
    most = human(validated.bytes_per_worker())
    if validated.plan.placement is None:
        return f"{most} per worker"
    placed = sum(1 for p in validated if p.workers is not None)
    if not placed:
        return f"at most {most} per worker"
    return f"at most {most} per worker ({placed} tensors placed on some workers only)"
