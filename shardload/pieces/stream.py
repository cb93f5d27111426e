"""A load's bytes of objects in object storage, streamed: fetched once, in the order the workers
read them, while they read, in a bounded window of memory. This module wires the workers to
the fetch; the other parts live beside it, one job each:

* ``units``: the units the load's read plans make (pure planning: ``stream_units``);
* ``counters``: the shared words the fetch and the workers meet in (``Control``);
* ``fetcher``: the fetch itself, within the window (``ObjectFetch``, ``window_from_env``).

Lifecycle (``streams_for_load``, the loader's one call; ``worker_side`` where a worker has no
loader in its process, or cannot share its stream):

1. **Units.** Every worker's read plan takes the load's parameters in one order; a unit is one
   parameter (or one part of a large one) of every worker's spans (``units``).
2. **Fetch.** An ``ObjectStream`` fetches the units in that order within its window
   (``fetcher``): one for the workers in the loader's process, into the checkpoint's own
   mapping of each object, one for those in other processes, into memory files they map.
3. **Consume.** Before each piece, or each part of one, a worker says which unit it is on
   (``Consumer.at``, ``Consumer.reach``) and waits until that unit is fetched; the units
   before the slowest worker's are released.
4. **Shared.** A worker process gets its side as a ``StreamSpec`` (JSON) and maps the
   counters and the objects' memory files through ``/proc/<pid>/fd``; a worker that cannot
   marks itself done (``DONE``) and streams for itself.
5. **Seen.** A waiting worker reports progress only while the load moves (bytes arrive, or a
   worker moves on): a fetch that stops is a stall the session's watchdog sees, named. A fetch
   that fails sets the state to ``FAILED``: the waiting workers stop, and the loader raises
   the fetch's own error (``ObjectStream.error``).

>>> plans, streams, sides = streams_for_load(ckpt, plans, here={0}, stack=stack)  # doctest: +SKIP
>>> for stream in streams: stream.start()                                         # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..errors import ShardloadError
from ..readers.base import Checkpoint
from ..readplan import PieceRead, ReadPlan, Run
from ..sessions import Stopped
from ..sources.bytesource import fetched_objects, objects_in_shared_memory
from ..sources.sparse import ObjectBytes
from ..sources.specs import FileSource
from .counters import (
    BYTES,
    CLOSED,
    DONE,
    FAILED,
    FETCHED,
    MOVES,
    POLL_MAX_S,
    POLL_S,
    STATE,
    Control,
)
from .fetcher import DEFAULT_WINDOW_BYTES, WINDOW_ENV, ObjectFetch, window_from_env
from .units import PART_BYTES, Cut, Units, piece_units, split_runs, stream_units

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "PART_BYTES",
    "WINDOW_ENV",
    "Consumer",
    "Control",
    "ObjectStream",
    "StreamFailed",
    "StreamSpec",
    "Units",
    "attach_consumer",
    "piece_units",
    "split_runs",
    "stream_units",
    "streams_for_load",
    "window_from_env",
    "worker_side",
]


class StreamFailed(ShardloadError):
    """The load's fetch from object storage failed; the loader raises its own error."""


@dataclass(frozen=True)
class StreamSpec:
    """Worker ``slot``'s side of a stream, for a worker process: where the counters are
    (``control``, shared by ``consumers`` workers), each piece's first and last unit (-1 for
    a piece that reads no object) and the cuts of the pieces streamed in parts.

    >>> spec = StreamSpec("/proc/1/fd/5", 2, 1, (0, -1), (3, -1), {0: (0, (16, 32, 48))})
    >>> StreamSpec.from_json(spec.to_json(), pieces=2) == spec
    True
    """

    control: str | None
    consumers: int
    slot: int
    units: tuple[int, ...]
    last: tuple[int, ...]
    cuts: dict[int, Cut]

    def to_json(self) -> dict[str, Any]:
        return {
            "control": self.control,
            "consumers": self.consumers,
            "slot": self.slot,
            "units": list(self.units),
            "last": list(self.last),
            "cuts": {str(j): [source, list(at)] for j, (source, at) in self.cuts.items()},
        }

    @classmethod
    def from_json(cls, data: object, pieces: int) -> StreamSpec:
        """The spec ``to_json`` wrote, for a plan of ``pieces`` pieces; a ``ValueError``
        naming the field that is not what it must be."""

        def bad(field: str, must: str) -> ValueError:
            return ValueError(f"a stream spec's {field!r} is not {must}")

        if not isinstance(data, dict):
            raise ValueError(f"a stream spec is not an object: {type(data).__name__}")
        control, consumers, slot = data.get("control"), data.get("consumers"), data.get("slot")
        if control is not None and not isinstance(control, str):
            raise bad("control", "a path or null")
        if not _whole(consumers) or not consumers > 0:
            raise bad("consumers", "a positive whole number")
        if not _whole(slot) or not 0 <= slot < consumers:
            raise bad("slot", f"a whole number below {consumers}")
        columns = []
        for field in ("units", "last"):
            values = data.get(field)
            if not isinstance(values, list) or len(values) != pieces:
                raise bad(field, f"a list of {pieces} whole numbers, one per piece")
            if not all(_whole(u) for u in values):
                raise bad(field, "a list of whole numbers")
            columns.append(tuple(values))
        raw = data.get("cuts")
        if not isinstance(raw, dict):
            raise bad("cuts", "an object")
        cuts: dict[int, Cut] = {}
        for key, cut in raw.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < pieces):
                raise bad("cuts", f"keyed by piece numbers below {pieces} ({key!r})")
            if not (
                isinstance(cut, list)
                and len(cut) == 2
                and _whole(cut[0])
                and isinstance(cut[1], list)
                and all(_whole(c) for c in cut[1])
            ):
                raise bad(f"cuts/{key}", "[source, [offsets, ...]] of whole numbers")
            cuts[int(key)] = (cut[0], tuple(cut[1]))
        return cls(control, consumers, slot, columns[0], columns[1], cuts)


def _whole(value: object) -> TypeGuard[int]:
    return type(value) is int


class ObjectStream(ObjectFetch):
    """The fetch of a load's object bytes (``fetcher.ObjectFetch``) for ``consumers`` workers
    of the plans ``units`` was made of, with their sides: ``consumer`` for a worker in this
    process, ``spec`` for a worker process (``shared``: the counters in a memory file)."""

    def __init__(
        self,
        objects: Mapping[int, ObjectBytes],
        units: Units,
        consumers: int,
        *,
        window: int | None = None,
        shared: bool = False,
        on_bytes: Callable[[int], None] | None = None,
    ):
        super().__init__(
            objects, units.spans, Control(consumers, shared), window=window, on_bytes=on_bytes
        )
        self.layout = units

    def start(self) -> ObjectStream:
        super().start()
        return self

    def consumer(self, slot: int, plan: ReadPlan) -> Consumer:
        """Worker ``slot``'s side, in this process."""
        units, last, cuts = piece_units(plan, self.layout)
        return Consumer(self.control, slot, units, last, cuts, stream=self)

    def spec(self, slot: int, plan: ReadPlan) -> StreamSpec:
        """Worker ``slot``'s side, for a worker process (``attach_consumer``)."""
        units, last, cuts = piece_units(plan, self.layout)
        return StreamSpec(
            self.control.path, self.control.consumers, slot, tuple(units), tuple(last), cuts
        )


# ---- the workers' side --------------------------------------------------------------------------


class Consumer:
    """One worker's side of a stream: ``at(j)`` before piece ``j`` (waits until its bytes are
    fetched), or, for a piece streamed in parts, ``parts(j, piece)`` and ``reach(unit)``
    before each part; ``finish()`` when done (or failed)."""

    def __init__(
        self,
        control: Control,
        slot: int,
        units: list[int] | tuple[int, ...],
        last: list[int] | tuple[int, ...],
        cuts: Mapping[int, Cut],
        stream: ObjectStream | None = None,
    ):
        self.control, self.slot = control, slot
        self.units, self.last, self.cuts = units, last, cuts
        self._stream = stream  # in this process: its error is raised as it is
        self.waited = 0.0
        control.set_position(slot, next((u for u in units if u >= 0), DONE))

    def ready(self, j: int) -> bool:
        """Whether all of piece ``j``'s bytes are fetched."""
        return self.last[j] < 0 or self.control.live[FETCHED] > self.last[j]

    def fetched(self, unit: int) -> bool:
        return self.control.live[FETCHED] > unit

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
        control = self.control
        words = control.live
        if control.position(self.slot) != at:
            control.set_position(self.slot, at)
        if words[FETCHED] > until:
            return
        start = time.perf_counter()
        pause = POLL_S
        seen = None
        while words[FETCHED] <= until:
            state = words[STATE]
            if state == FAILED:
                if self._stream is not None and self._stream.error is not None:
                    raise self._stream.error
                raise StreamFailed(
                    "the loader's fetch from object storage failed (the load reports its error)"
                )
            if state == CLOSED or stopped():
                raise Stopped()
            moved = (words[BYTES], words[MOVES], control.positions())
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


def streams_for_load(
    source: Checkpoint, plans: dict[int, ReadPlan], here: set[int], stack: contextlib.ExitStack
) -> tuple[dict[int, ReadPlan], list[ObjectStream], dict[int, Consumer | dict[str, Any]]]:
    """The streams that fetch the bytes the workers read of objects in object storage: one
    for the workers in this process (``here``), into the checkpoint's own mapping of each
    object, and one for those in other processes, into memory files they map; each fetches
    the union of its workers' spans once, in their order, within the window. Returns the read
    plans (those of other processes naming the memory files), the streams (not started; closed
    by ``stack``), and each worker's side: a ``Consumer`` here, a ``StreamSpec``'s JSON for
    the others."""
    objects = fetched_objects(source.byte_sources)
    if not objects:
        return plans, [], {}
    streams: list[ObjectStream] = []
    sides: dict[int, Consumer | dict[str, Any]] = {}
    groups = ([i for i in plans if i in here], [i for i in plans if i not in here])
    for shared, ranks in enumerate(groups):
        if not ranks:
            continue
        into = objects
        if shared:
            sources, into = objects_in_shared_memory(source.sources(), objects)
            stack.callback(_close_all, into)
            plans = {
                i: dataclasses.replace(plan, sources=tuple(sources)) if i in ranks else plan
                for i, plan in plans.items()
            }
        stream = ObjectStream(
            into, stream_units([plans[i] for i in ranks]), len(ranks), shared=bool(shared)
        )
        stack.callback(stream.close)
        streams.append(stream)
        for slot, i in enumerate(ranks):
            if shared:
                sides[i] = stream.spec(slot, plans[i]).to_json()
            else:
                sides[i] = stream.consumer(slot, plans[i])
    return plans, streams, sides


def _close_all(objects: Mapping[int, ObjectBytes]) -> None:
    for obj in objects.values():
        obj.close()


def worker_side(
    plan: ReadPlan, spec: object, source: Checkpoint | None, stack: contextlib.ExitStack
) -> tuple[Checkpoint, Consumer | None]:
    """A worker's source and its side of the stream of the object bytes it reads, where the
    loader did not hand it one in its own process: the loader's stream (``spec``, a
    ``StreamSpec``'s JSON: a worker process maps its memory files and counters), or, where it
    cannot map them, or is a rank with no loader above it, a stream of its own over objects of
    its own. ``source`` is the loader's checkpoint, or None for a worker process (its read
    plan's sources are opened here). Closing is left to ``stack``. None where the plan reads no
    object."""
    if source is None:
        from ..readers.mapped import open_sources

        source = open_sources(list(plan.sources))
        stack.callback(source.close)
        if spec is not None:
            consumer = attach_consumer(StreamSpec.from_json(spec, len(plan.pieces)), source)
            if consumer is not None:
                stack.callback(consumer.control.close)
                return source, consumer
            if any(obj.borrowed for obj in fetched_objects(source.byte_sources).values()):
                # the loader's memory files without its counters: objects of its own
                source = open_sources(
                    [s.unshared() if isinstance(s, FileSource) else s for s in plan.sources]
                )
                stack.callback(source.close)
    objects = fetched_objects(source.byte_sources)
    if not objects:
        return source, None
    own = ObjectStream(objects, stream_units([plan]), 1)
    consumer = own.consumer(0, plan)
    stack.callback(own.close)
    own.start()
    return source, consumer


def attach_consumer(spec: StreamSpec, source: Checkpoint) -> Consumer | None:
    """A worker process's side of the loader's stream, where it can map the counters and
    every object's memory file; None where it cannot (it then streams for itself, and is
    marked done in the loader's counters where it could map those)."""
    control = Control.attach(spec.control, spec.consumers)
    if control is None:
        return None
    if not all(obj.borrowed for obj in fetched_objects(source.byte_sources).values()):
        control.set_position(spec.slot, DONE)
        control.close()
        return None
    return Consumer(control, spec.slot, spec.units, spec.last, spec.cuts)
