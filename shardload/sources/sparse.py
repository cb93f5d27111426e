"""An object's bytes in this process: a sparse mapping of its size, filled by ranged GETs as
they are needed, and given back as they are done with.

A reader parses a header out of it as out of a mapped file (asking ``need`` first), a load
copies its pieces out of it as out of a mapped file (after ``need_spans`` of its read plan). So
everything above the sources sees one kind of bytes, mapped, whether a file or an object holds
them.

1. **The mapping** is anonymous, private and never reserved (``MAP_NORESERVE``): an object of
   100 GB costs nothing until bytes land in it, and only the pages that do.
2. **Need**: the parts of the asked spans not yet present and not already being fetched by
   another thread are fetched (``ObjectClient.fetch``: coalesced, concurrent, every GET checked
   against the object's ETag); a thread that asks for bytes another thread is fetching waits
   for them. What arrived is recorded; nothing is ever read from a part that was not.
3. **Release**: the pages lying wholly inside a released span are handed back to the kernel
   (``MADV_DONTNEED``: freed) and forgotten, so a later need fetches them again.
4. **Shared with worker processes** (``in_shared_memory``, ``shared_spec``): the bytes live
   in a memory file (``memfd``) that the loader's process fills (``pieces.stream``); each
   worker process maps that file (``from_spec``, through ``/proc/<pid>/fd``) and copies from
   it the bytes the stream says are there. Releasing in the loader's process frees the file's
   pages (``MADV_REMOVE``), for every process that maps it. A worker that cannot open the file
   gets an object of its own and fetches for itself.

>>> data = ObjectBytes(info)                                   # doctest: +SKIP
>>> data.need(0, 8); bytes(data.map[:8])                       # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import dataclasses
import mmap
import os
import threading
from collections.abc import Callable, Iterable

from .specs import ObjectSpec
from .store import ObjectClient, ObjectInfo, coalesce, default_client

__all__ = [
    "MAP_NORESERVE",
    "ObjectBytes",
    "Spans",
    "map_memory_file",
    "memory_file",
    "memory_file_path",
]

#: Linux's MAP_NORESERVE (Python's mmap module does not name it before 3.13): without it, the
#: kernel's default overcommit heuristic refuses a mapping larger than memory and swap
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
#: a thread waiting for bytes another thread fetches looks again this often (and calls its
#: ``alive`` hook, so a watchdog does not take waiting for a download for a hang)
WAIT_POLL_S = 0.25


class Spans:
    """A set of byte positions as sorted, disjoint, non-touching ``[begin, end)`` spans."""

    __slots__ = ("begins", "ends")

    def __init__(self) -> None:
        self.begins: list[int] = []
        self.ends: list[int] = []

    def __iter__(self):
        return iter(zip(self.begins, self.ends))

    def __len__(self) -> int:
        return len(self.begins)

    def total(self) -> int:
        return sum(e - b for b, e in self)

    def add(self, begin: int, end: int) -> None:
        if end <= begin:
            return
        # the spans that touch or overlap [begin, end) are merged into it
        lo = bisect.bisect_left(self.ends, begin)
        hi = bisect.bisect_right(self.begins, end)
        if lo < hi:
            begin = min(begin, self.begins[lo])
            end = max(end, self.ends[hi - 1])
        self.begins[lo:hi] = [begin]
        self.ends[lo:hi] = [end]

    def remove(self, begin: int, end: int) -> None:
        if end <= begin:
            return
        lo = bisect.bisect_right(self.ends, begin)
        hi = bisect.bisect_left(self.begins, end)
        keep_b, keep_e = [], []
        if lo < hi:
            if self.begins[lo] < begin:
                keep_b.append(self.begins[lo])
                keep_e.append(begin)
            if self.ends[hi - 1] > end:
                keep_b.append(end)
                keep_e.append(self.ends[hi - 1])
        self.begins[lo:hi] = keep_b
        self.ends[lo:hi] = keep_e

    def missing(self, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of ``spans`` (sorted, disjoint) this set does not hold."""
        out: list[tuple[int, int]] = []
        begins, ends = self.begins, self.ends
        for begin, end in spans:
            k = bisect.bisect_right(ends, begin)
            at = begin
            while at < end:
                if k == len(begins) or begins[k] >= end:
                    out.append((at, end))
                    break
                if begins[k] > at:
                    out.append((at, begins[k]))
                at = max(at, ends[k])
                k += 1
        return out


def merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, empty ones dropped, overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for begin, end in sorted(s for s in spans if s[1] > s[0]):
        if out and begin <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((begin, end))
    return out


def memory_file(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new memory file (``memfd``) of ``size`` bytes, sparse, and its shared mapping: what
    worker processes map too, through ``memory_file_path``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)  # sparse: a page takes memory when bytes land in it
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise


def memory_file_path(fd: int) -> str:
    """Where another process of this user opens this process's memory file ``fd``."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def map_memory_file(path: object, size: int) -> mmap.mmap | None:
    """Another process's memory file (``memory_file_path``), mapped shared here, if it is one
    of ``size`` bytes; None where it cannot be opened as that (the caller then does without)."""
    if not isinstance(path, str) or not path.startswith("/proc/") or size <= 0:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)  # the mapping holds the file


class ObjectBytes:
    """One object's bytes in this process (see the module docstring). Thread-safe."""

    def __init__(
        self,
        info: ObjectInfo,
        client: ObjectClient | None = None,
        _shared: tuple[int, bool] | None = None,
    ):
        self.info = info
        self.size = info.size
        self._client = client
        #: (the memory file's descriptor or -1, whether another process filled it)
        self._fd, self._borrowed = _shared if _shared is not None else (-1, False)
        if _shared is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
            self.map: mmap.mmap | None = (
                mmap.mmap(-1, info.size, flags=flags) if info.size else None
            )
        else:
            self.map = None  # set by the constructor that made the memory file
        self._have = Spans()
        self._fetching = Spans()
        self._cond = threading.Condition()
        #: bytes this process fetched (over-read between coalesced spans included)
        self.fetched = 0

    @property
    def client(self) -> ObjectClient:
        if self._client is None:
            self._client = default_client()
        return self._client

    def spec(self) -> ObjectSpec:
        """What another process needs to fetch the same object's bytes."""
        info = self.info
        return ObjectSpec(info.url, info.size, info.etag, info.last_modified)

    @classmethod
    def from_spec(cls, spec: ObjectSpec) -> ObjectBytes:
        """The object of ``spec()``; of ``shared_spec()``, the loader's memory file mapped
        (or, where it cannot be opened, an object of this process's own: ``borrowed`` says
        which)."""
        info = ObjectInfo(
            url=spec.url, size=spec.size, etag=spec.etag, last_modified=spec.last_modified
        )
        shared = spec.shared
        return (cls._borrow(info, shared) if shared is not None else None) or cls(info)

    @classmethod
    def in_shared_memory(cls, info: ObjectInfo, client: ObjectClient | None = None) -> ObjectBytes:
        """The object's bytes in a memory file that worker processes map too (module
        docstring, 4), handed over as ``shared_spec()``."""
        if not info.size:
            return cls(info, client)
        fd, mapped = memory_file("shardload-object", info.size)
        obj = cls(info, client, _shared=(fd, False))
        obj.map = mapped
        return obj

    @property
    def borrowed(self) -> bool:
        """Whether these bytes are another process's memory file, mapped here."""
        return self._borrowed

    def shared_spec(self) -> ObjectSpec:
        """``spec()`` and where this process's memory file is: what a worker process maps
        (``from_spec``)."""
        if self._fd < 0 or self._borrowed:
            return self.spec()
        return dataclasses.replace(self.spec(), shared=memory_file_path(self._fd))

    @classmethod
    def _borrow(cls, info: ObjectInfo, path: str) -> ObjectBytes | None:
        """The loader's memory file mapped here; None where it cannot be opened as that."""
        mapped = map_memory_file(path, info.size)
        if mapped is None:
            return None
        obj = cls(info, None, _shared=(-1, True))
        obj.map = mapped
        return obj

    def need(
        self, begin: int, end: int, alive: Callable[[], None] | None = None, *, small: bool = False
    ) -> int:
        """Make bytes ``[begin, end)`` present (fetching what is missing)."""
        return self.need_spans([(begin, end)], alive, small=small)

    def need_spans(
        self,
        spans: Iterable[tuple[int, int]],
        alive: Callable[[], None] | None = None,
        *,
        small: bool = False,
    ) -> int:
        """Make every span present: fetch the parts nobody has or is fetching, wait for the
        parts another thread is fetching. ``alive()`` is called while waiting. Returns the
        bytes this call fetched. ``small``: a header an open waits for (``ObjectClient.fetch``:
        not one of the GETs that pace a load)."""
        want = merged((max(0, b), min(self.size, e)) for b, e in spans)
        mine_total = 0
        while True:
            with self._cond:
                missing = self._have.missing(want)
                if not missing:
                    return mine_total
                # the gaps the client will read through are claimed too, so that another
                # thread needing bytes in them waits for them rather than fetching them again
                mine = self._fetching.missing(
                    coalesce(self._fetching.missing(missing), self.client.max_gap)
                )
                if not mine:  # all of it is on its way, in other threads
                    self._cond.wait(WAIT_POLL_S)
                    if alive is not None:
                        alive()
                    continue
                for b, e in mine:
                    self._fetching.add(b, e)
            ok = False
            try:
                if self.map is None:  # closed meanwhile (an empty object misses nothing)
                    raise ValueError(f"{self.info.url}: its bytes were closed")
                with memoryview(self.map) as into:  # each GET lands in place
                    fetch = self.client.fetch
                    n = (
                        fetch(self.info, mine, into=into, small=True)
                        if small
                        else fetch(self.info, mine, into=into)
                    )
                ok = True
            finally:
                with self._cond:
                    for b, e in mine:
                        self._fetching.remove(b, e)
                        if ok:
                            self._have.add(b, e)
                    if ok:
                        self.fetched += n
                        mine_total += n
                    self._cond.notify_all()

    def present(self, begin: int, end: int) -> bool:
        with self._cond:
            return not self._have.missing([(begin, end)])

    def present_spans(self) -> list[tuple[int, int]]:
        """The ``[begin, end)`` spans fetched and still held, in order."""
        with self._cond:
            return list(self._have)

    def release(self, begin: int, end: int) -> None:
        """Hand back the pages wholly inside ``[begin, end)`` (they are fetched again if
        needed again). The owner of a memory file frees its pages for every process that maps
        it (``MADV_REMOVE``); ``MADV_DONTNEED`` would drop this mapping's view only."""
        page = mmap.PAGESIZE
        first = -(-begin // page) * page
        last = end // page * page if end < self.size else self.size
        if self.map is None or last <= first:
            return
        with self._cond:
            if not self._borrowed:  # a borrowed file keeps its pages: only this view drops
                self._have.remove(first, last)
            advice = (
                mmap.MADV_REMOVE
                if self._fd >= 0 and hasattr(mmap, "MADV_REMOVE")
                else mmap.MADV_DONTNEED
            )
            try:
                self.map.madvise(advice, first, last - first)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        m, self.map = self.map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view still alive: it goes with the last one
                pass
