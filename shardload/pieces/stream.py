"""A load's bytes of objects in object storage, streamed: fetched once, in the order the workers
read them, while they read, in a bounded window of memory.

Lifecycle (``ObjectStream``, made by the loader for the workers of its load, or by a worker
for itself where it cannot share the loader's):

1. **Units.** Every worker's read plan takes the load's parameters in one order (each plan's
   pieces are a subsequence of it). A unit is one parameter: the union of every worker's byte
   spans of it, per object source (``stream_units``). Units without object bytes cost nothing.
2. **Fetch.** One thread fetches the units in that order, in batches of about
   ``batch_bytes`` (each a coalesced, concurrent set of GETs: ``ObjectBytes.need_spans``;
   ``IN_FLIGHT`` batches at once, settled in order), while the bytes held, from the first
   unit a worker still needs to the last fetched, stay within ``window`` bytes. The unit the slowest worker needs is fetched whatever its size:
   the bound is ``max(window, the largest batch)``.
3. **Consume.** Before each piece a worker says which unit it is on (``Consumer.at``) and waits
   until that unit is fetched. Every unit before the slowest worker's is done with: its bytes
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

import collections
import heapq
import mmap
import os
import threading
import time
from typing import Callable, Optional

from ..errors import ShardloadError
from ..readplan import ReadPlan
from ..sessions import Stopped

__all__ = ["ObjectStream", "Consumer", "Control", "StreamFailed", "stream_units",
           "worker_side", "attach_consumer", "DEFAULT_WINDOW_BYTES", "window_from_env", "WINDOW_ENV"]

#: the window's default: bytes of objects held at once by a load's process, besides what the
#: workers keep (``$SHARDLOAD_OBJECT_WINDOW_MB``)
DEFAULT_WINDOW_BYTES = 1 << 30
WINDOW_ENV = "SHARDLOAD_OBJECT_WINDOW_MB"
#: a batch is at most this, and at most a quarter of the window (fetching overlaps reading);
#: this many are fetched at once, so that one's slowest GET does not leave the pipe idle
BATCH_BYTES = 64 << 20
IN_FLIGHT = 2
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
        raise ValueError(f"{WINDOW_ENV}={text!r} must be a positive number of MiB (default "
                         f"{DEFAULT_WINDOW_BYTES >> 20})")
    return max(1, int(value * (1 << 20)))


# ---- units --------------------------------------------------------------------------------------

def _object_sources(plan: ReadPlan) -> set[int]:
    return {k for k, spec in enumerate(plan.sources) if spec.get("object") is not None}


def _run_spans(run) -> list[tuple[int, int]]:
    stride = run.stride or run.nbytes
    if run.count == 1 or stride == run.nbytes:
        return [(run.offset, run.offset + run.count * run.nbytes)]
    return [(a, a + run.nbytes) for a in range(run.offset, run.offset + run.count * stride,
                                               stride)]


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
        raise ValueError("the workers' read plans take the parameters in orders that "
                         "contradict each other; they cannot share one stream")
    return order


def stream_units(plans: list[ReadPlan]) -> tuple[list[str], list[dict[int, list]]]:
    """The load's units in the workers' order: their names, and each one's byte spans by
    object source (unsorted, overlapping as the workers' are; empty for a unit no worker reads
    from an object)."""
    names = _merged_order(plans)
    position = {name: k for k, name in enumerate(names)}
    spans: list[dict[int, list]] = [{} for _ in names]
    for plan in plans:
        remote = _object_sources(plan)
        if not remote:
            continue
        for piece in plan.pieces:
            out = spans[position[piece.name]]
            for run in piece.runs:
                if run.source in remote:
                    out.setdefault(run.source, []).extend(_run_spans(run))
    return names, spans


def piece_units(plan: ReadPlan, names: list[str]) -> list[int]:
    """Each piece's unit, or -1 for a piece that reads no object; rising (``_merged_order``)."""
    position = {name: k for k, name in enumerate(names)}
    remote = _object_sources(plan)
    units = [position[p.name] if any(r.source in remote for r in p.runs) else -1
             for p in plan.pieces]
    reading = [u for u in units if u >= 0]
    if any(a >= b for a, b in zip(reading, reading[1:])):
        raise ValueError(f"worker {plan.rank}'s pieces are not in the stream's order")
    return units


# ---- the counters -------------------------------------------------------------------------------

class Control:
    """The stream's counters, as 64-bit words in memory this process and worker processes map:
    ``[state, units fetched, bytes fetched, moves, position of worker 0, 1, ...]``. Each word
    has one writer (the fetch thread, or one worker); readers poll."""

    def __init__(self, consumers: int, shared: bool):
        from ..sources.sparse import memory_file

        size = 8 * (_HEADER + consumers)
        self._fd, self._map = memory_file("shardload-stream", size) if shared \
            else (-1, mmap.mmap(-1, size))
        self.consumers = consumers
        self.words = memoryview(self._map).cast("q")
        for k in range(consumers):
            self.words[_HEADER + k] = NOT_ATTACHED

    @classmethod
    def attach(cls, path: str, consumers: int) -> Optional["Control"]:
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
    def path(self) -> Optional[str]:
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

    def __init__(self, objects: dict, units: tuple[list[str], list[dict[int, list]]],
                 consumers: int, *, window: Optional[int] = None, shared: bool = False,
                 on_bytes: Optional[Callable[[int], None]] = None):
        from ..sources.sparse import merged

        self.objects = objects
        self.names, spans = units
        self.units = [{k: merged(v) for k, v in unit.items() if k in objects}
                      for unit in spans]
        self.unit_bytes = [sum(e - b for v in unit.values() for b, e in v)
                           for unit in self.units]
        self.window = window_from_env() if window is None else int(window)
        self.batch_bytes = max(1, min(BATCH_BYTES, self.window // 4))
        self.control = Control(consumers, shared)
        self.on_bytes = on_bytes
        self.error: Optional[BaseException] = None
        #: the most bytes held at once (fetched, not yet released), for statistics and tests
        self.peak_held = 0
        self.fetched = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._held: list[tuple[int, int, int]] = []   # batches held: (first unit, end, bytes)
        self._held_bytes = 0
        self._fetched_to = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.unit_bytes)

    def start(self) -> "ObjectStream":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardload-stream",
                                            daemon=True)
            self._thread.start()
        return self

    def consumer(self, slot: int, plan: ReadPlan) -> "Consumer":
        """Worker ``slot``'s side, in this process."""
        return Consumer(self.control, slot, piece_units(plan, self.names), self)

    def spec(self, slot: int, plan: ReadPlan) -> dict:
        """Worker ``slot``'s side, for a worker process (JSON; ``attach_consumer``)."""
        return {"control": self.control.path, "consumers": self.control.consumers,
                "slot": slot, "units": piece_units(plan, self.names)}

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
            self.control.close()   # else the thread still writes them: they go with it

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
            while pending and pending[0].done.is_set():   # settled in order: F only grows
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
            if self._held and self._held[0][1] <= low:   # batches every worker is past
                self._release(low)
                words[_MOVES] += 1
                moved = True
            if low >= count or (k >= count and not self._held and not pending):
                return
            if k < count and len(pending) < IN_FLIGHT:
                end, nbytes = k, 0
                while end < count and (end == k or
                                       nbytes + self.unit_bytes[end] <= self.batch_bytes):
                    nbytes += self.unit_bytes[end]
                    end += 1
                # the unit the slowest worker needs is fetched whatever the window holds
                if k <= low or self._held_bytes + nbytes <= self.window:
                    batch = _Batch(k, end, nbytes)
                    with self._lock:
                        self._held_bytes += nbytes
                        self._fetched_to = end
                    self.peak_held = max(self.peak_held, self._held_bytes)
                    threading.Thread(target=self._fetch_batch, args=(batch,), daemon=True,
                                     name="shardload-stream-batch").start()
                    pending.append(batch)
                    k = end
                    pause = POLL_S
                    continue
            if moved:
                pause = POLL_S
            elif pending:
                pending[0].done.wait(pause)
                pause = min(POLL_MAX_S, pause * 2)
            else:   # no room: wait for the slowest worker to move on
                time.sleep(pause)
                pause = min(POLL_MAX_S, pause * 2)

    def _fetch_batch(self, batch: "_Batch") -> None:
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
            still = self.units[min(low, self._fetched_to):self._fetched_to]
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
                for b, e in (keep[index].missing(spans) if index in keep else spans):
                    obj.release(b, e)


class _Batch:
    """Units ``[first, end)`` being fetched (``nbytes`` wanted), by a thread of their own."""

    __slots__ = ("first", "end", "nbytes", "fetched", "error", "done")

    def __init__(self, first: int, end: int, nbytes: int):
        self.first, self.end, self.nbytes = first, end, nbytes
        self.fetched = 0
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


# ---- the workers' side --------------------------------------------------------------------------

class Consumer:
    """One worker's side of a stream: ``at(j)`` before piece ``j`` (waits until its bytes are
    fetched), ``finish()`` when done (or failed)."""

    def __init__(self, control: Control, slot: int, units: list[int],
                 stream: Optional[ObjectStream] = None):
        self.control, self.slot, self.units = control, slot, units
        self._stream = stream   # in this process: its error is raised as it is
        self.waited = 0.0
        control.set_position(slot, next((u for u in units if u >= 0), DONE))

    def ready(self, j: int) -> bool:
        unit = self.units[j]
        return unit < 0 or self.control.words[_FETCHED] > unit

    def at(self, j: int, alive: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """Piece ``j`` is next: this worker is done with the units before its own; wait until
        its unit is fetched. ``alive()`` is called while the load moves."""
        unit = self.units[j]
        if unit < 0:
            return
        words = self.control.words
        if words[_HEADER + self.slot] != unit:
            words[_HEADER + self.slot] = unit
        if words[_FETCHED] > unit:
            return
        start = time.perf_counter()
        pause = POLL_S
        seen = None
        while words[_FETCHED] <= unit:
            state = words[_STATE]
            if state == FAILED:
                if self._stream is not None and self._stream.error is not None:
                    raise self._stream.error
                raise StreamFailed("the loader's fetch from object storage failed (the load "
                                   "reports its error)")
            if state == CLOSED or stopped():
                raise Stopped()
            moved = (words[_BYTES], words[_MOVES],
                     sum(words[_HEADER + k] for k in range(self.control.consumers)))
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


def worker_side(plan: ReadPlan, spec: Optional[dict], source, stack
                ) -> tuple[object, Optional[Consumer]]:
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


def attach_consumer(spec: dict, plan: ReadPlan, source) -> Optional[Consumer]:
    """A worker process's side of the loader's stream (``ObjectStream.spec``), where it can map
    the counters and every object's memory file; None where it cannot (it then streams for
    itself, and is marked done in the loader's counters where it could map those)."""
    control = Control.attach(spec.get("control"), spec.get("consumers"))
    if control is None:
        return None
    slot, units = spec.get("slot"), spec.get("units")
    ok = (type(slot) is int and 0 <= slot < control.consumers and isinstance(units, list)
          and len(units) == len(plan.pieces) and all(type(u) is int for u in units))
    borrowed = all(obj.borrowed for obj in source.object_bytes().values())
    if not ok or not borrowed:
        if type(slot) is int and 0 <= slot < control.consumers:
            control.set_position(slot, DONE)
        control.close()
        return None
    return Consumer(control, slot, units)
