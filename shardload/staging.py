"""The staged path to a device: pieces travel through a small ring of reused host buffers.

A worker whose device is a GPU cannot copy a piece straight out of the mapped checkpoint into
its memory, and a copy from pageable memory (``tensor.to(device)``) is synchronous and goes
through the driver's own bounce buffer. The staged path instead, per worker:

1. allocates a ring of ``Staging.buffers`` host buffers of ``Staging.buffer_mib`` each, once
   per load (pinned where the device is CUDA, so copies are DMA and asynchronous);
2. allocates each piece on the device (zeros where the piece is padding);
3. cuts the piece's byte runs into items that fit a buffer and packs them into the current
   buffer: each item is copied out of the mapping into the buffer (the *read*), then its
   buffer-to-device copy is queued on the device's *link* (a CUDA stream of its own; on the CPU
   a copier thread, which keeps the pipeline's logic testable without a GPU);
4. a full buffer is *sealed* with a marker (a CUDA event); the ring moves on, and before a
   buffer is refilled the worker waits for its marker: reads of the next items overlap the
   copies of the earlier ones, and host memory stays at the ring's size whatever the
   checkpoint's;
5. a piece's fixup runs on the link after its copies (in order, on the device); a chain's input
   is fenced (the worker's stream waits for the link) before its steps run on the device;
6. at the end the link is drained; a failure on the link surfaces on the worker, and ``close``
   always stops the copier and drops the buffers, whatever happened.

The copies never look at the bytes: what lands where is the read plan's (``readplan.Run``).

>>> import torch
>>> from shardload.readplan import Run
>>> src = torch.arange(16, dtype=torch.uint8)
>>> with Pipeline(torch.device("cpu"), Staging(buffers=2, buffer_mib=4 / 2**20)) as pipe:
...     piece = pipe.piece([src], [Run(0, 2, 3, count=2, stride=8)], (6,), "uint8", False, "w")
...     pipe.finish()
>>> piece.tolist()
[2, 3, 4, 10, 11, 12]
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import dtypes
from .errors import ShardloadError, annotate
from .readers.mapped import copy_blocks
from .readplan import Run, check_run
from .sessions.base import Stopped

__all__ = ["Pipeline", "Staging", "StagingStats", "staging_for"]

MiB = 1 << 20
#: items start at multiples of this within a buffer (memcpy and DMA like aligned addresses)
ALIGN = 256
#: bounds on the options: at least double buffering; at most 4 GiB of staging per worker
MIN_BUFFERS, MAX_BUFFERS = 2, 64
MAX_STAGING_BYTES = 4 << 30


@dataclass(frozen=True)
class Staging:
    """How pieces travel to a worker's device: ``buffers`` host buffers of ``buffer_mib`` MiB
    each, reused for the whole load (host memory per worker: their product), ``pinned``
    (page-locked, for asynchronous DMA) by default where the device is CUDA.

    ``load_sharded(..., staging=None)`` (the default) stages for CUDA workers and copies
    straight into host memory for CPU workers (there the staged path would add a copy);
    ``staging=Staging(...)`` stages for every worker, the CPU too (with a copier thread as its
    link: how the tests exercise the pipeline); ``staging=False`` never stages.

    >>> Staging(buffers=4, buffer_mib=32).nbytes // 2**20
    128
    """

    buffers: int = 4
    buffer_mib: float = 32
    pinned: bool | None = None

    def __post_init__(self) -> None:
        if type(self.buffers) is not int or not MIN_BUFFERS <= self.buffers <= MAX_BUFFERS:
            raise ValueError(
                f"Staging(buffers=...) must be an integer from {MIN_BUFFERS} to "
                f"{MAX_BUFFERS}, got {self.buffers!r}"
            )
        if (
            isinstance(self.buffer_mib, bool)
            or not isinstance(self.buffer_mib, (int, float))
            or not math.isfinite(self.buffer_mib)
            or self.buffer_bytes < 1
        ):
            raise ValueError(
                f"Staging(buffer_mib=...) must be a positive number of MiB, got {self.buffer_mib!r}"
            )
        if self.nbytes > MAX_STAGING_BYTES:
            raise ValueError(
                f"Staging: {self.buffers} buffers of {self.buffer_mib} MiB is "
                f"{self.nbytes / MiB:g} MiB per worker; at most "
                f"{MAX_STAGING_BYTES // MiB} MiB"
            )
        if self.pinned not in (None, True, False):
            raise ValueError(
                f"Staging(pinned=...) must be None, True or False, got {self.pinned!r}"
            )

    @property
    def buffer_bytes(self) -> int:
        return int(self.buffer_mib * MiB)

    @property
    def nbytes(self) -> int:
        """Host memory the ring takes per worker."""
        return self.buffers * self.buffer_bytes

    def pinned_for(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.pinned is None else self.pinned

    def to_json(self) -> dict:
        return {"buffers": self.buffers, "buffer_mib": self.buffer_mib, "pinned": self.pinned}

    @classmethod
    def from_json(cls, data: dict) -> Staging:
        return cls(int(data["buffers"]), float(data["buffer_mib"]), data.get("pinned"))


def staging_for(staging, devices: Sequence[torch.device]) -> Staging | None:
    """The ``Staging`` a load with ``staging=`` (None, True, False or a ``Staging``) uses on
    workers ``devices``, or None for the direct path."""
    if staging is None:
        return Staging() if any(d.type == "cuda" for d in devices) else None
    if staging is True:
        return Staging()
    if staging is False:
        return None
    if isinstance(staging, Staging):
        return staging
    raise TypeError(
        f"staging must be None, True, False or a shardload.Staging, got {type(staging).__name__}"
    )


@dataclass
class StagingStats:
    """What one worker's pipeline did: bytes through the buffers, buffers sealed, and how often
    (and how long) the reads waited for a buffer's copies to finish."""

    buffers: int
    buffer_bytes: int
    pinned: bool
    bytes_staged: int = 0
    items: int = 0
    seals: int = 0
    waits: int = 0
    wait_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ---- links: the ordered copy engines -------------------------------------------------------------


class _CudaLink:
    """A CUDA stream of the worker's own: work queued on it runs in order, asynchronously."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def enqueue(self, op: Callable[[], object], what: str) -> None:
        with torch.cuda.stream(self.stream):
            try:
                op()  # launches asynchronous copies or kernels on the stream
            except Exception as exc:
                annotate(exc, what)
                raise

    def after_allocation(self) -> None:
        """A piece allocated (or zeroed) on the worker's stream is written on the link's: the
        link waits for what the worker's stream queued before."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def marker(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, marker: torch.cuda.Event, stop: Callable[[], bool]) -> None:
        marker.synchronize()  # one buffer's copy: about a millisecond

    def fence(self) -> None:
        """The worker's stream waits for everything queued on the link (no host wait)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def drain(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        try:
            self.stream.synchronize()  # no DMA may still read a buffer about to be freed
        except RuntimeError:
            pass  # a failed device: nothing more can be done here


class _HostLink:
    """The CPU's link: a copier thread runs queued work in order, as a stream would; a marker
    is an event set when the copier reaches it. A failure on the copier is kept and raised on
    the worker at its next call; work queued after it is skipped."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"shardload-link-{name}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            op, what = job
            if isinstance(op, threading.Event):
                op.set()
                continue
            if self._error is not None:
                continue
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 (kept and raised on the worker)
                annotate(exc, what)
                self._error = exc

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def enqueue(self, op: Callable[[], object], what: str) -> None:
        self._raise()
        self._queue.put((op, what))

    def after_allocation(self) -> None:
        pass

    def marker(self) -> threading.Event:
        event = threading.Event()
        self._queue.put((event, ""))
        return event

    def wait(self, marker: threading.Event, stop: Callable[[], bool]) -> None:
        while not marker.wait(0.05):
            if stop():
                raise Stopped()
        self._raise()

    def fence(self) -> None:
        self.wait(self.marker(), lambda: False)

    def drain(self) -> None:
        self.fence()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


# ---- the pipeline --------------------------------------------------------------------------------


def _items(run: Run, limit: int) -> Iterator[Run]:
    """``run`` cut into runs of at most ``limit`` bytes each: whole blocks where a block fits,
    else pieces of one block."""
    if run.nbytes <= limit:
        per = max(1, limit // run.nbytes)
        for k in range(0, run.count, per):
            count = min(per, run.count - k)
            yield Run(
                run.source,
                run.offset + k * run.stride,
                run.nbytes,
                count,
                run.stride,
                run.dst_offset + k * run.dst_stride,
                run.dst_stride,
            )
        return
    for k in range(run.count):
        src, dst = run.offset + k * run.stride, run.dst_offset + k * run.dst_stride
        for at in range(0, run.nbytes, limit):
            yield Run(run.source, src + at, min(limit, run.nbytes - at), 1, 0, dst + at, 0)


def _blocks(data: torch.Tensor, offset: int, nbytes: int, count: int, stride: int) -> torch.Tensor:
    """``count`` blocks of ``nbytes`` bytes of the 1-D uint8 ``data``, ``stride`` apart from
    ``offset``, as a ``(count, nbytes)`` view."""
    return data.as_strided((count, nbytes), (stride or nbytes, 1), data.storage_offset() + offset)


class Pipeline:
    """One worker's staged path to ``device`` (see the module docstring). Use it as a context
    manager: ``close`` stops the link and frees the ring whatever happened.

    ``stop()`` says when to give up waiting (another worker failed, Ctrl-C); ``waiting()`` is
    called while the worker waits on a buffer (it is alive, for the watchdog).
    """

    def __init__(
        self,
        device: torch.device,
        staging: Staging,
        stop: Callable[[], bool] = lambda: False,
        waiting: Callable[[], None] = lambda: None,
    ):
        self.device = device
        self.staging = staging
        self._stop, self._waiting = stop, waiting
        pinned = staging.pinned_for(device)
        if pinned and not torch.cuda.is_available():
            raise ShardloadError(
                "Staging(pinned=True) needs CUDA (page-locked memory is "
                "registered with the CUDA driver); this machine has none: use "
                "pinned=None"
            )
        self.stats = StagingStats(staging.buffers, staging.buffer_bytes, pinned)
        self._link: _CudaLink | _HostLink | None = (
            _CudaLink(device) if device.type == "cuda" else _HostLink(str(device))
        )
        try:
            self._ring = [
                torch.empty(staging.buffer_bytes, dtype=torch.uint8, pin_memory=pinned)
                for _ in range(staging.buffers)
            ]
        except BaseException:
            self._link.close()
            raise
        self._pending: list = [None] * staging.buffers
        self._current = 0
        self._used = 0

    @property
    def _open_link(self) -> _CudaLink | _HostLink:
        if self._link is None:
            raise ShardloadError("the staging pipeline is closed")
        return self._link

    # -- the ring

    def _seal(self) -> None:
        """The current buffer is done: mark it, move on to the next."""
        if self._used:
            self._pending[self._current] = self._open_link.marker()
            self.stats.seals += 1
            self._current = (self._current + 1) % len(self._ring)
            self._used = 0

    def _room(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the current buffer to fill, sealing it first if they do not fit and
        waiting for a buffer's last copies before refilling it."""
        if self._used + nbytes > self.staging.buffer_bytes:
            self._seal()
        if self._used == 0 and self._pending[self._current] is not None:
            marker, self._pending[self._current] = self._pending[self._current], None
            start = time.perf_counter()
            self._waiting()
            self._open_link.wait(marker, self._stop)
            self.stats.waits += 1
            self.stats.wait_seconds += time.perf_counter() - start
        buf = self._ring[self._current][self._used : self._used + nbytes]
        self._used = min(self.staging.buffer_bytes, -(-(self._used + nbytes) // ALIGN) * ALIGN)
        return buf

    # -- pieces

    def piece(
        self,
        sources: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
        runs: Sequence[Run],
        shape,
        dtype: str,
        zeros: bool,
        name: str,
        fixup: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """A new tensor of ``shape``/``dtype`` on the device, filled by ``runs`` from
        ``sources`` (1-D uint8 tensors by source index: the mapped files) through the ring,
        zeros elsewhere if ``zeros``; ``fixup(tensor)`` runs on the link after its copies. The
        copies may still be in flight when this returns: ``fence`` or ``finish`` before reading
        it."""
        out = (torch.zeros if zeros else torch.empty)(
            tuple(shape), dtype=dtypes.to_torch(dtype), device=self.device
        )
        self._open_link.after_allocation()
        flat = out.view(-1).view(torch.uint8) if out.dim() else out.reshape(1).view(torch.uint8)
        limit = self.staging.buffer_bytes
        what = f"parameter {name!r}: copying to {self.device}"
        for run in runs:
            src = sources[run.source]
            check_run(run, src.numel(), flat.numel(), name)
            for item in _items(run, limit):
                total = item.total
                buf = self._room(total)
                staged = buf.view(item.count, item.nbytes)
                # the read: out of the mapping into the buffer (a parallel copy in torch)
                copy_blocks(
                    staged.view(item.count, item.nbytes, 1),
                    _blocks(src, item.offset, item.nbytes, item.count, item.stride).view(
                        item.count, item.nbytes, 1
                    ),
                )
                dst = (
                    flat[item.dst_offset : item.dst_offset + total].view(item.count, item.nbytes)
                    if item.count == 1 or item.dst_stride == item.nbytes
                    else _blocks(flat, item.dst_offset, item.nbytes, item.count, item.dst_stride)
                )
                self._open_link.enqueue(
                    functools.partial(dst.copy_, staged, non_blocking=True), what
                )
                self.stats.items += 1
                self.stats.bytes_staged += total
        if fixup is not None:
            self._open_link.enqueue(lambda: fixup(out), f"parameter {name!r}, its fixup")
        return out

    def fence(self) -> None:
        """Make everything queued so far visible to work the worker issues next (a chain's
        steps, another worker's device-to-device copy)."""
        self._open_link.fence()

    def finish(self) -> None:
        """Wait until every queued copy (and, on CUDA, the worker's stream) is done; raise the
        link's failure if it had one. The pipeline stays usable."""
        self._seal()
        self._open_link.drain()

    def close(self) -> None:
        """Stop the link and drop the ring (idempotent)."""
        link, self._link = self._link, None
        if link is not None:
            link.close()
        self._ring = []
        self._pending = []

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
