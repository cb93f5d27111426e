"""The per-worker load: carry out one worker's ``ReadPlan``, keeping its pieces on its device.

This runs on the worker (a thread, a worker process, a torchrun rank) as the session function
``shardload.load_pieces``; the loader sends each worker its read plan and nothing else. For each
piece, in storage order:

1. **read**: copy the plan's byte runs out of the source (a mapped file) into a new tensor
   (zeros where the piece is padding), apply the fixup if any;
2. **compute**: read the whole stored tensor, run the chain of shard functions on it, keep
   ``output[index]``. Workers that share this process (threads) compute each chain once and
   share it: the first to need it computes it, at most ``MAX_SHARED`` such outputs are alive at
   once (the staging bound: about two of the largest parameters), each dropped once all its
   workers took their piece;
3. place the piece on the worker's device, owning its memory, and report progress.

With ``staging`` (the default for CUDA workers) reads go through the worker's ``Pipeline``
(``staging.py``): byte runs land in a ring of host buffers and are copied from there to the
device asynchronously; a replicated tensor is staged once per process and copied
device-to-device to the others, and a chain's input is staged once and its steps run on the
device. Without it, a piece is read into host memory and moved (the CPU's path: one copy).
Mapped pages go back to the kernel in batches once every local worker is done with them
(``PageReleases``), and are asked for a little ahead of the copies (``Readahead``).

A worker in the loader's own process uses the checkpoint the loader opened (``LocalLoad``);
a worker process maps the files the read plan names, checking each is still the file the
loader opened. Either way nothing is parsed or validated here beyond the bounds of each copy.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import dtypes
from .errors import ShardloadError, annotate
from .readers.base import Checkpoint, copy_progress
from .readplan import PieceRead, ReadPlan, Run, check_run
from .registry import ShardFunc, get_shard_func, load_plugins
from .sessions import Stopped, WorkerContext, register_session_func
from .staging import Pipeline, Staging

__all__ = ["LOAD_PIECES", "FETCH_PIECE", "RELEASE_LOADS", "MAX_SHARED", "LocalLoad",
           "SharedOutputs", "PageReleases", "run_steps", "read_runs", "read_piece",
           "source_views", "load_pieces"]

LOAD_PIECES = "shardload.load_pieces"
FETCH_PIECE = "shardload.fetch_piece"
RELEASE_LOADS = "shardload.release_loads"

#: chains whose full output may be alive at once in one process (the staging bound)
MAX_SHARED = 2
#: mapped pages go back to the kernel once this many bytes of them are done with (PageReleases)
RELEASE_BATCH_BYTES = 256 << 20
#: the read-ahead asks for the file in windows of this size, this far ahead of the copies
READAHEAD_WINDOW = 32 << 20
READAHEAD_BYTES = 256 << 20


# ---- running a chain of steps --------------------------------------------------------------------

def _as_array(tensor: torch.Tensor, kind: str):
    if kind == "torch":
        return tensor
    if kind == "numpy":
        return tensor.numpy()  # zero-copy; CPU only
    import cupy  # optional dependency, only for cupy shard functions

    return cupy.from_dlpack(tensor)


def _call(func: ShardFunc, x: torch.Tensor, extra: tuple, out: torch.Tensor) -> None:
    if func.array == "numpy" and x.device.type != "cpu":
        x = x.cpu()
    if func.array == "numpy" and out.device.type != "cpu":
        host = torch.empty_like(out, device="cpu")
        func.func(_as_array(x, "numpy"), *extra, _as_array(host, "numpy"))
        out.copy_(host)
        return
    if func.array == "cupy" and (x.device.type != "cuda" or out.device.type != "cuda"):
        raise ShardloadError(f"{func.name} takes cupy arrays, which need a CUDA device; "
                             f"this worker's device is {out.device}")
    func.func(_as_array(x, func.array), *extra, _as_array(out, func.array))


def run_steps(steps, x: torch.Tensor, name: str = "?") -> torch.Tensor:
    """Apply ``steps`` (``(func, out_shape, dtype, extra)`` each) to ``x``; the last output.

    >>> x = torch.arange(4)
    >>> run_steps([("shardload.split", (2, 2), "int64", (0,))], x).tolist()
    [[0, 1], [2, 3]]
    """
    for index, (func_name, out_shape, dtype, extra) in enumerate(steps):
        func = get_shard_func(func_name)
        out = torch.empty(tuple(out_shape), dtype=dtypes.to_torch(dtype), device=x.device)
        try:
            _call(func, x.contiguous(), tuple(extra), out)
        except Exception as exc:
            annotate(exc, f"parameter {name!r}, step {index} ({func_name})")
            raise
        x = out
    return x


# ---- copying runs --------------------------------------------------------------------------------

def _copy_run(dst: torch.Tensor, src: torch.Tensor, run: Run) -> None:
    """One strided copy, in pieces that report progress when a hook is set (``copy_progress``)."""
    from .readers.mapped import copy_blocks

    # as_strided counts offsets from the start of the storage, not of the view
    s = src.as_strided((run.count, run.nbytes, 1), (run.stride or run.nbytes, 1, 1),
                       src.storage_offset() + run.offset)
    d = dst.as_strided((run.count, run.nbytes, 1), (run.dst_stride or run.nbytes, 1, 1),
                       dst.storage_offset() + run.dst_offset)
    copy_blocks(d, s)


def read_runs(source: Checkpoint, runs, shape, dtype: str, zeros: bool, name: str
              ) -> torch.Tensor:
    """A new CPU tensor of ``shape``/``dtype`` filled by ``runs`` from ``source``'s bytes."""
    torch_dtype = dtypes.to_torch(dtype)
    out = (torch.zeros if zeros else torch.empty)(tuple(shape), dtype=torch_dtype)
    if not runs:
        return out
    flat = out.view(-1).view(torch.uint8) if out.dim() else out.reshape(1).view(torch.uint8)
    views = source_views(source, runs)
    for run in runs:
        src = views[run.source]
        check_run(run, src.numel(), flat.numel(), name)
        _copy_run(flat, src, run)
    _count_read(source, runs)
    return out


def source_views(source: Checkpoint, runs) -> dict[int, torch.Tensor]:
    """The byte sources ``runs`` copy from, each as a 1-D uint8 view (each checked, once, to
    be unchanged since it was opened)."""
    views: dict[int, torch.Tensor] = {}
    for run in runs:
        if run.source not in views:
            views[run.source] = source.source_bytes(run.source)
    return views


def _count_read(source: Checkpoint, runs) -> None:
    count = getattr(source, "count_read", None)
    if count is not None:
        count(sum(run.total for run in runs))


class PageReleases:
    """Mapped pages this process is done with go back in batches.

    Without releases every page a load touched stays charged to the process until the files
    are closed (the whole checkpoint, per process). Releasing after every tensor costs a
    ``madvise`` per tensor, each a TLB shoot-down across every thread of the process, measured
    at 5 to 10% of a load from the page cache. So spans are gathered and given back once
    ``batch_bytes`` of them are pending, merged where they touch (tensors lie in storage
    order): about one call per ``batch_bytes`` of checkpoint, and at most that much more held.
    A process hosting ``workers`` of ``num_shards`` workers takes that share of
    ``RELEASE_BATCH_BYTES``, so the whole load holds at most that much more, however many
    processes it spans.
    """

    def __init__(self, source: Checkpoint, batch_bytes: Optional[int] = None, *,
                 workers: int = 1, num_shards: int = 1):
        self._source = source
        self._batch = (RELEASE_BATCH_BYTES * workers // max(1, num_shards)
                       if batch_bytes is None else batch_bytes)
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

    def add_runs(self, runs) -> None:
        """Every byte span ``runs`` copied from (first to last byte of each run)."""
        for run in runs:
            self.add(run.source, run.offset,
                     run.offset + (run.count - 1) * run.stride + run.nbytes)

    def flush(self) -> None:
        with self._lock:
            spans, self._spans, self._pending = self._spans, [], 0
        self._release(spans)

    def _release(self, spans: list[tuple[int, int, int]]) -> None:
        merged: list[list[int]] = []
        for index, begin, end in sorted(spans):
            if merged and merged[-1][0] == index and begin <= merged[-1][2]:
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
        self._position: dict[str, int] = {}   # tensor -> where it starts, in bytes of spans
        self._windows: list[tuple[int, int, int, int]] = []  # (position, source, begin, end)
        at = 0
        for name, index, begin, end in spans:
            self._position.setdefault(name, at)
            for start in range(begin, end, READAHEAD_WINDOW):
                stop = min(end, start + READAHEAD_WINDOW)
                last = self._windows[-1] if self._windows else None
                if last and last[1] == index and last[3] == start and \
                        stop - last[2] <= READAHEAD_WINDOW:
                    self._windows[-1] = (last[0], index, last[2], stop)
                else:
                    self._windows.append((at + start - begin, index, start, stop))
            at += end - begin
        self._reached = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Readahead":
        if self._windows and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shardload-readahead",
                                            daemon=True)
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


def _tensor_spans(ckpt: Checkpoint) -> list[tuple[str, int, int, int]]:
    """Every tensor's bytes, in storage order: what the workers of one process read."""
    return [(name, *ckpt.locate(name)) for name in ckpt.metadata()]


def _piece_spans(plan: ReadPlan) -> list[tuple[str, int, int, int]]:
    """The extent of each piece's runs in its source: what one worker process reads."""
    spans = []
    for piece in plan.pieces:
        if piece.runs:
            run = piece.runs[0]
            begin = min(r.offset for r in piece.runs)
            end = max(r.offset + (r.count - 1) * r.stride + r.nbytes for r in piece.runs)
            spans.append((piece.name, run.source, begin, end))
    return spans


# ---- workers of one process share computed chains ------------------------------------------------

@dataclass
class _Cell:
    value: Optional[torch.Tensor] = None
    failed: bool = False
    ready: bool = False
    taken: int = 0


class SharedOutputs:
    """Full outputs of chains, computed once and shared by the workers of a process.

    The first worker to reach a parameter computes it; the others wait for it. A cell is dropped
    when all its workers have taken their piece, and a new one is opened only while fewer than
    ``MAX_SHARED`` are alive. No deadlock: a worker holds no cell while it waits for a slot, and
    only the worker furthest ahead ever opens one, so the workers behind it, who free the
    slots, never wait on it.
    """

    def __init__(self, num_workers: int, stop: Callable[[], bool]):
        self._n = num_workers
        self._stop = stop
        self._cond = threading.Condition()
        self._cells: dict[str, _Cell] = {}

    def take(self, name: str, compute: Callable[[], torch.Tensor],
             waiting: Callable[[], None]) -> tuple[torch.Tensor, bool]:
        """The full output for ``name`` and whether this call computed it. ``waiting()`` is
        called while this worker waits on another (a worker waiting on a stuck one is alive)."""
        with self._cond:
            while True:
                self._check_stop()
                cell = self._cells.get(name)
                if cell is not None or len(self._cells) < MAX_SHARED:
                    break
                waiting()
                self._cond.wait(0.1)
            owner = cell is None
            if owner:
                cell = self._cells[name] = _Cell()
        if owner:
            try:
                cell.value = compute()
            except BaseException:
                cell.failed = True
                raise
            finally:
                with self._cond:
                    cell.ready = True
                    self._cond.notify_all()
            return cell.value, True
        with self._cond:
            while not cell.ready:
                self._check_stop()
                waiting()
                self._cond.wait(0.1)
        if cell.failed:
            raise Stopped()  # the owner reports the failure; this worker stops quietly
        return cell.value, False

    def release(self, name: str) -> None:
        with self._cond:
            cell = self._cells.get(name)
            if cell is None:
                return
            cell.taken += 1
            if cell.taken == self._n:
                del self._cells[name]
                self._cond.notify_all()

    def _check_stop(self) -> None:
        if self._stop():
            raise Stopped()


# ---- loads the loader runs in its own process ----------------------------------------------------

@dataclass
class LocalLoad:
    """A load whose workers (some or all) run in the loader's process: they read from the
    checkpoint the loader opened, share computed chains, and leave their pieces here for the
    loader to return."""

    ckpt: Checkpoint
    num_local: int
    num_shards: int
    shards: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    stopped: threading.Event = field(default_factory=threading.Event)
    _done: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.shared = SharedOutputs(self.num_local, self.stopped.is_set)
        self.releases = PageReleases(self.ckpt, workers=self.num_local,
                                     num_shards=self.num_shards)
        self.readahead = Readahead(self.ckpt, _tensor_spans(self.ckpt))

    def finished(self, piece: PieceRead) -> None:
        """The mapped pages of a tensor go back (in a batch) once every local worker has its
        piece."""
        with self._lock:
            self._done[piece.name] = count = self._done.get(piece.name, 0) + 1
        if count == self.num_local:  # the whole tensor: each worker touched its own part of it
            self.releases.add(*self.ckpt.locate(piece.name))


_counter = itertools.count()
_local: dict[str, LocalLoad] = {}


@contextlib.contextmanager
def local_load(ckpt: Checkpoint, num_local: int, num_shards: int):
    """Register a load of ``num_local`` of the ``num_shards`` workers in this process for its
    duration; yields ``(token, LocalLoad)``."""
    token = f"{os.getpid()}-{next(_counter)}"
    load = _local[token] = LocalLoad(ckpt, num_local, num_shards)
    load.readahead.start()
    try:
        yield token, load
    except BaseException:
        load.stopped.set()  # Ctrl-C or a failure: threads still running stop at their next piece
        raise
    finally:
        _local.pop(token, None)
        load.readahead.close()
        load.releases.flush()


# ---- the session functions -----------------------------------------------------------------------

def _place(tensor: torch.Tensor, device: torch.device, owned: bool) -> torch.Tensor:
    """``tensor`` on ``device``, owning its memory; no copy when it already does."""
    if tensor.device == device and owned and tensor.is_contiguous():
        return tensor
    if tensor.device == device:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to(device, copy=True).contiguous()


def _fixup(piece: PieceRead, num_shards: int, rank: int
           ) -> Optional[Callable[[torch.Tensor], None]]:
    """The piece's fixup as ``fix(tensor)``, or None."""
    if piece.fixup is None:
        return None
    fixup = piece.fixup
    fix = get_shard_func(fixup.func).fixup

    def apply(tensor: torch.Tensor) -> None:
        try:
            fix(tensor, *fixup.extra, num_shards=num_shards, index=rank)
        except Exception as exc:
            annotate(exc, f"parameter {piece.name!r}, fixup of {fixup.func}")
            raise

    return apply


def read_piece(source: Checkpoint, piece: PieceRead, num_shards: int, rank: int
               ) -> torch.Tensor:
    """Worker ``rank``'s piece, read by its byte runs (a piece without a chain), fixed up, as
    a new CPU tensor."""
    tensor = read_runs(source, piece.runs, piece.shape, piece.dtype, piece.zeros, piece.name)
    fix = _fixup(piece, num_shards, rank)
    if fix is not None:
        fix(tensor)
    return tensor


@dataclass
class _Worker:
    """What one worker's load works with: where it reads, its device, the pipeline to it (None:
    the direct path), the chains and replicated tensors it shares with the workers of its
    process (None: it is alone), and its liveness hook."""

    source: Checkpoint
    num_shards: int
    rank: int
    device: torch.device
    pipe: Optional[Pipeline]
    shared: Optional[SharedOutputs]
    waiting: Callable[[], None]
    stopped: Callable[[], bool]

    def fill(self, runs, shape, dtype: str, zeros: bool, name: str,
             fixup: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """A new tensor on the device (staged) or on the host (direct), filled by ``runs``."""
        if self.pipe is None:
            tensor = read_runs(self.source, runs, shape, dtype, zeros, name)
            if fixup is not None:
                fixup(tensor)
            return tensor
        tensor = self.pipe.piece(source_views(self.source, runs), runs, shape, dtype, zeros,
                                 name, fixup)
        _count_read(self.source, runs)
        return tensor

    def share(self, name: str, make: Callable[[], torch.Tensor]
              ) -> tuple[torch.Tensor, bool]:
        """``make()``'s tensor, made once by the first worker of this process to ask and
        shared with the others; whether this worker made it."""
        if self.shared is None:
            return make(), True
        try:
            return self.shared.take(name, make, self.waiting)
        except Stopped:
            # the worker making it failed and reports it: this one stops once the session has
            # heard of that failure, so its own stop is never taken for the first failure
            deadline = time.monotonic() + 5
            while not self.stopped() and time.monotonic() < deadline:
                time.sleep(0.002)
            raise
        finally:
            self.shared.release(name)


def _piece(w: _Worker, piece: PieceRead) -> tuple[torch.Tensor, int]:
    """The worker's piece on its device and the checkpoint bytes it read for it.

    Direct: read into host memory, then placed on the device. Staged: read through the
    pipeline straight into device memory; a replicated tensor is staged once per process and
    copied device-to-device to the other workers; a chain's input is staged once per process
    and its steps run on that worker's device.
    """
    chain = piece.chain
    if chain is None and not (piece.shared and w.pipe is not None and w.shared is not None):
        tensor = w.fill(piece.runs, piece.shape, piece.dtype, piece.zeros, piece.name,
                        _fixup(piece, w.num_shards, w.rank))
        return _place(tensor, w.device, owned=True), piece.bytes_read

    if chain is None:  # staged, replicated, shared by several workers of this process
        def stage() -> torch.Tensor:
            tensor = w.fill(piece.runs, piece.shape, piece.dtype, False, piece.name)
            # the others copy from it next, from their own threads onto their own devices:
            # it must have landed, not merely be ordered on this worker's streams
            w.pipe.finish()
            return tensor

        whole, made = w.share(piece.name, stage)
        return (whole if made else _place(whole, w.device, owned=False)), \
            piece.bytes_read if made else 0

    def compute() -> torch.Tensor:
        x = w.fill(piece.runs, chain.shape, chain.dtype, False, piece.name)
        if w.pipe is not None:
            w.pipe.fence()  # the steps run on the device, after the input's copies
        elif w.device.type != "cpu":
            x = x.to(w.device)
        out = run_steps(chain.runnable(), x, piece.name)
        if w.pipe is not None and w.shared is not None:
            w.pipe.finish()  # as for a shared replicated tensor: landed before it is shared
        return out

    full, computed = w.share(piece.name, compute)
    return _place(full[chain.index], w.device, owned=False), \
        piece.bytes_read if computed else 0


@register_session_func(LOAD_PIECES)
def load_pieces(ctx: WorkerContext, request: dict) -> dict:
    """Carry out ``request["plan"]`` (a ``ReadPlan`` as JSON) on this worker.

    ``request["load"]`` names the load; ``request["modules"]`` lists plugin modules that define
    shard functions the plan computes with; ``request["staging"]`` (a ``Staging`` as JSON, or
    absent) sends the pieces through the staged pipeline. The pieces become ``ctx.shards`` (the
    worker's model); a worker outside the loader's process keeps them for ``fetch_piece`` until
    ``release_loads``. Returns statistics.
    """
    start = time.perf_counter()
    plan = ReadPlan.from_json(request["plan"])
    load_plugins(request.get("modules", ()))
    local = _local.get(request["load"])
    source = local.ckpt if local is not None else None
    staging = request.get("staging")
    kept: dict[str, torch.Tensor] = {}
    read = 0

    def stopped() -> bool:
        return ctx.should_stop() or (local is not None and local.stopped.is_set())

    with contextlib.ExitStack() as stack:
        if source is None:
            from .readers.mapped import open_sources

            source = open_sources(list(plan.sources))
            stack.callback(source.close)
        if local is not None:
            releases, readahead = local.releases, local.readahead
        else:
            releases = PageReleases(source, num_shards=plan.num_shards)
            readahead = Readahead(source, _piece_spans(plan))
            stack.callback(readahead.start().close)
        current = [None]
        waiting = lambda: ctx.progress(where=current[0])  # noqa: E731
        pipe = None
        if staging is not None:
            pipe = stack.enter_context(Pipeline(ctx.device, Staging.from_json(staging),
                                                stopped, waiting))
        shared = local.shared if local is not None and local.num_local > 1 else None
        worker = _Worker(source, plan.num_shards, plan.rank, ctx.device, pipe, shared, waiting,
                         stopped)
        for piece in plan.pieces:
            if stopped():
                raise Stopped()
            current[0] = piece.name
            readahead.reached(piece.name)
            ctx.progress(where=piece.name)
            # a large tensor's copy reports progress too, so a slow read is not taken for a hang
            with copy_progress(waiting):
                tensor, nread = _piece(worker, piece)
            kept[piece.name] = tensor
            read += nread
            if local is not None:
                local.finished(piece)
            else:
                releases.add_runs(piece.runs)
            ctx.progress(nbytes=piece.nbytes)
        if pipe is not None:
            pipe.finish()  # every copy landed before the load is reported done
        if local is None:
            releases.flush()
    ctx.shards = kept  # the latest load is the worker's model, for session functions
    if local is not None:
        local.shards[plan.rank] = kept  # the loader returns them itself
    else:  # kept here until the loader says its result was dropped (release_loads)
        ctx.values.setdefault(LOAD_PIECES, {})[request["load"]] = kept
    reply = {"bytes": sum(t.numel() * t.element_size() for t in kept.values()),
             "tensors": len(kept), "bytes_read": read, "seconds": time.perf_counter() - start}
    if pipe is not None:
        reply["staging"] = pipe.stats.as_dict()
    return reply


@register_session_func(FETCH_PIECE)
def fetch_piece(ctx: WorkerContext, load: str, name: str) -> torch.Tensor:
    """This worker's piece ``name`` of load ``load``."""
    return ctx.values[LOAD_PIECES][load][name]


@register_session_func(RELEASE_LOADS)
def release_loads(ctx: WorkerContext, loads: list) -> None:
    """Forget the pieces of ``loads`` (their results were dropped); ``ctx.shards``, the latest
    load, stays the worker's model."""
    table = ctx.values.get(LOAD_PIECES, {})
    for load in loads:
        table.pop(load, None)
