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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import dtypes
from ..errors import annotate
from ..gc_pause import gc_paused
from ..readers.base import COPY_CHUNK_BYTES, Checkpoint, copy_progress
from ..readplan import Chain, Kind, PieceRead, Pieces, ReadPlan, Run
from ..registry import get_shard_func, load_plugins
from ..sessions import Stopped, WorkerContext, register_session_func
from ..shared_outputs import SharedOutputs
from ..staging import Pipeline, Staging
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
from .request import LoadRequest
from .sharing import LocalLoad, local_for
from .stream import Consumer, worker_side

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
    if fix is None:  # the plan was validated against the registry: not seen in a load
        raise ValueError(f"parameter {piece.name!r}: shard function {fixup.func} has no fixup")

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
#: a piece streamed in parts: its runs by unit of the stream (``Consumer.parts``), and the wait
#: before each part
Streamed = tuple[list[tuple[int, list[Run]]], WaitForUnit]


def read_host(
    piece: PieceRead,
    views: SourceViews,
    num_shards: int,
    rank: int,
    waiting: Callable[[], None] | None = None,
    streamed: Streamed | None = None,
) -> tuple[torch.Tensor, int]:
    """The one read of a piece without a chain into host memory: a new tensor that owns its
    memory, filled by the piece's runs and fixed up; and the checkpoint bytes copied. A load
    reads most pieces this way, so it is kept to the fewest calls.

    ``streamed``: the piece's parts, each copied once ``wait(unit, name)`` returns, so that
    the copy of the first parts overlaps the fetch of the rest. ``waiting``: called while a
    large copy goes on (``copy_progress``)."""
    tensor, dst = new_piece(piece.shape, piece.dtype, piece.zeros)
    watched = contextlib.nullcontext() if waiting is None else copy_progress(waiting)
    if streamed is not None:
        parts, wait = streamed
        nread = 0
        with watched:
            for unit, runs in parts:
                wait(unit, piece.name)
                nread += copy_runs(dst, runs, views, piece.name)
    elif waiting is not None and piece.nbytes > COPY_CHUNK_BYTES:
        with watched:  # a long copy reports progress too
            nread = copy_runs(dst, piece.runs, views, piece.name)
    else:
        nread = copy_runs(dst, piece.runs, views, piece.name)
    if piece.fixup is not None:
        fix = _fixup(piece, num_shards, rank)
        if fix is not None:
            fix(tensor)
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
    views: SourceViews

    def stage(
        self,
        pipe: Pipeline,
        runs: Sequence[Run],
        shape: tuple[int, ...],
        dtype: str,
        zeros: bool,
        name: str,
        fixup: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """A new tensor on the device filled by ``runs`` through ``pipe``."""
        sources = source_bytes_for(self.source, runs)
        return pipe.piece(sources, runs, shape, dtype, zeros, name, fixup)

    def fill(
        self, runs: Sequence[Run], shape: tuple[int, ...], dtype: str, name: str
    ) -> torch.Tensor:
        """A new tensor on the device (staged) or on the host (direct), filled by ``runs``: a
        chain's input, or a replicated piece staged once for the workers of a process; the
        load counts the bytes read (``count_read``) once it is done."""
        if self.pipe is None:
            return read_runs(self.source, runs, shape, dtype, False, name, self.views)
        return self.stage(self.pipe, runs, shape, dtype, False, name)

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
    chain, pipe = piece.chain, w.pipe
    if chain is not None:
        return _computed(w, piece, chain)
    if pipe is None:
        tensor, nread = read_host(piece, w.views, w.num_shards, w.rank, w.waiting)
        if w.device.type == "cpu":
            return tensor, nread  # read_host made it: new, owned, contiguous
        return _place(tensor, w.device, owned=True), nread
    if not (piece.shared and w.shared is not None):
        fixup = _fixup(piece, w.num_shards, w.rank)
        tensor = w.stage(pipe, piece.runs, piece.shape, piece.dtype, piece.zeros, piece.name, fixup)
        return _place(tensor, w.device, owned=True), piece.bytes_read

    # staged, replicated, shared by several workers of this process
    def stage() -> torch.Tensor:
        tensor = w.fill(piece.runs, piece.shape, piece.dtype, piece.name)
        # the others copy from it next, from their own threads onto their own devices: it
        # must have landed, not merely be ordered on this worker's streams
        pipe.finish()
        return tensor

    whole, made = w.share(piece.name, stage)
    if made:
        return whole, piece.bytes_read
    return _place(whole, w.device, owned=False), 0


def _computed(w: _Worker, piece: PieceRead, chain: Chain) -> tuple[torch.Tensor, int]:
    """The worker's piece of a chain's output, the chain run once per process (``share``)."""

    def compute() -> torch.Tensor:
        pipe = w.pipe
        x = w.fill(piece.runs, chain.shape, chain.dtype, piece.name)
        if pipe is not None:
            pipe.fence()  # the steps run on the device, after the input's copies
        elif w.device.type != "cpu":
            x = x.to(w.device)
        out = run_steps(chain.runnable(), x, piece.name)
        if pipe is not None and w.shared is not None:
            pipe.finish()  # as for a shared replicated tensor: landed before it is shared
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


# ---- where a worker runs: in the loader's process, or in a process of its own -------------------


class _Environment:
    """What a worker's load takes from where it runs: its read plan, its source and side of the
    load's stream of object bytes, the read-ahead, what it shares with the workers of its
    process, its turns; where its finished pages and its pieces go."""

    plan: ReadPlan
    source: Checkpoint
    consumer: Consumer | None
    readahead: Readahead
    #: the chains and replicated tensors shared by the workers of this process (None: alone)
    shared: SharedOutputs | None = None
    #: the turns of the workers of CPU devices here (``LocalLoad.turns``; None: no turns)
    turns: queue.SimpleQueue[int] | None = None

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    def stopped(self) -> bool:
        """Whether the load is stopping (the session asked, or another worker failed)."""
        return self.ctx.should_stop()

    def settle(self, pieces: Pieces, first: int, upto: int) -> None:
        """Pieces ``first`` to ``upto`` (not included) are done with: their pages may go."""
        raise NotImplementedError

    def keep(self, load: str, kept: dict[str, torch.Tensor]) -> None:
        """The worker's pieces of load ``load``, for the loader to return."""
        raise NotImplementedError

    def done(self) -> None:
        """The worker read every piece."""


class _InLoaderProcess(_Environment):
    """A worker in the loader's process: its read plan, checkpoint, side of the stream, read-ahead
    and page releases are the load's own (``LocalLoad``), shared with the other workers here,
    and its pieces are left there."""

    def __init__(self, ctx: WorkerContext, local: LocalLoad, stack: contextlib.ExitStack):
        super().__init__(ctx)
        self._local = local
        self.plan = local.plans[ctx.rank]  # as the loader made it (no JSON)
        self.source = local.ckpt
        self.consumer = local.consumers.get(self.plan.rank)
        if self.consumer is None:  # no stream of the loader's (a torchrun rank): its own, if any
            _, self.consumer = worker_side(self.plan, None, self.source, stack)
        if self.consumer is not None:
            stack.callback(self.consumer.finish)  # done, failed or stopped: the stream moves on
        self.readahead = local.readahead
        self.shared = local.shared if local.num_local > 1 else None
        self.turns = local.turns if ctx.device.type == "cpu" else None

    def stopped(self) -> bool:
        return self.ctx.should_stop() or self._local.stopped.is_set()

    def settle(self, pieces: Pieces, first: int, upto: int) -> None:
        self._local.finished(self.plan.rank, pieces.names[upto - 1])

    def keep(self, load: str, kept: dict[str, torch.Tensor]) -> None:
        self._local.shards[self.plan.rank] = kept  # the loader returns them itself


class _InOwnProcess(_Environment):
    """A worker process: its read plan came on the wire; it maps the files the plan names,
    reads ahead and releases pages for itself, and keeps its pieces until the loader says their
    result was dropped (``release_loads``)."""

    def __init__(self, ctx: WorkerContext, request: LoadRequest, stack: contextlib.ExitStack):
        super().__init__(ctx)
        if request.plan is None:
            raise ValueError(f"load {request.load!r} is not under way in this process")
        self.plan = request.plan
        self.source, self.consumer = worker_side(self.plan, request.stream, None, stack)
        if self.consumer is not None:
            stack.callback(self.consumer.finish)  # done, failed or stopped: the stream moves on
        self._releases = PageReleases(self.source, num_shards=self.plan.num_shards)
        self.readahead = Readahead(self.source, piece_spans(self.plan))
        stack.callback(self.readahead.start().close)

    def settle(self, pieces: Pieces, first: int, upto: int) -> None:
        self._releases.add_spans(pieces.spans(first, upto))

    def keep(self, load: str, kept: dict[str, torch.Tensor]) -> None:
        self.ctx.values.setdefault(LOAD_PIECES, {})[load] = kept

    def done(self) -> None:
        self._releases.flush()


class _Books:
    """A worker's bookkeeping around its pieces, done in batches (``BOOKS_BYTES``), and its
    turns (``_Environment.turns``): a worker of a CPU device reads a batch of plain pieces
    while holding one. The load loop counts a batch itself; here it is settled (``report``,
    ``flush``): the batch's pieces are the plan's from the last one settled up to the one the
    loop is at."""

    def __init__(self, env: _Environment):
        self._env = env
        self._pieces = env.plan.pieces
        self._first = 0  # the first piece not yet settled
        self._turns = env.turns
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
                if self._env.stopped():
                    raise Stopped() from None
                self._env.ctx.progress()

    def give_turn(self) -> None:
        if self._turns is not None and self._turn is not None:
            self._turns.put(self._turn)
            self._turn = None

    def report(self, j: int, nbytes: int) -> None:
        """Before piece ``j`` is read, where a batch starts (or the piece is large): the
        pieces before it (``nbytes``) settled, and ``j`` named. Stops here if the load is
        stopping."""
        if self._env.stopped():
            raise Stopped()
        self.flush(j, nbytes)
        name = self._pieces.names[j]
        self._env.readahead.reached(name)
        self._env.ctx.progress(where=name)

    def flush(self, upto: int, nbytes: int) -> None:
        """Settle the pieces finished before piece ``upto`` (``nbytes``) since the last
        report; give the turn to the next."""
        self.give_turn()
        first = self._first
        if upto <= first:
            return
        self._first = upto
        self._env.settle(self._pieces, first, upto)
        self._env.ctx.progress(nbytes=nbytes)


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
    # view or None, item size, the one run's fields after its offset or None, its offset);
    # nothing for a kind this worker holds no piece of (never looked up)
    inline = [() if kind is None else _inline(kind, plain) for kind in pieces.kinds]
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


#: ``Consumer.at`` or ``Consumer.reach``: ``wait(j_or_unit, alive, stopped)``
_Wait = Callable[[int, Callable[[], None], Callable[[], bool]], None]


class _Run:
    """One worker's load under way: the general path of a piece (``general``), and the waits
    for the bytes of the load's stream of object bytes, each without a turn another worker
    needs. ``where`` is what the worker reports while it waits or copies at length: the piece
    it is on, as the watchdog names it."""

    def __init__(
        self,
        ctx: WorkerContext,
        env: _Environment,
        staging: Staging | None,
        stack: contextlib.ExitStack,
    ):
        self.ctx, self.env = ctx, env
        self.where: str | None = None
        self.pipe: Pipeline | None = None
        if staging is not None:
            self.pipe = stack.enter_context(
                Pipeline(ctx.device, staging, env.stopped, self.waiting)
            )
        plan = env.plan
        self.worker = _Worker(
            env.source,
            plan.num_shards,
            plan.rank,
            self.ctx.device,
            self.pipe,
            env.shared,
            self.waiting,
            env.stopped,
            SourceViews(env.source),
        )
        self.books = _Books(env)
        stack.callback(self.books.give_turn)
        self.direct_cpu = self.pipe is None and self.ctx.device.type == "cpu"

    def waiting(self) -> None:
        self.ctx.progress(where=self.where)

    def _wait_for_bytes(self, name: str, ready: bool, wait: _Wait, at: int) -> None:
        """``wait(at, ...)`` (``Consumer.at`` or ``reach``) for bytes of piece ``name`` from
        object storage; where they are not there yet (not ``ready``), without the turn
        (another worker may need it) and named as waiting for them."""
        if ready:
            wait(at, self.waiting, self.env.stopped)
            return
        self.books.give_turn()
        self.where = f"{name} (waiting for its bytes from object storage)"
        wait(at, self.waiting, self.env.stopped)
        self.where = name

    def wait_for_unit(self, unit: int, name: str) -> None:
        """Before each part of a piece streamed in parts: past the units before it, and its
        bytes fetched; then the turn again."""
        consumer = self.env.consumer
        if consumer is None:  # only a streamed piece has parts
            return
        self._wait_for_bytes(name, consumer.fetched(unit), consumer.reach, unit)
        self.books.take_turn()

    def general(self, j: int, piece: PieceRead) -> tuple[torch.Tensor, int]:
        """Piece ``j`` by the general path: streamed, staged, computed, or read by
        ``read_host``."""
        self.where = piece.name
        consumer, books = self.env.consumer, self.books
        direct = self.direct_cpu and piece.chain is None
        parts = consumer.parts(j, piece) if consumer is not None and direct else None
        if consumer is not None and parts is None:
            self._wait_for_bytes(piece.name, consumer.ready(j), consumer.at, j)
        if direct:
            # read straight into its own new tensor, holding a turn (no waiting on other
            # workers while holding it)
            books.take_turn()
            plan = self.env.plan
            streamed = None if parts is None else (parts, self.wait_for_unit)
            return read_host(
                piece, self.worker.views, plan.num_shards, plan.rank, self.waiting, streamed
            )
        books.give_turn()
        self.ctx.progress(where=piece.name)  # may wait on others or compute long: named
        # a long copy or computation reports progress too, so it is not taken for a hang
        with copy_progress(self.waiting):
            return _piece(self.worker, piece)


@register_session_func(LOAD_PIECES)
def load_pieces(ctx: WorkerContext, request: dict) -> dict:
    """Carry out the ``LoadRequest`` ``request`` (as JSON, ``LoadRequest.to_json``) on this
    worker: its read plan, the load's own for a worker in the loader's process (``LocalLoad``),
    else the one the request carries.

    The pieces become ``ctx.shards`` (the worker's model); a worker outside the loader's
    process keeps them for ``fetch_piece`` until ``release_loads``. Returns statistics.
    """
    start = time.perf_counter()
    asked = LoadRequest.from_json(request)
    load_plugins(asked.modules)
    local = local_for(asked.load)
    kept: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(gc_paused())  # a piece is a tensor the collector would walk
        env: _Environment = (
            _InOwnProcess(ctx, asked, stack)
            if local is None
            else _InLoaderProcess(ctx, local, stack)
        )
        run = _Run(ctx, env, asked.staging, stack)
        read, kept_bytes = _read_all(
            env.plan.pieces,
            kept,
            run.books,
            run.worker.views,
            run.general,
            plain=run.direct_cpu and env.consumer is None,
        )
        run.worker.views.check()  # no file changed under the load
        count_read(env.source, nbytes=read)  # once: a count per piece contended for a lock
        if run.pipe is not None:
            run.pipe.finish()  # every copy landed before the load is reported done
        env.done()
    ctx.shards = kept  # the latest load is the worker's model, for session functions
    env.keep(asked.load, kept)
    reply: dict[str, Any] = {
        "bytes": kept_bytes,
        "tensors": len(kept),
        "bytes_read": read,
        "seconds": time.perf_counter() - start,
    }
    if env.consumer is not None:
        reply["seconds_waiting_for_objects"] = env.consumer.waited
    if run.pipe is not None:
        reply["staging"] = run.pipe.stats.as_dict()
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
