"""The session functions of a load: ``shardload.load_pieces`` carries out one worker's read plan,
``shardload.fetch_piece`` hands a kept piece to the loader, ``shardload.release_loads`` forgets
the pieces of results that were dropped.

For each piece of the read plan, in storage order, the worker reads it by its byte runs (zeros
where the piece is padding; its fixup applied), or computes it (the whole stored tensor through
its chain, ``chains``; shared by the workers of this process, ``sharing``), then places it on
its device, owning its memory, and reports progress. With ``staging`` the reads go through the
worker's ``Pipeline`` (``staging.py``) straight into device memory.
"""

from __future__ import annotations

import contextlib
import queue
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import annotate
from ..gc_pause import gc_paused
from ..readers.base import COPY_CHUNK_BYTES, Checkpoint, copy_progress
from ..readplan import PieceRead, ReadPlan
from ..registry import get_shard_func, load_plugins
from ..sessions import Stopped, WorkerContext, register_session_func
from ..staging import Pipeline, Staging
from .chains import run_steps
from .reads import (PageReleases, Readahead, SourceViews, copy_runs, count_read, new_piece,
                    piece_spans, read_runs, source_bytes_for)
from .stream import worker_side
from ..shared_outputs import SharedOutputs
from .sharing import local_for

__all__ = ["LOAD_PIECES", "FETCH_PIECE", "RELEASE_LOADS", "read_piece", "load_pieces",
           "fetch_piece", "release_loads"]

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
    views = SourceViews(source)
    tensor, _ = read_host(piece, views, num_shards, rank)
    count_read(source, piece.runs)
    return tensor


#: ``wait(unit, name)``: wait until a unit of the load's stream of object bytes is fetched
WaitForUnit = Callable[[int, str], None]


def read_host(piece: PieceRead, views: SourceViews, num_shards: int, rank: int,
              waiting: Optional[Callable[[], None]] = None, parts=None,
              wait: Optional[WaitForUnit] = None) -> tuple[torch.Tensor, int]:
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
    pipe: Optional[Pipeline]
    shared: Optional[SharedOutputs]
    waiting: Callable[[], None]
    stopped: Callable[[], bool]
    views: Optional[SourceViews] = None

    def fill(self, runs, shape, dtype: str, zeros: bool, name: str,
             fixup: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """A new tensor on the device (staged) or on the host (direct), filled by ``runs``: a
        chain's input, or a replicated piece staged once for the workers of a process; the
        load counts the bytes read (``count_read``) once it is done."""
        if self.pipe is None:
            tensor = read_runs(self.source, runs, shape, dtype, zeros, name, self.views)
            if fixup is not None:
                fixup(tensor)
            return tensor
        return self.pipe.piece(source_bytes_for(self.source, runs), runs, shape, dtype, zeros,
                               name, fixup)

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
    if chain is None and w.pipe is None:
        tensor, nread = read_host(piece, w.views, w.num_shards, w.rank, w.waiting)
        if w.device.type == "cpu":
            return tensor, nread  # read_host made it: new, owned, contiguous
        return _place(tensor, w.device, owned=True), nread
    if chain is None and not (piece.shared and w.shared is not None):
        tensor = w.pipe.piece(source_bytes_for(w.source, piece.runs), piece.runs, piece.shape,
                              piece.dtype, piece.zeros, piece.name,
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
    holding one."""

    def __init__(self, ctx: WorkerContext, readahead: Readahead, local, releases: PageReleases,
                 stopped: Callable[[], bool]):
        self._ctx, self._readahead, self._local, self._releases = ctx, readahead, local, releases
        self._stopped = stopped
        self._done: list[PieceRead] = []
        self._bytes = 0
        self._due = True  # the first piece is reported
        self._turns = local.turns if local is not None and ctx.device.type == "cpu" else None
        self._turn: Optional[int] = None

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

    def starting(self, piece: PieceRead, nbytes: int) -> None:
        """Before ``piece`` (``nbytes``) is read: reported where a batch starts, or where it
        is large."""
        if self._due or nbytes >= BOOKS_BYTES:
            if self._stopped():
                raise Stopped()
            self.flush()
            self._readahead.reached(piece.name)
            self._ctx.progress(where=piece.name)
            self._due = False

    def finished(self, piece: PieceRead, nbytes: int) -> None:
        self._done.append(piece)
        self._bytes += nbytes
        if self._bytes >= BOOKS_BYTES or len(self._done) >= BOOKS_PIECES:
            self._due = True

    def flush(self) -> None:
        """Settle the pieces finished since the last report; give the turn to the next."""
        self.give_turn()
        done, nbytes = self._done, self._bytes
        if not done:
            return
        self._done, self._bytes = [], 0
        if self._local is not None:
            self._local.finished(self._ctx.rank, done)
        else:
            for piece in done:
                self._releases.add_runs(piece.runs)
        self._ctx.progress(nbytes=nbytes)


@register_session_func(LOAD_PIECES)
def load_pieces(ctx: WorkerContext, request: dict) -> dict:
    """Carry out ``request["plan"]`` (a ``ReadPlan`` as JSON) on this worker.

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
    plan = (local.plans[ctx.rank] if request["plan"] is None and local is not None
            else ReadPlan.from_json(request["plan"]))
    load_plugins(request.get("modules", ()))
    source = local.ckpt if local is not None else None
    staging = request.get("staging")
    kept: dict[str, torch.Tensor] = {}
    read = kept_bytes = 0

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
            pipe = stack.enter_context(Pipeline(ctx.device, Staging.from_json(staging),
                                                stopped, waiting))
        shared = local.shared if local is not None and local.num_local > 1 else None
        worker = _Worker(source, plan.num_shards, plan.rank, ctx.device, pipe, shared, waiting,
                         stopped, SourceViews(source))
        books = _Books(ctx, readahead, local, releases, stopped)
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

        for j, piece in enumerate(plan.pieces):
            current[0] = piece.name
            nbytes = piece.nbytes
            books.starting(piece, nbytes)  # and stops here if the load is stopping
            direct = direct_cpu and piece.chain is None
            parts = consumer.parts(j, piece) if consumer is not None and direct else None
            if consumer is not None and parts is None:
                if not consumer.ready(j):
                    books.give_turn()  # never wait for bytes holding a turn another needs
                    current[0] = f"{piece.name} (waiting for its bytes from object storage)"
                consumer.at(j, waiting, stopped)
                current[0] = piece.name
            if direct:
                # the common piece, read straight into its own new tensor, holding a turn (no
                # waiting on other workers while holding it)
                books.take_turn()
                tensor, nread = read_host(piece, views, plan.num_shards, plan.rank, waiting,
                                          parts, wait_for_unit)
            else:
                books.give_turn()
                ctx.progress(where=piece.name)  # may wait on others or compute long: named
                # a long copy or computation reports progress too, so it is not taken for a hang
                with copy_progress(waiting):
                    tensor, nread = _piece(worker, piece)
            kept[piece.name] = tensor
            read += nread
            kept_bytes += nbytes
            books.finished(piece, nbytes)
        books.flush()
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
    reply = {"bytes": kept_bytes, "tensors": len(kept), "bytes_read": read,
             "seconds": time.perf_counter() - start}
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
