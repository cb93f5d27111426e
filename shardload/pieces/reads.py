"""Reading byte runs out of the mapped sources, and the page policy around it.

``read_runs`` copies a piece's byte runs (``readplan.Run``) out of the source into a new tensor,
checking each against the bounds of both; ``SourceViews`` gives the sources they copy from, for
the length of one load. A small run is copied by numpy (about a microsecond a call, where a
torch copy costs ten: a load of many small tensors is made of such calls), a large one by torch
(its copy is parallel, and reports progress in chunks: ``copy_blocks``); both release the GIL
for large copies.
Mapped pages go back to the kernel in batches once every local worker is done with them
(``PageReleases``), and are asked for a little ahead of the copies (``Readahead``). The sizes
those use are read here when each is made (``RELEASE_BATCH_BYTES``, ``READAHEAD_WINDOW``,
``READAHEAD_BYTES``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from .. import dtypes
from ..readers.base import Checkpoint
from ..readplan import ReadPlan, Run

__all__ = [
    "CHECK_INTERVAL_S",
    "READAHEAD_BYTES",
    "READAHEAD_WINDOW",
    "RELEASE_BATCH_BYTES",
    "SMALL_RUN_BYTES",
    "SPAN_GAP_BYTES",
    "PageReleases",
    "Readahead",
    "SourceViews",
    "copy_runs",
    "count_read",
    "new_piece",
    "piece_spans",
    "read_runs",
    "source_bytes_for",
    "tensor_spans",
]

#: mapped pages go back to the kernel once this many bytes of them are done with (PageReleases)
RELEASE_BATCH_BYTES = 256 << 20
#: the read-ahead asks for the file in windows of this size, this far ahead of the copies
READAHEAD_WINDOW = 32 << 20
READAHEAD_BYTES = 256 << 20
#: spans of one source closer than this are released, or asked for, in one call: a worker
#: process reads every Nth slice of small tensors, and a call per slice was a system call per
#: piece (100,000 of them at 100,000 tensors). The bytes between belong to the other workers'
#: pieces: this process never touched them (release), or they are about to be read (ahead).
SPAN_GAP_BYTES = 1 << 20
#: runs of up to this many bytes are copied by numpy, larger ones by torch (see above)
SMALL_RUN_BYTES = 1 << 20
#: a load checks that a file is still the one it opened before its first read of the file,
#: again before any read this long after the last check, and once more when it is done (so a
#: file changed under a load fails it, never mixes into it). A ``stat`` per piece was a tenth
#: of a load of small tensors, more with many worker threads: each hands the GIL on.
CHECK_INTERVAL_S = 0.1


def _copy_run(dst: torch.Tensor, src: torch.Tensor, run: Run) -> None:
    """One strided copy, in pieces that report progress when a hook is set (``copy_progress``)."""
    from ..readers.mapped import copy_blocks

    # as_strided counts offsets from the start of the storage, not of the view
    s = src.as_strided(
        (run.count, run.nbytes, 1),
        (run.step, 1, 1),
        src.storage_offset() + run.offset,
    )
    d = dst.as_strided(
        (run.count, run.nbytes, 1),
        (run.dst_step, 1, 1),
        dst.storage_offset() + run.dst_offset,
    )
    copy_blocks(d, s)


class SourceViews:
    """The byte sources of one load, each as a 1-D uint8 tensor and a numpy view of the same
    memory, fetched from the checkpoint once (``source_bytes``, which checks that the file is
    unchanged) and checked again at most every ``CHECK_INTERVAL_S`` while in use.

    ``entries`` is public for the load loop, which reads it inline (a method call per piece
    was a tenth of a small piece's cost): ``{index: (tensor, array, checked at, length)}``;
    an entry checked ``CHECK_INTERVAL_S`` ago or more is ``refresh``ed before it is read."""

    def __init__(self, source: Checkpoint):
        self._source = source
        self.entries: dict[int, tuple[torch.Tensor, np.ndarray, float, int]] = {}

    def get(self, index: int) -> tuple[torch.Tensor, np.ndarray]:
        now = time.monotonic()
        entry = self.entries.get(index)
        if entry is None or now - entry[2] >= CHECK_INTERVAL_S:
            entry = self.refresh(index, now)
        return entry[0], entry[1]

    def refresh(self, index: int, now: float) -> tuple[torch.Tensor, np.ndarray, float, int]:
        """Source ``index`` fetched again (checked unchanged), as checked at ``now``."""
        view = self._source.source_bytes(index)  # checks the file is unchanged
        array = view.numpy()
        entry = self.entries[index] = (view, array, now, array.shape[0])
        return entry

    def check(self) -> None:
        """Check again every source used so far (the end of a load)."""
        for index in self.entries:
            self._source.source_bytes(index)


def new_piece(shape, dtype: str, zeros: bool) -> tuple[torch.Tensor, np.ndarray]:
    """A new CPU tensor of ``shape``/``dtype`` (zeros or uninitialised) that owns its memory,
    and a flat uint8 numpy view of its bytes to copy into.

    Made by numpy, then taken by torch (``from_numpy``): numpy's small calls do not release the
    GIL, where every torch call does. With many workers in threads of one process, a release
    per call handed the GIL from thread to thread at every piece, which cost more than the
    pieces' own copies."""
    carrier, view = dtypes.numpy_carrier(dtype)
    array = (np.zeros if zeros else np.empty)(shape, carrier)
    tensor = torch.from_numpy(array)
    if view:
        tensor = tensor.view(dtypes.to_torch(dtype))
    return tensor, array.reshape(-1).view(np.uint8)


def copy_runs(dst: np.ndarray, runs, views: SourceViews, name: str) -> int:
    """Copy ``runs`` into ``dst`` (a piece's bytes, ``new_piece``), each run checked against
    the bounds of its source and of ``dst`` first; the bytes copied."""
    total = 0
    for run in runs:
        total += run.total
        src_t, src = views.get(run.source)
        run.check(src.shape[0], dst.shape[0], name)
        if run.total > SMALL_RUN_BYTES:
            _copy_run(torch.from_numpy(dst), src_t, run)
        elif run.count == 1:
            dst[run.dst_offset : run.dst_offset + run.nbytes] = src[
                run.offset : run.offset + run.nbytes
            ]
        else:
            np.ndarray(
                (run.count, run.nbytes),
                np.uint8,
                dst,
                run.dst_offset,
                (run.dst_step, 1),
            )[...] = np.ndarray((run.count, run.nbytes), np.uint8, src, run.offset, (run.step, 1))
    return total


def read_runs(
    source: Checkpoint,
    runs,
    shape,
    dtype: str,
    zeros: bool,
    name: str,
    views: SourceViews | None = None,
) -> torch.Tensor:
    """A new CPU tensor of ``shape``/``dtype`` filled by ``runs`` from ``source``'s bytes.
    Through ``views``, a load's ``SourceViews``, where given: then the load counts the bytes
    read (``count_read``) itself, once, rather than per piece."""
    tensor, dst = new_piece(tuple(shape), dtype, zeros)
    if runs:
        copy_runs(dst, runs, views or SourceViews(source), name)
        if views is None:
            count_read(source, runs)
    return tensor


def source_bytes_for(source: Checkpoint, runs) -> dict[int, torch.Tensor]:
    """The bytes of each source ``runs`` copy from, by source index: 1-D uint8 tensors
    (``Checkpoint.source_bytes``), each checked once to be unchanged since it was opened.
    ``SourceViews`` keeps them for a whole load instead, checking them again as it goes."""
    views: dict[int, torch.Tensor] = {}
    for run in runs:
        if run.source not in views:
            views[run.source] = source.source_bytes(run.source)
    return views


def count_read(source: Checkpoint, runs=(), nbytes: int = 0) -> None:
    """Tell ``source`` the bytes ``runs`` read, plus ``nbytes``, where it counts them
    (``count_read``)."""
    count = getattr(source, "count_read", None)
    if count is not None:
        count(sum(run.total for run in runs) + nbytes)


class PageReleases:
    """Mapped pages this process is done with go back in batches.

    Without releases every page a load touched stays charged to the process until the files
    are closed (the whole checkpoint, per process). Releasing after every tensor costs a
    ``madvise`` per tensor, each a TLB shoot-down across every thread of the process, measured
    at 5 to 10% of a load from the page cache. So spans are gathered and given back once
    ``batch_bytes`` of them are pending, merged where they lie within ``SPAN_GAP_BYTES`` of
    each other (tensors lie in storage order): about one call per ``batch_bytes`` of
    checkpoint, and at most that much more held.
    A process hosting ``workers`` of ``num_shards`` workers takes that share of
    ``RELEASE_BATCH_BYTES``, so the whole load holds at most that much more, however many
    processes it spans.
    """

    def __init__(
        self,
        source: Checkpoint,
        batch_bytes: int | None = None,
        *,
        workers: int = 1,
        num_shards: int = 1,
    ):
        self._source = source
        self._batch = (
            RELEASE_BATCH_BYTES * workers // max(1, num_shards)
            if batch_bytes is None
            else batch_bytes
        )
        self._spans: list[tuple[int, int, int]] = []
        self._pending = 0
        self._lock = threading.Lock()
        self.calls = 0  # release calls made (for tests and statistics)

    def add(self, index: int, begin: int, end: int) -> None:
        """Bytes ``[begin, end)`` of source ``index`` are no longer needed here."""
        if end <= begin:
            return
        with self._lock:
            self._spans.append((index, begin, end))
            self._pending += end - begin
            if self._pending < self._batch:
                return
            spans, self._spans, self._pending = self._spans, [], 0
        self._release(spans)

    def add_spans(self, spans: list[tuple[int, int, int]]) -> None:
        """Every ``(source, first, end)`` byte span a worker's batch of pieces copied from
        (``Pieces.spans``), at once, under one taking of the lock."""
        spans = [span for span in spans if span[2] > span[1]]
        if not spans:
            return
        with self._lock:
            self._spans += spans
            self._pending += sum(end - begin for _, begin, end in spans)
            if self._pending < self._batch:
                return
            spans, self._spans, self._pending = self._spans, [], 0
        self._release(spans)

    def flush(self) -> None:
        with self._lock:
            spans, self._spans, self._pending = self._spans, [], 0
        self._release(spans)

    def _release(self, spans: list[tuple[int, int, int]]) -> None:
        merged: list[list[int]] = []
        for index, begin, end in sorted(spans):
            if merged and merged[-1][0] == index and begin - merged[-1][2] < SPAN_GAP_BYTES:
                merged[-1][2] = max(merged[-1][2], end)
            else:
                merged.append([index, begin, end])
        for index, begin, end in merged:
            self._source.release_bytes(index, begin, end)
        self.calls += len(merged)


class Readahead:
    """The file ranges a load is about to copy, asked for a little ahead of the copies.

    From a cold page cache a copy out of a mapping faults its pages in a few at a time, each
    fault a small read; the kernel reads a file far faster in large sequential requests. So a
    thread of the process walks the tensors it will read, in storage order, and asks for each
    window of ``READAHEAD_WINDOW`` bytes (``Checkpoint.prefetch_bytes``: ``MADV_WILLNEED``) once
    the furthest worker is within ``READAHEAD_BYTES`` of it: the reads stay ahead of the
    copies, and at most that much more of the file is brought in than the copies need. Pages
    already cached cost a look-up.
    """

    def __init__(self, source: Checkpoint, spans: list[tuple[str, int, int, int]]):
        self._source = source
        self._position: dict[str, int] = {}  # tensor -> where it starts, in bytes of spans
        self._windows: list[tuple[int, int, int, int]] = []  # (position, source, begin, end)
        at = 0
        position, windows = self._position, self._windows
        last: tuple[int, int, int, int] | None = None  # windows[-1], as it grows
        for name, index, begin, end in spans:
            position.setdefault(name, at)
            if (
                last is not None
                and last[1] == index
                and 0 <= begin - last[3] < SPAN_GAP_BYTES
                and end - last[2] <= READAHEAD_WINDOW
            ):  # most spans: the last window grows
                last = windows[-1] = (last[0], index, last[2], end)
                at += end - begin
                continue
            for start in range(begin, end, READAHEAD_WINDOW):
                stop = min(end, start + READAHEAD_WINDOW)
                if (
                    last is not None
                    and last[1] == index
                    and 0 <= start - last[3] < SPAN_GAP_BYTES
                    and stop - last[2] <= READAHEAD_WINDOW
                ):
                    last = windows[-1] = (last[0], index, last[2], stop)
                else:
                    last = (at + start - begin, index, start, stop)
                    windows.append(last)
            at += end - begin
        self._reached = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> Readahead:
        if self._windows and self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="shardload-readahead", daemon=True
            )
            self._thread.start()
        return self

    def reached(self, name: str) -> None:
        """A worker of this process is about to copy tensor ``name``."""
        at = self._position.get(name)
        if at is None:
            return
        with self._cond:
            if at > self._reached:
                self._reached = at
                self._cond.notify()

    def _loop(self) -> None:
        for at, index, begin, end in self._windows:
            with self._cond:
                while not self._closed and at > self._reached + READAHEAD_BYTES:
                    self._cond.wait(0.5)
                if self._closed:
                    return
            self._source.prefetch_bytes(index, begin, end)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)  # one request in flight at most


def tensor_spans(ckpt: Checkpoint) -> list[tuple[str, int, int, int]]:
    """Every tensor's bytes, in storage order: what the workers of one process read."""
    return [(name, *ckpt.locate(name)) for name in ckpt.metadata()]


def piece_spans(plan: ReadPlan) -> list[tuple[str, int, int, int]]:
    """The extent of each piece's runs in its source: what one worker process reads (each
    kind's extent from its tensor's first byte worked out once)."""
    pieces = plan.pieces
    extents = [
        None
        if kind is None or not kind.tails
        else (
            min(offset for offset, _ in kind.tails),
            max(
                Run(0, offset, nbytes, count, stride).end
                for offset, (nbytes, count, stride, _, _) in kind.tails
            ),
        )
        for kind in pieces.kinds
    ]
    spans = []
    for name, k, source, begin in zip(pieces.names, pieces.kind, pieces.source, pieces.begin):
        extent = extents[k]
        if extent is not None:
            spans.append((name, source, begin + extent[0], begin + extent[1]))
    return spans
