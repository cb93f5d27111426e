"""One data file's bytes as a reader and a load see them, whether a local file or an object in
object storage holds them: ``ByteSource``.

A reader finds and maps its data files through the ``Files`` its open function is handed:
this machine's (``LOCAL_FILES``), or a checkpoint's in object storage
(``readers.objects.ObjectFiles``): ``Files.map_data`` makes a reader's sources (``open_spec``
another process's). A ``MappedCheckpoint`` holds one per file and asks it, never which kind
it is:

1. **Map**: ``map`` is the bytes (``None`` for an empty source), ``size`` how many.
2. **Need**: ``need(begin, end)`` / ``need_spans`` before reading bytes (nothing for a file:
   its pages fault in; ranged GETs for an object), ``prefetch`` as a hint; ``fetch_each`` asks
   several sources at once (an open's headers: each a round trip).
3. **Check**: ``check_unchanged`` before touching the mapping (a file's identity; an object's
   ETag is checked on every GET instead).
4. **Release**: ``release(begin, end)`` when done with bytes (a file's pages given back; an
   object's are the load's stream's to give back).
5. **Reach**: ``spec()``, what another process needs to reach the same bytes
   (``sources.specs.FileSource``), which ``open_spec`` reaches there; ``close()``.

``MappedFile`` is a local file's private copy-on-write mapping with its ``fstat`` identity;
``FetchedObject`` an object's sparse mapping (``sources.sparse.ObjectBytes``).

>>> source = LOCAL_FILES.map_data("m.safetensors")                 # doctest: +SKIP
>>> source.need(0, 8); source.check_unchanged(); bytes(source.map[:8])  # doctest: +SKIP
"""

from __future__ import annotations

import abc
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ..errors import FormatError
from ..files import ErrorFactory, PathLike, format_error, open_regular
from .specs import FileSource, SourceSpec

if TYPE_CHECKING:  # pragma: no cover  (the object client is imported only where one is used)
    from .sparse import ObjectBytes

__all__ = [
    "LOCAL_FILES",
    "ByteSource",
    "FetchedObject",
    "Files",
    "Identity",
    "MappedFile",
    "fetch_each",
    "fetched_objects",
    "identity",
    "objects_in_shared_memory",
    "open_spec",
    "unmap",
]

S = TypeVar("S", bound="ByteSource")

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

    def need(  # noqa: B027 - nothing to fetch by default
        self, begin: int, end: int, *, small: bool = False
    ) -> None:
        """Make bytes ``[begin, end)`` present before they are read. ``small``: a header an
        open waits for, not one of the reads that pace a load."""

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
    """A local file's private copy-on-write mapping (``Files.map_data``), and its
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

    def need(self, begin: int, end: int, *, small: bool = False) -> None:
        self.data.need(begin, end, small=small)

    def need_spans(self, spans: Iterable[tuple[int, int]]) -> None:
        self.data.need_spans(spans)

    def spec(self) -> FileSource:
        return FileSource(self._abspath, None, self.data.spec())

    def close(self) -> None:
        self.data.close()


def fetch_each(sources: Sequence[S], fetch: Callable[[S], None]) -> dict[int, BaseException]:
    """``fetch(source)`` for every one of ``sources`` at once, on the open's threads
    (``sources.store.each``): each of an open's small reads waits a round trip, and 200 in
    turn would wait 200. Returns the failures by index; after the first, nothing further
    starts (the earliest failure is the one a loop in order would have met).

    >>> fetch_each([], lambda source: source.need(0, 8, small=True))
    {}
    """
    if not sources:
        return {}
    from .store import each  # the object client's module: imported only where one is used

    return each(sources, fetch)


def open_spec(spec: FileSource) -> ByteSource:
    """The bytes ``spec`` names, reached from this process: the file mapped again, refused
    (``FormatError``) unless it is still the file the controller opened (``identity``); an
    object's bytes fetched here as needed, or mapped from the loader's memory file
    (``ObjectBytes.from_spec``)."""
    if spec.object is not None:
        from .sparse import ObjectBytes  # the object client's module, as in fetch_each

        return FetchedObject(spec.path, ObjectBytes.from_spec(spec.object))
    f, st = open_regular(spec.path, "the checkpoint file")
    with f:
        if spec.identity is not None and identity(st) != spec.identity:
            raise FormatError(
                "the file changed between the controller opening it and this worker "
                "mapping it; do not modify a checkpoint while it is loading",
                file=spec.path,
            )
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if st.st_size else None
    return MappedFile(spec.path, m, st)


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


class Files:
    """Where readers find a checkpoint's data files and map them (``map_data``): this
    machine's file system. A checkpoint in object storage is read through another
    (``readers.objects.ObjectFiles``), made for its open alone and handed to the reader's open
    function: nothing is registered for the process, and no file stands in for an object.

    >>> LOCAL_FILES.lexists("/no/such/file")
    False
    """

    def lexists(self, path: PathLike) -> bool:
        """Whether a file of that name is there (by name: a dangling link is there)."""
        return os.path.lexists(path)

    def glob(self, folder: PathLike, suffix: str) -> list[str]:
        """The names in ``folder`` ending in ``suffix``, sorted (as ``glob("*" + suffix)``:
        hidden names left out)."""
        try:
            return sorted(
                n for n in os.listdir(folder) if n.endswith(suffix) and not n.startswith(".")
            )
        except OSError:
            return []

    def remote(self, path: PathLike) -> ByteSource | None:
        """The source of ``path``'s bytes where they are fetched over the network as they are
        asked for (an object in object storage): worth asking for ahead, several at once
        (``fetch_each``). None for a file."""
        return None

    def map_data(
        self, path: PathLike, what: str = "the file", error: ErrorFactory | None = None
    ) -> ByteSource:
        """The bytes of the data file at ``path``: a private copy-on-write mapping of the
        regular file (``files.open_regular``; ACCESS_COPY: torch sees a writable buffer, and no
        write through a tensor can reach the file), with its identity as mapped."""
        error = error or format_error(path)
        f, st = open_regular(path, what, error)
        with f:
            # the mapping holds its own handle on the file, so the file object can be closed
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if st.st_size else None
        if mapped is not None and len(mapped) != st.st_size:
            mapped.close()
            raise error(
                f"{what} changed size while being opened; do not modify a checkpoint "
                f"while it is loading"
            )
        return MappedFile(os.fspath(path), mapped, st)


#: this machine's file system: where readers find data files unless handed others
LOCAL_FILES = Files()
