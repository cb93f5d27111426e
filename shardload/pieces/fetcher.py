"""The fetch of a load's object bytes: units fetched in order, in batches, within a window.

Lifecycle (``ObjectFetch``):

1. **Start.** One scheduling thread and one executor of ``IN_FLIGHT`` batch threads start,
   and live as long as the fetch: they end when it is done, has failed, or is closed.
2. **Fetch.** The scheduler hands the units to the pool in order, in batches of about
   ``batch_bytes`` (each a coalesced, concurrent set of GETs: ``ObjectBytes.need_spans``;
   ``IN_FLIGHT`` batches at once, settled in order), while the bytes held, from the first unit
   a worker still needs to the last fetched, stay within ``window`` bytes. The unit the slowest
   worker needs is fetched whatever its size: the bound is ``max(window, the largest batch)``.
3. **Release.** Every batch the slowest worker is past is released (pages freed,
   ``ObjectBytes.release``), except the bytes a held unit still needs.
4. **Fail.** A batch that fails sets the state to ``FAILED``: waiting workers stop, and the
   loader raises the batch's own error (``error``).
5. **Close.** The scheduler and the executor stop and are joined (a GET in flight is waited
   for at most ``CLOSE_WAIT_S``: a load stopped by its watchdog, or Ctrl-C, ends now); every
   byte still held is released, by ``close``, or, past that wait, by the last batch to end.

>>> fetch = ObjectFetch(objects, unit_spans, Control(2, shared=False))  # doctest: +SKIP
>>> fetch.start(); ...; fetch.close()                                 # doctest: +SKIP
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from ..envvars import env_number
from ..sources.sparse import ObjectBytes, Spans, merged
from ..sources.store import coalesce
from .counters import (
    BYTES,
    CLOSED,
    DONE,
    FAILED,
    FETCHED,
    MOVES,
    POLL_MAX_S,
    POLL_S,
    RUNNING,
    STATE,
    Control,
)
from .units import UnitSpans

__all__ = [
    "BATCH_BYTES",
    "CLOSE_WAIT_S",
    "DEFAULT_WINDOW_BYTES",
    "IN_FLIGHT",
    "WINDOW_ENV",
    "ObjectFetch",
    "window_from_env",
]

#: the window's default: bytes of objects held at once by a load's process, besides what the
#: workers keep (``$SHARDLOAD_OBJECT_WINDOW_MB``)
DEFAULT_WINDOW_BYTES = 1 << 30
WINDOW_ENV = "SHARDLOAD_OBJECT_WINDOW_MB"
#: a batch is at most this, and at most a quarter of the window (fetching overlaps reading);
#: this many are fetched at once, so that one's slowest GET does not leave the pipe idle
BATCH_BYTES = 64 << 20
IN_FLIGHT = 2
#: seconds ``close`` waits for a GET in flight
CLOSE_WAIT_S = 1.0


def window_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The window in bytes, from ``$SHARDLOAD_OBJECT_WINDOW_MB`` (a positive number of MiB)
    or the default; a bad value is a ``ValueError`` naming the variable.

    >>> window_from_env({WINDOW_ENV: "1.5"})
    1572864
    """
    mib = env_number(
        WINDOW_ENV,
        DEFAULT_WINDOW_BYTES >> 20,
        parse=float,
        low=1 / 1024,
        high=(1 << 30) - 1,
        what="a number of MiB",
        environ=environ,
    )
    assert mib is not None  # no value turns it off
    return max(1, int(mib * (1 << 20)))


class _Batch:
    """Units ``[first, end)`` being fetched (``nbytes`` wanted)."""

    __slots__ = ("done", "end", "error", "fetched", "first", "nbytes")

    def __init__(self, first: int, end: int, nbytes: int):
        self.first, self.end, self.nbytes = first, end, nbytes
        self.fetched = 0
        self.error: BaseException | None = None
        self.done = threading.Event()


class ObjectFetch:
    """The fetch of a load's object bytes (module docstring). ``objects``: ``{source index:
    ObjectBytes}`` it fetches into; ``spans``: each unit's byte spans by source
    (``Units.spans``); ``control``: the counters it writes and the workers' positions it
    reads; ``on_bytes(n)``: called with each batch's bytes (a progress bar)."""

    def __init__(
        self,
        objects: Mapping[int, ObjectBytes],
        spans: Sequence[UnitSpans],
        control: Control,
        *,
        window: int | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ):
        self.objects = dict(objects)
        self.units = [{k: merged(v) for k, v in unit.items() if k in objects} for unit in spans]
        self.unit_bytes = [sum(e - b for v in unit.values() for b, e in v) for unit in self.units]
        self.window = window_from_env() if window is None else int(window)
        self.batch_bytes = max(1, min(BATCH_BYTES, self.window // 4))
        self.control = control
        self.on_bytes = on_bytes
        self.error: BaseException | None = None
        #: the most bytes held at once (fetched, not yet released), for statistics and tests
        self.peak_held = 0
        self.fetched = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._batches: list[Future[None]] = []  # every batch handed to the pool
        self._lock = threading.Lock()
        self._held: list[tuple[int, int, int]] = []  # batches held: (first unit, end, bytes)
        self._held_bytes = 0
        self._fetched_to = 0
        self._running = 0  # the scheduler, and the batches handed to the pool, not yet ended
        self._finished = False

    @property
    def total_bytes(self) -> int:
        return sum(self.unit_bytes)

    def start(self) -> ObjectFetch:
        if self._thread is None:
            self._running = 1
            self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="shardload-stream-batch")
            self._thread = threading.Thread(target=self._run, name="shardload-stream", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop fetching, join the threads and release every byte still held (module
        docstring, step 5). A thread still in a GET after ``CLOSE_WAIT_S`` releases what it
        holds when it ends, its writes into memory files closed meanwhile failing harmlessly."""
        self._stop.set()
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            late = wait(self._batches, max(0.0, deadline - time.monotonic())).not_done
            if not late:  # every batch ended: the threads are idle, joined at once
                self._pool.shutdown(wait=True)
        words = self.control.words
        if words is not None and words[STATE] == RUNNING:
            words[STATE] = CLOSED
        with self._lock:
            last = self._running == 0
        if last:
            self._finish()  # else the last thread to end does

    @property
    def fetching(self) -> bool:
        """Whether a thread of this fetch still runs."""
        running = self._thread is not None and self._thread.is_alive()
        return running or not all(batch.done() for batch in self._batches)

    def _ended(self, _batch: Future[None] | None = None) -> None:
        """The scheduler or a batch ends: the last, once closed, releases what is held."""
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last and self._stop.is_set():
            self._finish()

    def _finish(self) -> None:
        """Release every byte still held and close the counters, once."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self._release(DONE)
        self.control.close()

    # -- the scheduling thread

    def _run(self) -> None:
        try:
            self._fetch_all()
        except BaseException as exc:  # noqa: BLE001 - the loader raises it
            if not self._stop.is_set():
                self.error = exc
                self.control.set(STATE, FAILED)
        finally:
            if self._pool is not None:  # nothing more to hand it: its threads end when idle
                self._pool.shutdown(wait=False)
            self._ended()

    def _settle(self, pending: collections.deque[_Batch]) -> bool:
        """Take the batches done at the head of ``pending`` as fetched, in order (the count of
        units fetched only grows); whether any was."""
        control = self.control
        moved = False
        while pending and pending[0].done.is_set():
            batch = pending.popleft()
            if batch.error is not None:
                raise batch.error
            with self._lock:
                self._held.append((batch.first, batch.end, batch.nbytes))
            self.fetched += batch.fetched
            control.add(BYTES, batch.fetched)
            control.set(FETCHED, batch.end)
            if self.on_bytes is not None and batch.nbytes:
                self.on_bytes(batch.nbytes)
            moved = True
        return moved

    def _next_batch(self, k: int, low: int) -> _Batch | None:
        """The batch from unit ``k``, where the window has room for it (or the slowest
        worker, at unit ``low``, needs it)."""
        count = len(self.units)
        end, nbytes = k, 0
        while end < count and (end == k or nbytes + self.unit_bytes[end] <= self.batch_bytes):
            nbytes += self.unit_bytes[end]
            end += 1
        if k > low and self._held_bytes + nbytes > self.window:
            return None
        with self._lock:
            self._held_bytes += nbytes
            self._fetched_to = end
        self.peak_held = max(self.peak_held, self._held_bytes)
        return _Batch(k, end, nbytes)

    def _fetch_all(self) -> None:
        assert self._pool is not None  # started
        count = len(self.units)
        pending: collections.deque[_Batch] = collections.deque()  # in flight, in order
        k = 0
        pause = POLL_S
        while not self._stop.is_set():
            moved = self._settle(pending)
            low = self.control.slowest()
            if self._held and self._held[0][1] <= low:  # batches every worker is past
                self._release(low)
                self.control.add(MOVES, 1)
                moved = True
            if low >= count or (k >= count and not self._held and not pending):
                return
            if k < count and len(pending) < IN_FLIGHT:
                batch = self._next_batch(k, low)
                if batch is not None:
                    self._hand(batch)
                    pending.append(batch)
                    k = batch.end
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

    # -- the batch threads

    def _hand(self, batch: _Batch) -> None:
        """``batch`` to the pool, counted until it ends (``_ended``)."""
        assert self._pool is not None  # started
        with self._lock:
            self._running += 1
        try:
            future = self._pool.submit(self._fetch_batch, batch)
        except BaseException:  # closed meanwhile: the pool takes no more
            self._ended()
            raise
        self._batches.append(future)
        future.add_done_callback(self._ended)

    def _fetch_batch(self, batch: _Batch) -> None:
        try:
            for index, obj in self.objects.items():
                wanted = self._spans(batch.first, batch.end, index)
                if wanted and not self._stop.is_set():
                    batch.fetched += obj.need_spans(wanted)
        except BaseException as exc:  # noqa: BLE001 - raised by the scheduler, in order
            batch.error = exc
        finally:
            batch.done.set()

    def _spans(self, first: int, end: int, index: int) -> list[tuple[int, int]]:
        """The wanted spans of source ``index`` in units ``[first, end)``."""
        return [s for unit in self.units[first:end] for s in unit.get(index, ())]

    def _release(self, low: int) -> None:
        """Release the held batches every worker is past (those ending at or before unit
        ``low``), all but the bytes of the units still held (in storage order, a batch's last
        page is often the next one's first)."""
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
