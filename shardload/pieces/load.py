"""The session functions of a load: ``shardload.load_pieces`` carries out one worker's read plan,
``shardload.fetch_piece`` hands a kept piece to the loader, ``shardload.release_loads`` forgets
the pieces of results that were dropped.

For each piece of the read plan, in storage order, the worker reads it by its byte runs (zeros
where the piece is padding; its fixup applied), or computes it (the whole stored tensor through
its chain, ``chains``; shared by the workers of this process, ``sharing``), then places it on
its device, owning its memory, and reports progress. With ``staging`` the reads go through the
worker's ``Pipeline`` (``staging.py``) straight into device memory.

A load of a large mixture of experts is hundreds of thousands of pieces per worker, most of
them one small run each: the loop (``_read_all``) reads those inline and does its bookkeeping
in batches (``_Books``), so that what a piece costs is little more than making its tensor.
"""

from __future__ import annotations

import contextlib
import math
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import dtypes
from ..errors import annotate
from ..gc_pause import gc_paused
from ..readers.base import COPY_CHUNK_BYTES, Checkpoint, copy_progress
from ..readplan import Kind, PieceRead, Pieces
from ..registry import get_shard_func, load_plugins
from ..sessions import Stopped, WorkerContext, register_session_func
from ..shared_outputs import SharedOutputs
from ..staging import Pipeline, Staging
from . import wire
from .chains import run_steps
from .reads import (
    CHECK_INTERVAL_S,
    SMALL_RUN_BYTES,
    PageReleases,
    Readahead,
    SourceViews,
    copy_runs,
    count_read,
    new_piece,
    piece_spans,
    read_runs,
    source_bytes_for,
)
from .sharing import local_for
from .stream import worker_side

__all__ = [
    "FETCH_PIECE",
    "LOAD_PIECES",
    "RELEASE_LOADS",
    "fetch_piece",
    "load_pieces",
    "read_piece",
    "release_loads",
]

LOAD_PIECES = "shardload.load_pieces"
FETCH_PIECE = "shardload.fetch_piece"
RELEASE_LOADS = "shardload.release_loads"


def _place(tensor: torch.Tensor, device: torch.device, owned: bool) -> torch.Tensor:
    """``tensor`` on ``device``, owning its memory; no copy when it already does."""
    if tensor.device == device and owned and tensor.is_contiguous():
        return tensor
    if tensor.device == device:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to(device, copy=True).contiguous()


def _fixup(piece: PieceRead, num_shards: int, rank: int) -> Callable[[torch.Tensor], None] | None:
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


def read_piece(source: Checkpoint, piece: PieceRead, num_shards: int, rank: int) -> torch.Tensor:
    """Worker ``rank``'s piece, read by its byte runs (a piece without a chain), fixed up, as
    a new CPU tensor."""
    views = SourceViews(source)
    tensor, _ = read_host(piece, views, num_shards, rank)
    count_read(source, piece.runs)
    return tensor


#: ``wait(unit, name)``: wait until a unit of the load's stream of object bytes is fetched
WaitForUnit = Callable[[int, str], None]


def read_host(
    piece: PieceRead,
    views: SourceViews,
    num_shards: int,
    rank: int,
    waiting: Callable[[], None] | None = None,
    parts=None,
    wait: WaitForUnit | None = None,
) -> tuple[torch.Tensor, int]:
    """The one read of a piece without a chain into host memory: a new tensor that owns its
    memory, filled by the piece's runs and fixed up; and the checkpoint bytes copied. A load
    reads most pieces this way, so it is kept to the fewest calls.

    ``parts``: the piece's runs by unit of a stream of object bytes (``Consumer.parts``), each
    copied once ``wait(unit, name)`` returns, so that the copy of the first parts overlaps the
    fetch of the rest. ``waiting``: called while a large copy goes on (``copy_progress``)."""
    tensor, dst = new_piece(piece.shape, piece.dtype, piece.zeros)
    if parts is not None:
        nread = 0
        with copy_progress(waiting):
            for unit, runs in parts:
                wait(unit, piece.name)
                nread += copy_runs(dst, runs, views, piece.name)
    elif waiting is not None and piece.nbytes > COPY_CHUNK_BYTES:
        with copy_progress(waiting):  # a long copy reports progress too
            nread = copy_runs(dst, piece.runs, views, piece.name)
    else:
        nread = copy_runs(dst, piece.runs, views, piece.name)
    if piece.fixup is not None:
        _fixup(piece, num_shards, rank)(tensor)
    return tensor, nread


@dataclass
class _Worker:
    """What one worker's load works with: where it reads, its device, the pipeline to it (None:
    the direct path), the chains and replicated tensors it shares with the workers of its
    process (None: it is alone), and its liveness hook."""

    source: Checkpoint
    num_shards: int
    rank: int
    device: torch.device
    pipe: Pipeline | None
    shared: SharedOutputs | None
    waiting: Callable[[], None]
    stopped: Callable[[], bool]
    views: SourceViews | None = None

    def fill(
        self,
        runs,
        shape,
        dtype: str,
        zeros: bool,
        name: str,
        fixup: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """A new tensor on the device (staged) or on the host (direct), filled by ``runs``: a
        chain's input, or a replicated piece staged once for the workers of a process; the
        load counts the bytes read (``count_read``) once it is done."""
        if self.pipe is None:
            tensor = read_runs(self.source, runs, shape, dtype, zeros, name, self.views)
            if fixup is not None:
                fixup(tensor)
            return tensor
        return self.pipe.piece(
            source_bytes_for(self.source, runs), runs, shape, dtype, zeros, name, fixup
        )

    def share(self, name: str, make: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool]:
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
    if chain is None and w.pipe is None:
        tensor, nread = read_host(piece, w.views, w.num_shards, w.rank, w.waiting)
        if w.device.type == "cpu":
            return tensor, nread  # read_host made it: new, owned, contiguous
        return _place(tensor, w.device, owned=True), nread
    if chain is None and not (piece.shared and w.shared is not None):
        tensor = w.pipe.piece(
            source_bytes_for(w.source, piece.runs),
            piece.runs,
            piece.shape,
            piece.dtype,
            piece.zeros,
            piece.name,
            _fixup(piece, w.num_shards, w.rank),
        )
        return _place(tensor, w.device, owned=True), piece.bytes_read

    if chain is None:  # staged, replicated, shared by several workers of this process

        def stage() -> torch.Tensor:
            tensor = w.fill(piece.runs, piece.shape, piece.dtype, False, piece.name)
            # the others copy from it next, from their own threads onto their own devices:
            # it must have landed, not merely be ordered on this worker's streams
            w.pipe.finish()
            return tensor

        whole, made = w.share(piece.name, stage)
        return (
            whole if made else _place(whole, w.device, owned=False)
        ), piece.bytes_read if made else 0

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
    return _place(full[chain.index], w.device, owned=False), piece.bytes_read if computed else 0


#: a worker reports its progress (bytes for the bar, the parameter it is on for the watchdog),
#: moves the read-ahead on and hands mapped pages back once this many bytes or pieces are done
#: since it last did, and before any piece larger than that: per piece, that bookkeeping cost
#: more than copying a small tensor. The watchdog's "on parameter" is the piece the worker last
#: reported: the one it is stuck on, or one at most that far before it.
BOOKS_BYTES = 1 << 20
BOOKS_PIECES = 64
#: seconds between a waiting worker's checks for a turn (and whether to stop)
TURN_POLL_S = 0.05


class _Books:
    """A worker's bookkeeping around its pieces, done in batches (``BOOKS_BYTES``), and its
    turns (``LocalLoad.turns``): a worker of a CPU device reads a batch of plain pieces while
    holding one. The load loop counts a batch itself; here it is settled (``report``,
    ``flush``): the batch's pieces are the plan's from the last one settled up to the one the
    loop is at."""

    def __init__(
        self,
        ctx: WorkerContext,
        readahead: Readahead,
        local,
        releases: PageReleases,
        stopped: Callable[[], bool],
        pieces: Pieces,
    ):
        self._ctx, self._readahead, self._local, self._releases = ctx, readahead, local, releases
        self._stopped = stopped
        self._pieces = pieces
        self._first = 0  # the first piece not yet settled
        self._turns = local.turns if local is not None and ctx.device.type == "cpu" else None
        self._turn: int | None = None

    def take_turn(self) -> None:
        """Wait for a turn (reporting progress meanwhile, so waiting is not a stall)."""
        if self._turns is None or self._turn is not None:
            return
        while True:
            try:
                self._turn = self._turns.get(timeout=TURN_POLL_S)
                return
            except queue.Empty:
                if self._stopped():
                    raise Stopped() from None
                self._ctx.progress()

    def give_turn(self) -> None:
        if self._turn is not None:
            self._turns.put(self._turn)
            self._turn = None

    def report(self, j: int, nbytes: int) -> None:
        """Before piece ``j`` is read, where a batch starts (or the piece is large): the
        pieces before it (``nbytes``) settled, and ``j`` named. Stops here if the load is
        stopping."""
        if self._stopped():
            raise Stopped()
        self.flush(j, nbytes)
        name = self._pieces.names[j]
        self._readahead.reached(name)
        self._ctx.progress(where=name)

    def flush(self, upto: int, nbytes: int) -> None:
        """Settle the pieces finished before piece ``upto`` (``nbytes``) since the last
        report; give the turn to the next."""
        self.give_turn()
        first = self._first
        if upto <= first:
            return
        self._first = upto
        if self._local is not None:
            self._local.finished(self._ctx.rank, self._pieces.names[upto - 1])
        else:
            self._releases.add_spans(self._pieces.spans(first, upto))
        self._ctx.progress(nbytes=nbytes)


def _read_all(
    pieces: Pieces,
    kept: dict,
    books: _Books,
    views: SourceViews,
    general: Callable[[int, PieceRead], tuple[torch.Tensor, int]],
    plain: bool,
) -> tuple[int, int]:
    """Every piece of ``pieces`` into ``kept``, in order, settled in batches by ``books``;
    the checkpoint bytes read and the bytes kept.

    Where ``plain`` (the direct path to a CPU device, no stream of object bytes), a piece
    that is one small run making the whole piece (most of a load's pieces) is read here
    inline, from the plan's columns (no ``PieceRead`` is made for it): its bytes, viewed in
    the mapping as its dtype and shape, copied by numpy into a new array that torch takes.
    What ``read_host`` would do for it, checked as ``check_run`` checks, at about half the
    cost: a load of 100,000 small tensors on 8 workers is 800,000 such pieces, and each
    Python operation here is paid for every one of them. Any other piece goes by
    ``general(j, piece)``.

    A batch (``_Books``) ends after ``BOOKS_PIECES`` pieces or ``BOOKS_BYTES`` bytes, and
    before a piece of ``BOOKS_BYTES`` or more."""
    # what the loop needs of each kind of piece, worked out once: (nbytes, numpy dtype, torch
    # view or None, item size, the one run's fields after its offset or None, its offset)
    inline = [None if kind is None else _inline(kind, plain) for kind in pieces.kinds]
    entries, refresh = views.entries, views.refresh
    monotonic, from_numpy, ndarray, uint8 = time.monotonic, torch.from_numpy, np.ndarray, np.uint8
    kept_bytes = 0
    unread = 0  # bytes kept but not read (padding, shared pieces) less those read twice
    limit, batch_bytes, turn_due = 0, 0, True  # a batch is reported before piece ``limit``
    for j, (name, k, source, begin) in enumerate(
        zip(pieces.names, pieces.kind, pieces.source, pieces.begin)
    ):
        nbytes, carrier, view, itemsize, shape, run = inline[k]
        if j >= limit or batch_bytes >= BOOKS_BYTES or nbytes >= BOOKS_BYTES:
            books.report(j, batch_bytes)  # and stops here if the load is stopping
            kept_bytes += batch_bytes
            limit, batch_bytes, turn_due = j + BOOKS_PIECES, 0, True
        if run is not None:
            first, size, count, stride, dst_offset, dst_stride = run
            offset = begin + first
            now = monotonic()
            entry = entries.get(source)
            if entry is None or now - entry[2] >= CHECK_INTERVAL_S:
                entry = refresh(source, now)  # checks that the file is unchanged
            if turn_due:
                books.take_turn()
                turn_due = False
            # only a run that lies inside its source and makes the whole piece (any other
            # goes by the general path, which reads it or refuses it as check_run does)
            if offset < 0 or stride < 0 or dst_stride < 0 or dst_offset:
                pass
            elif count == 1:
                if size == nbytes and offset + size <= entry[3]:
                    tensor = from_numpy(ndarray(shape, carrier, entry[1], offset).copy())
                    kept[name] = tensor if view is None else tensor.view(view)
                    batch_bytes += nbytes
                    continue
            elif (
                count > 1
                and stride
                and dst_stride == size
                and size * count == nbytes
                and size % itemsize == 0
                and offset + (count - 1) * stride + size <= entry[3]
            ):
                if len(shape) == 2 and shape[0] == count:  # a column split: rows of it
                    data = ndarray(shape, carrier, entry[1], offset, (stride, itemsize)).copy()
                else:
                    data = (
                        ndarray((count, size), uint8, entry[1], offset, (stride, 1))
                        .copy()
                        .view(carrier)
                        .reshape(shape)
                    )
                tensor = from_numpy(data)
                kept[name] = tensor if view is None else tensor.view(view)
                batch_bytes += nbytes
                continue
        kept[name], nread = general(j, pieces[j])
        unread += nbytes - nread
        batch_bytes += nbytes
        turn_due = True  # it may have given the turn
    books.flush(len(pieces), batch_bytes)
    kept_bytes += batch_bytes
    return kept_bytes - unread, kept_bytes


def _inline(kind: Kind, plain: bool) -> tuple:
    """What ``_read_all`` needs of a kind of piece: its bytes, the numpy dtype it is made as
    and the torch dtype it is then viewed as (or None; ``dtypes.numpy_carrier``), its item
    size, its shape, and, where the loop may read it inline (``plain``; one small run making
    the whole piece, no fixup, chain or zeros), the run as ``(offset from the tensor's first
    byte, nbytes, count, stride, dst_offset, dst_stride)``, else None."""
    size = dtypes.itemsize(kind.dtype)
    carrier, view = dtypes.numpy_carrier(kind.dtype)
    nbytes = math.prod(kind.shape) * size
    run = None
    if (
        plain
        and kind.chain is None
        and kind.fixup is None
        and not kind.zeros
        and len(kind.tails) == 1
        and nbytes <= SMALL_RUN_BYTES
    ):
        offset, tail = kind.tails[0]
        run = (offset, *tail)
    return (nbytes, carrier, dtypes.to_torch(kind.dtype) if view else None, size, kind.shape, run)


@register_session_func(LOAD_PIECES)
def load_pieces(ctx: WorkerContext, request: dict) -> dict:
    """Carry out ``request["plan"]`` (a ``ReadPlan`` as ``wire.encode`` writes it) on this
    worker.

    ``request["load"]`` names the load (``request["plan"]`` is None for a worker in the
    loader's process: its plan is the load's own, ``LocalLoad.plans``); ``request["stream"]``
    is its side of the load's stream of object bytes (``stream.ObjectStream.spec``), for a
    worker process; ``request["modules"]`` lists plugin modules that define shard functions
    the plan computes with; ``request["staging"]`` (a ``Staging`` as JSON, or
    absent) sends the pieces through the staged pipeline. The pieces become ``ctx.shards`` (the
    worker's model); a worker outside the loader's process keeps them for ``fetch_piece`` until
    ``release_loads``. Returns statistics.
    """
    start = time.perf_counter()
    local = local_for(request["load"])
    # a worker in the loader's process takes its read plan as the loader made it (no JSON)
    if request["plan"] is None and local is not None:
        plan = local.plans[ctx.rank]
    else:
        with gc_paused():  # a tuple per piece and run, all kept
            plan = wire.decode(request["plan"])
    load_plugins(request.get("modules", ()))
    source = local.ckpt if local is not None else None
    staging = request.get("staging")
    kept: dict[str, torch.Tensor] = {}

    def stopped() -> bool:
        return ctx.should_stop() or (local is not None and local.stopped.is_set())

    with contextlib.ExitStack() as stack:
        stack.enter_context(gc_paused())  # a piece is a tensor the collector would walk
        if local is not None and plan.rank in local.consumers:
            consumer = local.consumers[plan.rank]
        else:
            source, consumer = worker_side(plan, request.get("stream"), source, stack)
        if consumer is not None:
            stack.callback(consumer.finish)  # done, failed or stopped: the stream moves on
        if local is not None:
            releases, readahead = local.releases, local.readahead
        else:
            releases = PageReleases(source, num_shards=plan.num_shards)
            readahead = Readahead(source, piece_spans(plan))
            stack.callback(readahead.start().close)
        current = [None]
        waiting = lambda: ctx.progress(where=current[0])  # noqa: E731
        pipe = None
        if staging is not None:
            pipe = stack.enter_context(
                Pipeline(ctx.device, Staging.from_json(staging), stopped, waiting)
            )
        shared = local.shared if local is not None and local.num_local > 1 else None
        worker = _Worker(
            source,
            plan.num_shards,
            plan.rank,
            ctx.device,
            pipe,
            shared,
            waiting,
            stopped,
            SourceViews(source),
        )
        books = _Books(ctx, readahead, local, releases, stopped, plan.pieces)
        stack.callback(books.give_turn)
        direct_cpu = pipe is None and ctx.device.type == "cpu"
        views = worker.views

        def wait_for_unit(unit: int, name: str) -> None:
            """Before each part of a piece streamed in parts: past the units before it, and
            its bytes fetched (waiting, if need be, without a turn another worker needs)."""
            if consumer.fetched(unit):
                consumer.reach(unit, waiting, stopped)
                return
            books.give_turn()
            current[0] = f"{name} (waiting for its bytes from object storage)"
            consumer.reach(unit, waiting, stopped)
            current[0] = name
            books.take_turn()

        def general(j: int, piece: PieceRead) -> tuple[torch.Tensor, int]:
            """Piece ``j`` by the general path: streamed, staged, computed, or read by
            ``read_host``."""
            current[0] = piece.name
            direct = direct_cpu and piece.chain is None
            parts = consumer.parts(j, piece) if consumer is not None and direct else None
            if consumer is not None and parts is None:
                if not consumer.ready(j):
                    books.give_turn()  # never wait for bytes holding a turn another needs
                    current[0] = f"{piece.name} (waiting for its bytes from object storage)"
                consumer.at(j, waiting, stopped)
                current[0] = piece.name
            if direct:
                # read straight into its own new tensor, holding a turn (no waiting on other
                # workers while holding it)
                books.take_turn()
                return read_host(
                    piece, views, plan.num_shards, plan.rank, waiting, parts, wait_for_unit
                )
            books.give_turn()
            ctx.progress(where=piece.name)  # may wait on others or compute long: named
            # a long copy or computation reports progress too, so it is not taken for a hang
            with copy_progress(waiting):
                return _piece(worker, piece)

        read, kept_bytes = _read_all(
            plan.pieces, kept, books, views, general, plain=direct_cpu and consumer is None
        )
        worker.views.check()  # no file changed under the load
        count_read(source, nbytes=read)  # once: a count per piece contended for a lock
        if pipe is not None:
            pipe.finish()  # every copy landed before the load is reported done
        if local is None:
            releases.flush()
    ctx.shards = kept  # the latest load is the worker's model, for session functions
    if local is not None:
        local.shards[plan.rank] = kept  # the loader returns them itself
    else:  # kept here until the loader says its result was dropped (release_loads)
        ctx.values.setdefault(LOAD_PIECES, {})[request["load"]] = kept
    reply = {
        "bytes": kept_bytes,
        "tensors": len(kept),
        "bytes_read": read,
        "seconds": time.perf_counter() - start,
    }
    if consumer is not None:
        reply["seconds_waiting_for_objects"] = consumer.waited
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
