"""One data file's bytes as a reader and a load see them, whether a local file or an object in
object storage holds them: ``ByteSource``.

A ``MappedCheckpoint`` holds one per file and asks it, never which kind it is:

1. **Map**: ``map`` is the bytes (``None`` for an empty source), ``size`` how many.
2. **Need**: ``need(begin, end)`` / ``need_spans`` before reading bytes (nothing for a file:
   its pages fault in; ranged GETs for an object), ``prefetch`` as a hint.
3. **Check**: ``check_unchanged`` before touching the mapping (a file's identity; an object's
   ETag is checked on every GET instead).
4. **Release**: ``release(begin, end)`` when done with bytes (a file's pages given back; an
   object's are the load's stream's to give back).
5. **Reach**: ``spec()``, what another process needs to reach the same bytes
   (``sources.specs.FileSource``); ``close()``.

``MappedFile`` is a local file's private copy-on-write mapping with its ``fstat`` identity;
``FetchedObject`` an object's sparse mapping (``sources.sparse.ObjectBytes``).

>>> source = MappedFile("m.safetensors", mapping, os.fstat(fd))   # doctest: +SKIP
>>> source.check_unchanged(); bytes(source.map[:8])                # doctest: +SKIP
"""

from __future__ import annotations

import abc
import mmap
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import FormatError
from .specs import FileSource, SourceSpec

if TYPE_CHECKING:  # pragma: no cover  (the object client is imported only where one is used)
    from .sparse import ObjectBytes

__all__ = [
    "ByteSource",
    "FetchedObject",
    "Identity",
    "MappedFile",
    "byte_source",
    "fetched_objects",
    "identity",
    "objects_in_shared_memory",
    "unmap",
]

#: what identifies a file's contents: (st_dev, st_ino, st_size, st_mtime_ns)
Identity = tuple[int, int, int, int]


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def unmap(m: mmap.mmap | None) -> None:
    """Close a mapping, unless a view of it is still alive (a read in flight in another
    thread): then dropping our reference is enough, it is unmapped when the last view goes."""
    if m is None:
        return
    try:
        m.close()
    except BufferError:
        pass


class ByteSource(abc.ABC):
    """One data file's bytes (see the module docstring). ``path`` names it in messages."""

    path: str
    size: int
    #: whether a view of its bytes may be handed out whole (``Checkpoint.view``): its pages
    #: come in as they are touched; an object's would all be fetched for it
    viewable: bool = True

    @property
    @abc.abstractmethod
    def map(self) -> mmap.mmap | None:
        """The bytes, mapped (None for an empty source, or once closed)."""

    def need(self, begin: int, end: int) -> None:  # noqa: B027 - nothing to fetch by default
        """Make bytes ``[begin, end)`` present before they are read."""

    def need_spans(self, spans: Iterable[tuple[int, int]]) -> None:  # noqa: B027 - as need
        """Make every ``[begin, end)`` of ``spans`` present (not consumed where there is
        nothing to fetch: pass a generator)."""

    def prefetch(self, begin: int, end: int) -> None:  # noqa: B027 - a hint
        """A hint that bytes ``[begin, end)`` will be read soon."""

    def release(self, begin: int, end: int) -> None:  # noqa: B027 - a hint
        """A hint that bytes ``[begin, end)`` are not needed here soon."""

    def check_unchanged(self, tensor: str | None = None) -> None:  # noqa: B027 - nothing kept
        """A ``FormatError`` (naming ``tensor``) if the bytes are no longer those opened."""

    @abc.abstractmethod
    def spec(self) -> FileSource:
        """What another process needs to reach the same bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of the mapping; idempotent."""


class MappedFile(ByteSource):
    """A local file's private copy-on-write mapping (``files.Files.map_data``), and its
    identity as mapped (``stat``; None: not checked)."""

    def __init__(self, path: str, mapped: mmap.mmap | None, stat: os.stat_result | None):
        self.path = path
        self.size = len(mapped) if mapped is not None else 0
        self._map = mapped
        # absolute: a chdir in another thread must not make the check look at another file
        self._abspath = os.path.abspath(path)
        self._identity = None if stat is None else identity(stat)

    @property
    def map(self) -> mmap.mmap | None:
        return self._map

    def prefetch(self, begin: int, end: int) -> None:
        """``MADV_WILLNEED``: from a cold page cache the faults of a copy out of a mapping read
        a little at a time, where this starts large sequential reads."""
        self._advise(begin, end, "MADV_WILLNEED")

    def release(self, begin: int, end: int) -> None:
        """``MADV_DONTNEED``: the pages stay in the page cache; the mapping is private and
        never written, so nothing is lost."""
        self._advise(begin, end, "MADV_DONTNEED")

    def _advise(self, begin: int, end: int, advice: str) -> None:
        m = self._map  # a closed mapping or a platform without the advice is no error
        if m is None or end <= begin or not hasattr(mmap, advice):
            return
        first = begin // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            m.madvise(getattr(mmap, advice), first, min(end, len(m)) - first)
        except (OSError, ValueError):
            pass  # closed meanwhile, or unsupported

    def check_unchanged(self, tensor: str | None = None) -> None:
        """The path, not the descriptor, is ``stat``-ed (``readers.mapped``'s docstring)."""
        was = self._identity
        if was is None:
            return
        try:
            st = os.stat(self._abspath)
        except OSError as exc:
            raise FormatError(
                f"the file changed while loading (it can no longer be read: "
                f"{exc.strerror or exc}); do not modify a checkpoint while it is "
                f"loading",
                file=self.path,
                tensor=tensor,
            ) from None
        now = identity(st)
        if now == was:
            return
        if now[:2] != was[:2]:
            how = (
                f"replaced by another file: inode {now[1]}, was {was[1]}; size {now[2]}, "
                f"was {was[2]}"
            )
        elif now[2] != was[2]:
            how = f"size {now[2]}, was {was[2]}"
        else:
            how = f"size {now[2]} unchanged, but it was written to: its modification time moved"
        raise FormatError(
            f"the file changed while loading ({how}); do not modify a checkpoint "
            f"while it is loading",
            file=self.path,
            tensor=tensor,
        )

    def spec(self) -> FileSource:
        return FileSource(self._abspath, self._identity)

    def close(self) -> None:
        m, self._map = self._map, None
        unmap(m)


class FetchedObject(ByteSource):
    """An object's bytes (``sources.sparse.ObjectBytes``), fetched as they are needed, standing
    for the local file ``path``. Every GET checks the object's ETag, so nothing is ``stat``-ed;
    its pages are the load's stream's to release (another worker may still need them)."""

    viewable = False

    def __init__(self, path: str, data: ObjectBytes):
        self.path = path
        self.size = data.size
        self.data = data
        self._abspath = os.path.abspath(path)

    @property
    def map(self) -> mmap.mmap | None:
        return self.data.map

    def need(self, begin: int, end: int) -> None:
        self.data.need(begin, end)

    def need_spans(self, spans: Iterable[tuple[int, int]]) -> None:
        self.data.need_spans(spans)

    def spec(self) -> FileSource:
        return FileSource(self._abspath, None, self.data.spec())

    def close(self) -> None:
        self.data.close()


def byte_source(
    path: str, mapped: mmap.mmap | None, stat: os.stat_result | None, data: ObjectBytes | None
) -> ByteSource:
    """The source of what a reader mapped (``files.MappedData``): the object's bytes where an
    object holds the file (``data``), else the file's mapping."""
    return MappedFile(path, mapped, stat) if data is None else FetchedObject(path, data)


def fetched_objects(sources: Sequence[ByteSource]) -> dict[int, ObjectBytes]:
    """``{index: ObjectBytes}`` of the sources that are objects in object storage: what a
    load's stream fetches into (``pieces.stream``)."""
    return {k: s.data for k, s in enumerate(sources) if isinstance(s, FetchedObject)}


def objects_in_shared_memory(
    specs: Sequence[SourceSpec], objects: dict[int, ObjectBytes]
) -> tuple[list[SourceSpec], dict[int, ObjectBytes]]:
    """For each of ``objects``, a new memory file (``ObjectBytes.in_shared_memory``) that a
    load's stream fills and worker processes map: ``specs`` with those sources naming them,
    and the files by index (the caller closes them)."""
    out = list(specs)
    made: dict[int, ObjectBytes] = {}
    try:
        for index, data in objects.items():
            made[index] = shared = type(data).in_shared_memory(data.info, data.client)
            spec = out[index]
            if not isinstance(spec, FileSource):
                raise TypeError(f"source {index} is an object but its spec is {spec!r}")
            out[index] = spec.with_object(shared.shared_spec())
    except BaseException:
        for shared in made.values():
            shared.close()
        raise
    return out, made
