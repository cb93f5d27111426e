"""A load's bytes of objects in object storage, streamed: fetched once, in the order the workers
read them, while they read, in a bounded window of memory.

Lifecycle (``ObjectStream``, made by the loader for the workers of its load, or by a worker
for itself where it cannot share the loader's):

1. **Units.** Every worker's read plan takes the load's parameters in one order (each plan's
   pieces are a subsequence of it). A unit is one parameter: the union of every worker's byte
   spans of it, per object source (``stream_units``). Units without object bytes cost nothing.
   A parameter of more than ``PART_BYTES`` in one object is cut, by position in the object,
   into parts of about that size, one unit each (``split_runs`` cuts each worker's runs the
   same way): a worker copies the first part of a 2 GB embedding while the rest arrives, and
   the window need not hold it whole.
2. **Fetch.** One thread fetches the units in that order, in batches of about
   ``batch_bytes`` (each a coalesced, concurrent set of GETs: ``ObjectBytes.need_spans``;
   ``IN_FLIGHT`` batches at once, settled in order), while the bytes held, from the first
   unit a worker still needs to the last fetched, stay within ``window`` bytes. The unit the slowest worker needs is fetched whatever its size:
   the bound is ``max(window, the largest batch)``.
3. **Consume.** Before each piece, or each part of one, a worker says which unit it is on
   (``Consumer.at``, ``Consumer.reach``) and waits until that unit is fetched. Every unit before the slowest worker's is done with: its bytes
   are released (pages freed, ``ObjectBytes.release``), except any a held unit still needs.
4. **Shared.** The counters live in a small block of shared memory (``Control``): the state,
   the units fetched, the bytes fetched and each worker's unit. Worker processes map it, and
   the objects' memory files, through ``/proc/<pid>/fd``; a worker that cannot marks itself
   done here (``DONE``) and streams for itself.
5. **Seen.** A waiting worker reports progress only while the load moves (bytes arrive, or a
   worker moves on): a fetch that stops is a stall the session's watchdog sees, named. A fetch
   that fails sets the state to ``FAILED``: the waiting workers stop, and the loader raises
   the fetch's own error (``ObjectStream.error``).

>>> stream = ObjectStream(ckpt.object_bytes(), stream_units(plans), consumers=2)  # doctest: +SKIP
>>> stream.start(); consumer = stream.consumer(0, plans[0])                      # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import collections
import heapq
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ShardloadError
from ..readplan import PieceRead, ReadPlan, Run
from ..sessions import Stopped

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "PART_BYTES",
    "WINDOW_ENV",
    "Consumer",
    "Control",
    "ObjectStream",
    "StreamFailed",
    "Units",
    "attach_consumer",
    "piece_units",
    "split_runs",
    "stream_units",
    "window_from_env",
    "worker_side",
]

#: the window's default: bytes of objects held at once by a load's process, besides what the
#: workers keep (``$SHARDLOAD_OBJECT_WINDOW_MB``)
DEFAULT_WINDOW_BYTES = 1 << 30
WINDOW_ENV = "SHARDLOAD_OBJECT_WINDOW_MB"
#: a batch is at most this, and at most a quarter of the window (fetching overlaps reading);
#: this many are fetched at once, so that one's slowest GET does not leave the pipe idle
BATCH_BYTES = 64 << 20
IN_FLIGHT = 2
#: a parameter with more bytes than this in one object is streamed in parts of about this size
PART_BYTES = 16 << 20
#: seconds between looks at the counters, while waiting (a worker for bytes, the fetch for
#: room in the window)
POLL_S = 0.002
POLL_MAX_S = 0.02
#: seconds ``close`` waits for a GET in flight
CLOSE_WAIT_S = 1.0
#: a worker position: not yet attached (counted as at the first unit), and done (or gone)
NOT_ATTACHED = -1
DONE = 1 << 62
#: states
RUNNING, FAILED, CLOSED = 0, 1, 2
#: the words before the workers' positions: state, units fetched, bytes fetched, moves
_STATE, _FETCHED, _BYTES, _MOVES, _HEADER = 0, 1, 2, 3, 4


class StreamFailed(ShardloadError):
    """The load's fetch from object storage failed; the loader raises its own error."""


def window_from_env(environ=None) -> int:
    """The window in bytes, from ``$SHARDLOAD_OBJECT_WINDOW_MB`` (a positive number of MiB)
    or the default; a bad value is a ``ValueError`` naming the variable."""
    text = (os.environ if environ is None else environ).get(WINDOW_ENV, "").strip()
    if not text:
        return DEFAULT_WINDOW_BYTES
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < (1 << 30)):
        raise ValueError(
            f"{WINDOW_ENV}={text!r} must be a positive number of MiB (default "
            f"{DEFAULT_WINDOW_BYTES >> 20})"
        )
    return max(1, int(value * (1 << 20)))


# ---- units --------------------------------------------------------------------------------------


def _object_sources(plan: ReadPlan) -> set[int]:
    return {k for k, spec in enumerate(plan.sources) if spec.get("object") is not None}


def _run_spans(run) -> list[tuple[int, int]]:
    stride = run.stride or run.nbytes
    if run.count == 1 or stride == run.nbytes:
        return [(run.offset, run.offset + run.count * run.nbytes)]
    return [(a, a + run.nbytes) for a in range(run.offset, run.offset + run.count * stride, stride)]


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
    spans: list[dict[int, list]]
    first: dict[str, int]
    cuts: dict[str, tuple[int, tuple[int, ...]]]


def _cuts(plans: list[ReadPlan], part_bytes: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Where each parameter of more than ``part_bytes`` in one object is cut: every
    ``part_bytes`` from the first byte any worker reads of it. A parameter read from several
    objects stays whole."""
    bounds: dict[str, dict[int, list[int]]] = {}
    for plan in plans:
        remote = _object_sources(plan)
        for piece in plan.pieces:
            for run in piece.runs:
                if run.source in remote:
                    lo = run.offset
                    hi = lo + (run.count - 1) * (run.stride or run.nbytes) + run.nbytes
                    b = bounds.setdefault(piece.name, {}).setdefault(run.source, [lo, hi])
                    b[0], b[1] = min(b[0], lo), max(b[1], hi)
    cuts = {}
    for name, by_source in bounds.items():
        if len(by_source) == 1:
            ((source, (lo, hi)),) = by_source.items()
            if hi - lo > part_bytes:
                cuts[name] = (source, tuple(range(lo + part_bytes, hi, part_bytes)))
    return cuts


def split_runs(runs, source: int, cuts) -> list[list[Run]]:
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
            begin, end = run.offset, run.offset + run.nbytes
            k = bisect.bisect_right(cuts, begin)
            while begin < end:
                stop = min(end, cuts[k]) if k < len(cuts) else end
                parts[k].append(
                    Run(source, begin, stop - begin, 1, 0, run.dst_offset + begin - run.offset, 0)
                )
                begin, k = stop, k + 1
        else:
            stride = run.stride or run.nbytes
            dst_stride = run.dst_stride or run.nbytes
            first = 0
            for k in range(len(cuts) + 1):
                # the blocks whose last byte lies before the cut: offset + r*stride + nbytes <= cut
                last = (
                    run.count
                    if k == len(cuts)
                    else min(
                        run.count, max(first, -(-(cuts[k] - run.offset - run.nbytes + 1) // stride))
                    )
                )
                if last > first:
                    parts[k].append(
                        Run(
                            source,
                            run.offset + first * stride,
                            run.nbytes,
                            last - first,
                            run.stride,
                            run.dst_offset + first * dst_stride,
                            run.dst_stride,
                        )
                    )
                first = last
    return parts


def _piece_parts(piece: PieceRead, cut) -> list:
    return [piece.runs] if cut is None else split_runs(piece.runs, cut[0], cut[1])


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
    spans: list[dict[int, list]] = [{} for _ in names]
    for plan in plans:
        remote = _object_sources(plan)
        if not remote:
            continue
        for piece in plan.pieces:
            at = first[piece.name]
            for k, runs in enumerate(_piece_parts(piece, cuts.get(piece.name))):
                for run in runs:
                    if run.source in remote:
                        spans[at + k].setdefault(run.source, []).extend(_run_spans(run))
    return Units(names, spans, first, cuts)


def piece_units(plan: ReadPlan, units: Units) -> tuple[list[int], list[int], dict[int, list]]:
    """For each piece of ``plan``: its first and last unit (-1 for a piece that reads no
    object; rising: ``_merged_order``), and, for a piece streamed in parts, its ``cuts``
    (``{piece index: [source, offsets]}``)."""
    remote = _object_sources(plan)
    firsts, lasts, cuts = [], [], {}
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
            cuts[j] = [cut[0], list(cut[1])]
    reading = [(a, b) for a, b in zip(firsts, lasts) if a >= 0]
    if any(b[0] <= a[1] for a, b in zip(reading, reading[1:])):
        raise ValueError(f"worker {plan.rank}'s pieces are not in the stream's order")
    return firsts, lasts, cuts


# ---- the counters -------------------------------------------------------------------------------


class Control:
    """The stream's counters, as 64-bit words in memory this process and worker processes map:
    ``[state, units fetched, bytes fetched, moves, position of worker 0, 1, ...]``. Each word
    has one writer (the fetch thread, or one worker); readers poll."""

    def __init__(self, consumers: int, shared: bool):
        from ..sources.sparse import memory_file

        size = 8 * (_HEADER + consumers)
        self._fd, self._map = (
            memory_file("shardload-stream", size) if shared else (-1, mmap.mmap(-1, size))
        )
        self.consumers = consumers
        self.words = memoryview(self._map).cast("q")
        for k in range(consumers):
            self.words[_HEADER + k] = NOT_ATTACHED

    @classmethod
    def attach(cls, path: str, consumers: int) -> Control | None:
        """The loader's counters, mapped here; None where they cannot be."""
        from ..sources.sparse import map_memory_file

        if type(consumers) is not int or not 0 < consumers < (1 << 20):
            return None
        mapped = map_memory_file(path, 8 * (_HEADER + consumers))
        if mapped is None:
            return None
        self = cls.__new__(cls)
        self._fd, self._map, self.consumers = -1, mapped, consumers
        self.words = memoryview(mapped).cast("q")
        return self

    @property
    def path(self) -> str | None:
        from ..sources.sparse import memory_file_path

        return None if self._fd < 0 else memory_file_path(self._fd)

    def position(self, slot: int) -> int:
        return self.words[_HEADER + slot]

    def set_position(self, slot: int, unit: int) -> None:
        self.words[_HEADER + slot] = unit

    def slowest(self) -> int:
        """The first unit some worker still needs (a worker not yet attached needs all)."""
        low = DONE
        for k in range(self.consumers):
            at = self.words[_HEADER + k]
            low = min(low, 0 if at == NOT_ATTACHED else at)
        return low

    def close(self) -> None:
        words, self.words = self.words, None
        if words is not None:
            words.release()
        self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---- the fetch ----------------------------------------------------------------------------------


class ObjectStream:
    """The fetch of a load's object bytes (module docstring). ``objects``: ``{source index:
    ObjectBytes}`` it fetches into; ``units``: ``stream_units``; ``consumers``: the workers
    that read them; ``shared``: whether worker processes map the counters; ``on_bytes(n)``:
    called with each batch's bytes (a progress bar)."""

    def __init__(
        self,
        objects: dict,
        units: Units,
        consumers: int,
        *,
        window: int | None = None,
        shared: bool = False,
        on_bytes: Callable[[int], None] | None = None,
    ):
        from ..sources.sparse import merged

        self.objects = objects
        self.layout = units
        self.units = [
            {k: merged(v) for k, v in unit.items() if k in objects} for unit in units.spans
        ]
        self.unit_bytes = [sum(e - b for v in unit.values() for b, e in v) for unit in self.units]
        self.window = window_from_env() if window is None else int(window)
        self.batch_bytes = max(1, min(BATCH_BYTES, self.window // 4))
        self.control = Control(consumers, shared)
        self.on_bytes = on_bytes
        self.error: BaseException | None = None
        #: the most bytes held at once (fetched, not yet released), for statistics and tests
        self.peak_held = 0
        self.fetched = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: list[tuple[int, int, int]] = []  # batches held: (first unit, end, bytes)
        self._held_bytes = 0
        self._fetched_to = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.unit_bytes)

    def start(self) -> ObjectStream:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardload-stream", daemon=True)
            self._thread.start()
        return self

    def consumer(self, slot: int, plan: ReadPlan) -> Consumer:
        """Worker ``slot``'s side, in this process."""
        return Consumer(self.control, slot, *piece_units(plan, self.layout), stream=self)

    def spec(self, slot: int, plan: ReadPlan) -> dict:
        """Worker ``slot``'s side, for a worker process (JSON; ``attach_consumer``)."""
        firsts, lasts, cuts = piece_units(plan, self.layout)
        return {
            "control": self.control.path,
            "consumers": self.control.consumers,
            "slot": slot,
            "units": firsts,
            "last": lasts,
            "cuts": {str(j): cut for j, cut in cuts.items()},
        }

    def close(self) -> None:
        """Stop fetching and release every byte still held. A GET in flight is not waited
        for beyond ``CLOSE_WAIT_S`` (a load stopped by its watchdog, or Ctrl-C, ends now):
        the thread releases what it holds when it ends, its writes into memory files closed
        meanwhile failing harmlessly."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
        words = self.control.words
        if words is not None and words[_STATE] == RUNNING:
            words[_STATE] = CLOSED
        if not self.fetching:
            self._release(DONE)
            self.control.close()  # else the thread still writes them: they go with it

    @property
    def fetching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the fetch thread

    def _run(self) -> None:
        words = self.control.words
        try:
            self._fetch_all(words)
        except BaseException as exc:  # noqa: BLE001 - the loader raises it
            if not self._stop.is_set():
                self.error = exc
                words[_STATE] = FAILED
        finally:
            if self._stop.is_set():
                self._release(DONE)

    def _fetch_all(self, words) -> None:
        count = len(self.units)
        pending: collections.deque[_Batch] = collections.deque()  # in flight, in order
        k = 0
        pause = POLL_S
        while not self._stop.is_set():
            moved = False
            while pending and pending[0].done.is_set():  # settled in order: F only grows
                batch = pending.popleft()
                if batch.error is not None:
                    raise batch.error
                with self._lock:
                    self._held.append((batch.first, batch.end, batch.nbytes))
                self.fetched += batch.fetched
                words[_BYTES] += batch.fetched
                words[_FETCHED] = batch.end
                if self.on_bytes is not None and batch.nbytes:
                    self.on_bytes(batch.nbytes)
                moved = True
            low = self.control.slowest()
            if self._held and self._held[0][1] <= low:  # batches every worker is past
                self._release(low)
                words[_MOVES] += 1
                moved = True
            if low >= count or (k >= count and not self._held and not pending):
                return
            if k < count and len(pending) < IN_FLIGHT:
                end, nbytes = k, 0
                while end < count and (
                    end == k or nbytes + self.unit_bytes[end] <= self.batch_bytes
                ):
                    nbytes += self.unit_bytes[end]
                    end += 1
                # the unit the slowest worker needs is fetched whatever the window holds
                if k <= low or self._held_bytes + nbytes <= self.window:
                    batch = _Batch(k, end, nbytes)
                    with self._lock:
                        self._held_bytes += nbytes
                        self._fetched_to = end
                    self.peak_held = max(self.peak_held, self._held_bytes)
                    threading.Thread(
                        target=self._fetch_batch,
                        args=(batch,),
                        daemon=True,
                        name="shardload-stream-batch",
                    ).start()
                    pending.append(batch)
                    k = end
                    pause = POLL_S
                    continue
            if moved:
                pause = POLL_S
            elif pending:
                pending[0].done.wait(pause)
                pause = min(POLL_MAX_S, pause * 2)
            else:  # no room: wait for the slowest worker to move on
                time.sleep(pause)
                pause = min(POLL_MAX_S, pause * 2)

    def _fetch_batch(self, batch: _Batch) -> None:
        try:
            for index, obj in self.objects.items():
                wanted = self._spans(batch.first, batch.end, index)
                if wanted and not self._stop.is_set():
                    batch.fetched += obj.need_spans(wanted)
        except BaseException as exc:  # noqa: BLE001 - raised by the fetch loop, in order
            batch.error = exc
        finally:
            batch.done.set()

    def _spans(self, first: int, end: int, index: int) -> list:
        """The wanted spans of source ``index`` in units ``[first, end)``."""
        return [s for unit in self.units[first:end] for s in unit.get(index, ())]

    def _release(self, low: int) -> None:
        """Release the held batches every worker is past (those ending at or before unit
        ``low``), all but the bytes of the units still held (in storage order, a batch's last
        page is often the next one's first)."""
        from ..sources.sparse import Spans
        from ..sources.store import coalesce

        with self._lock:
            done = []
            while self._held and self._held[0][1] <= low:
                done.append(self._held.pop(0))
            self._held_bytes -= sum(nbytes for _, _, nbytes in done)
            still = self.units[min(low, self._fetched_to) : self._fetched_to]
        if not done:
            return
        keep: dict[int, Spans] = {}
        for unit in still:
            for index, spans in unit.items():
                into = keep.setdefault(index, Spans())
                for b, e in spans:
                    into.add(b, e)
        for first, end, _ in done:
            for index, obj in self.objects.items():
                wanted = self._spans(first, end, index)
                if not wanted:
                    continue
                # the gaps the client read through go with the spans around them
                spans = coalesce(wanted, obj.client.max_gap)
                for b, e in keep[index].missing(spans) if index in keep else spans:
                    obj.release(b, e)


class _Batch:
    """Units ``[first, end)`` being fetched (``nbytes`` wanted), by a thread of their own."""

    __slots__ = ("done", "end", "error", "fetched", "first", "nbytes")

    def __init__(self, first: int, end: int, nbytes: int):
        self.first, self.end, self.nbytes = first, end, nbytes
        self.fetched = 0
        self.error: BaseException | None = None
        self.done = threading.Event()


# ---- the workers' side --------------------------------------------------------------------------


class Consumer:
    """One worker's side of a stream: ``at(j)`` before piece ``j`` (waits until its bytes are
    fetched), or, for a piece streamed in parts, ``parts(j, piece)`` and ``reach(unit)``
    before each part; ``finish()`` when done (or failed)."""

    def __init__(
        self,
        control: Control,
        slot: int,
        units: list[int],
        last: list[int],
        cuts: dict,
        stream: ObjectStream | None = None,
    ):
        self.control, self.slot = control, slot
        self.units, self.last, self.cuts = units, last, cuts
        self._stream = stream  # in this process: its error is raised as it is
        self.waited = 0.0
        control.set_position(slot, next((u for u in units if u >= 0), DONE))

    def ready(self, j: int) -> bool:
        """Whether all of piece ``j``'s bytes are fetched."""
        return self.last[j] < 0 or self.control.words[_FETCHED] > self.last[j]

    def fetched(self, unit: int) -> bool:
        return self.control.words[_FETCHED] > unit

    def parts(self, j: int, piece: PieceRead) -> list[tuple[int, list[Run]]] | None:
        """Piece ``j``'s runs by unit, ``[(unit, runs), ...]`` in order, for a piece streamed in
        parts; None for a piece in one unit (or none)."""
        cut = self.cuts.get(j)
        if cut is None:
            return None
        first = self.units[j]
        return [(first + k, runs) for k, runs in enumerate(split_runs(piece.runs, *cut)) if runs]

    def at(self, j: int, alive: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """Piece ``j`` is next: this worker is done with the units before its first; wait
        until all of its units are fetched. ``alive()`` is called while the load moves."""
        if self.units[j] >= 0:
            self._wait(self.units[j], self.last[j], alive, stopped)

    def reach(self, unit: int, alive: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """This worker is done with the units before ``unit``; wait until it is fetched."""
        self._wait(unit, unit, alive, stopped)

    def _wait(
        self, at: int, until: int, alive: Callable[[], None], stopped: Callable[[], bool]
    ) -> None:
        words = self.control.words
        if words[_HEADER + self.slot] != at:
            words[_HEADER + self.slot] = at
        if words[_FETCHED] > until:
            return
        start = time.perf_counter()
        pause = POLL_S
        seen = None
        while words[_FETCHED] <= until:
            state = words[_STATE]
            if state == FAILED:
                if self._stream is not None and self._stream.error is not None:
                    raise self._stream.error
                raise StreamFailed(
                    "the loader's fetch from object storage failed (the load reports its error)"
                )
            if state == CLOSED or stopped():
                raise Stopped()
            moved = (
                words[_BYTES],
                words[_MOVES],
                sum(words[_HEADER + k] for k in range(self.control.consumers)),
            )
            if moved != seen:
                seen = moved
                alive()
            time.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)
        self.waited += time.perf_counter() - start

    def finish(self) -> None:
        """This worker reads no more (done, failed or stopped)."""
        if self.control.words is not None:
            self.control.set_position(self.slot, DONE)


def worker_side(plan: ReadPlan, spec: dict | None, source, stack) -> tuple[object, Consumer | None]:
    """A worker's source and its side of the stream of the object bytes it reads, where the
    loader did not hand it one in its own process: the loader's stream (``spec``: a worker
    process maps its memory files and counters), or, where it cannot map them, or is a rank
    with no loader above it, a stream of its own over objects of its own. ``source`` is the
    loader's checkpoint, or None for a worker process (its read plan's sources are opened
    here). Closing is left to ``stack``. None where the plan reads no object."""
    if source is None:
        from ..readers.mapped import open_sources

        source = open_sources(list(plan.sources))
        stack.callback(source.close)
        if isinstance(spec, dict):
            consumer = attach_consumer(spec, plan, source)
            if consumer is not None:
                stack.callback(consumer.control.close)
                return source, consumer
            if any(obj.borrowed for obj in source.object_bytes().values()):
                # the loader's memory files without its counters: objects of its own
                source = open_sources([_unshared(s) for s in plan.sources])
                stack.callback(source.close)
    objects = source.object_bytes()
    if not objects:
        return source, None
    own = ObjectStream(objects, stream_units([plan]), 1)
    consumer = own.consumer(0, plan)
    stack.callback(own.close)
    own.start()
    return source, consumer


def _unshared(spec: dict) -> dict:
    """A source spec without the loader's memory file (its object fetched here)."""
    obj = spec.get("object")
    if isinstance(obj, dict) and "shared" in obj:
        return {**spec, "object": {k: v for k, v in obj.items() if k != "shared"}}
    return spec


def attach_consumer(spec: dict, plan: ReadPlan, source) -> Consumer | None:
    """A worker process's side of the loader's stream (``ObjectStream.spec``), where it can map
    the counters and every object's memory file; None where it cannot (it then streams for
    itself, and is marked done in the loader's counters where it could map those)."""
    control = Control.attach(spec.get("control"), spec.get("consumers"))
    if control is None:
        return None
    slot, units, last = spec.get("slot"), spec.get("units"), spec.get("last")
    cuts = _spec_cuts(spec.get("cuts"), len(plan.pieces))

    def ints(values) -> bool:
        return (
            isinstance(values, list)
            and len(values) == len(plan.pieces)
            and all(type(u) is int for u in values)
        )

    ok = (
        type(slot) is int
        and 0 <= slot < control.consumers
        and ints(units)
        and ints(last)
        and cuts is not None
    )
    borrowed = all(obj.borrowed for obj in source.object_bytes().values())
    if not ok or not borrowed:
        if type(slot) is int and 0 <= slot < control.consumers:
            control.set_position(slot, DONE)
        control.close()
        return None
    return Consumer(control, slot, units, last, cuts)


def _spec_cuts(cuts, pieces: int) -> dict | None:
    """A spec's ``{"j": [source, offsets]}`` as ``{j: (source, offsets)}``; None if it is not
    that."""
    if not isinstance(cuts, dict):
        return None
    out = {}
    for key, cut in cuts.items():
        if not (
            isinstance(key, str)
            and key.isdigit()
            and int(key) < pieces
            and isinstance(cut, list)
            and len(cut) == 2
            and type(cut[0]) is int
            and isinstance(cut[1], list)
            and all(type(c) is int for c in cut[1])
        ):
            return None
        out[int(key)] = (cut[0], tuple(cut[1]))
    return out
