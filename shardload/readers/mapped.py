"""The reading half every file-backed reader shares: validated byte ranges in mapped files.

A reader (safetensors, GGUF, MLC) validates its headers, maps its files, and hands this class
each tensor's metadata and byte range. From then on a read is a bounds-checked copy out of the
mapping: ``read`` copies a whole tensor once, ``read_narrow`` / ``read_ranges`` copy only the
bytes of a slice. Nothing here trusts anything it was not given by a validating reader.

Each file is read through its ``ByteSource`` (``sources.bytesource``: a local file's mapping,
or an object's bytes fetched as they are asked for), which the checks below live in.

A file that changes while it is loading. Reading a mapped page that lies past the end of a file
truncated after it was mapped raises SIGBUS, which kills the process without a word. So each
file's identity is recorded when it is opened (device, inode, size, modification time, from
``fstat`` of the descriptor that was mapped), and before copying each tensor the file's path is
``stat``-ed (one system call per tensor; none for an empty tensor) and must still show that
identity: a file truncated, appended to, rewritten in place, replaced by another one (a new
inode: a reader in another process would see different bytes) or removed is a ``FormatError``
("the file changed while loading"), raised before any byte of it is touched. The path, not the
descriptor, is what is checked: a held descriptor keeps the old inode alive and would never
show a replacement, while any change to the inode the path leads to shows in its ``stat``.

What remains: a file truncated *during* the copy of one tensor, after its check, still faults
(SIGBUS). Python cannot recover from a fault inside a ``memcpy`` (the signal arrives in C code;
a handler cannot resume or unwind it), so that window, about one tensor's copy long, is
accepted. Closing it would mean reading through ``pread`` / ``readinto`` instead of the
mapping, 1.8x slower at N=1 (a ``pread`` copies on one core per call, where a copy out of the
mapping runs on torch's threads): a cost every load would pay to guard against a mistake the
user can avoid.
``ProcessSession`` isolates a worker that does fault (``WorkerCrashedError``).
"""

from __future__ import annotations

import math
import operator
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from .. import dtypes
from ..sources.bytesource import ByteSource, open_spec
from ..sources.specs import FileSource, SourceSpec
from . import base
from .base import Checkpoint, TensorMeta

if TYPE_CHECKING:  # pragma: no cover  (imported where used: planning needs no torch)
    import torch

__all__ = ["MappedCheckpoint", "TensorTable", "copy_blocks", "open_sources"]


def copy_blocks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two ``(outer, length, inner)`` byte views. Under
    ``base.copy_progress`` a copy over ``COPY_CHUNK_BYTES`` is made in pieces of about that
    size (whole rows of ``outer`` where they fit, else pieces of one row's ``length``), with
    the hook called after each: each piece is still one large parallel copy, so this costs
    nothing measurable, and a watchdog sees a long read advance."""
    hook = base.copy_progress_hook()
    outer, length, inner = src.shape
    row = length * inner
    chunk = base.COPY_CHUNK_BYTES
    if hook is None or outer * row <= chunk:
        dst.copy_(src)
        return
    if row <= chunk:
        rows = chunk // row
        for a in range(0, outer, rows):
            dst[a : a + rows].copy_(src[a : a + rows])
            hook()
        return
    cols = max(1, chunk // inner)
    for r in range(outer):
        for a in range(0, length, cols):
            dst[r, a : a + cols].copy_(src[r, a : a + cols])
            hook()


class TensorTable:
    """Tensors' metadata by name, in storage order, and where their bytes lie: what a reader
    hands ``MappedCheckpoint``.

    Compact, because a header may list a million tensors: per tensor one ``TensorMeta``, one
    dict entry and 20 bytes of arrays (a ``(file, begin, end)`` tuple of Python ints would take
    64 bytes, and each offset over 256 another 32). The name -> index dict that reads need is
    made at the first read (``index``): opening, planning and ``inspect`` never read, and it
    is a fifth of what they hold.
    """

    __slots__ = ("_index", "begin", "end", "file", "meta")

    def __init__(self) -> None:
        self.meta: dict[str, TensorMeta] = {}
        self._index: dict[str, int] | None = None
        self.file = array("I")
        self.begin = array("q")  # offsets into the file's data
        self.end = array("q")

    def add(self, meta: TensorMeta, file: int, begin: int, end: int) -> None:
        if meta.name in self.meta:  # readers refuse these with the file's name first
            raise ValueError(f"tensor {meta.name!r} added twice")
        self.meta[meta.name] = meta
        self.file.append(file)
        self.begin.append(begin)
        self.end.append(end)
        self._index = None

    def extend(self, file: int, metas: dict[str, TensorMeta], begins: array, ends: array) -> None:
        """Add a file's tensors, ``metas`` in storage order with their offsets; the first
        file's ``metas`` becomes the table's own (not copied: the caller lets go of it)."""
        if self.meta:
            if not self.meta.keys().isdisjoint(metas):
                twice = next(name for name in metas if name in self.meta)
                raise ValueError(f"tensor {twice!r} added twice")
            self.meta.update(metas)
        else:
            self.meta = metas
        self.file.extend(repeat(file, len(metas)))
        self.begin.extend(begins)
        self.end.extend(ends)
        self._index = None

    def index(self, name: str) -> int:
        """Where ``name``'s offsets are in the arrays; a ``KeyError`` for a name not here."""
        index = self._index
        if index is None:
            # the dict keeps insertion order, which is the arrays' order: no name is added twice
            index = self._index = dict(zip(self.meta, range(len(self.begin))))
        return index[name]


class MappedCheckpoint(Checkpoint):
    """Tensors at known byte ranges of memory-mapped files.

    Each file is a ``ByteSource`` (``byte_sources``: ``sources.bytesource``, made by the
    reader's ``Files.map_data``, or by ``open_sources``), which every read asks; ``files`` are
    their paths. ``tensors`` is a ``TensorTable``, or yields ``(meta, file_index, begin, end)``
    with offsets into file ``file_index``'s data, which starts at ``data_starts[file_index]``
    (0 by default). Reads are thread-safe; ``bytes_read`` counts every byte copied out. After
    ``close()`` reads raise ``ValueError``; tensors already returned stay valid (they own
    their memory).
    """

    def __init__(
        self,
        source: str,
        byte_sources: Sequence[ByteSource],
        tensors: TensorTable | Iterable[tuple[TensorMeta, int, int, int]],
        data_starts: list[int] | None = None,
    ):
        super().__init__()
        self.source = source
        self.byte_sources: list[ByteSource] = list(byte_sources)
        self.files = [s.path for s in self.byte_sources]
        self._closers: list[Callable[[], object]] = []
        self._data_starts = list(data_starts or [0] * len(self.files))
        # each file's data as a uint8 tensor, and its tensor data within it: made at the first
        # read (``_views``), so an open that only plans and validates needs no torch
        self._files_data: list[torch.Tensor] | None = None
        self._data: list[torch.Tensor] | None = None
        self._closed = False
        if not isinstance(tensors, TensorTable):
            table = TensorTable()
            for meta, index, begin, end in tensors:
                table.add(meta, index, begin, end)
            tensors = table
        self._table = tensors
        self._meta = tensors.meta
        self._lock = threading.Lock()

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    def _check_open(self, what: str) -> None:
        """A ``ValueError`` once the checkpoint is closed (reading ``what``, or " it")."""
        if self._closed:
            raise ValueError(
                f"{self.source}: checkpoint is closed; open it again to read{what or ' it'}"
            )

    def _views(self, what: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each file's data as a uint8 tensor viewing its mapping, and the tensor data within
        it (after the header), made at the first read; the caller holds the lock. A closed
        checkpoint is a ``ValueError`` (reading ``what``)."""
        self._check_open(what)
        if self._files_data is None or self._data is None:
            import torch

            # Through numpy on purpose: a numpy array holds a buffer export on the mmap, so
            # mmap.close() refuses (BufferError) while any view is alive; torch.frombuffer
            # holds none, and closing under it would leave tensors pointing at unmapped memory.
            self._files_data = [
                torch.from_numpy(np.frombuffer(m, dtype=np.uint8))
                if (m := source.map) is not None
                else torch.empty(0, dtype=torch.uint8)
                for source in self.byte_sources
            ]
            self._data = [
                whole[start:] for whole, start in zip(self._files_data, self._data_starts)
            ]
        return self._files_data, self._data

    def _where(self, name: str) -> tuple[int, int, int]:
        """``(file index, begin, end)`` of a tensor known to be here."""
        table = self._table
        k = table.index(name)
        return table.file[k], table.begin[k], table.end[k]

    # -- byte sources: this checkpoint's files, for read plans

    def sources(self) -> list[SourceSpec]:
        return [source.spec() for source in self.byte_sources]

    def locate(self, name: str) -> tuple[int, int, int]:
        self.meta(name)
        i, begin, end = self._where(name)
        return i, self._data_starts[i] + begin, self._data_starts[i] + end

    def locate_all(self, names: Iterable[str]) -> list[tuple[int, int]]:
        table, starts = self._table, self._data_starts
        where = list(map(table.index, names))  # a KeyError for a name not here
        files = [table.file[k] for k in where]
        return list(zip(files, [starts[i] + table.begin[k] for i, k in zip(files, where)]))

    def source_bytes(self, index: int) -> torch.Tensor:
        """File ``index`` whole, as a uint8 view of its mapping, after checking that the file is
        still the one that was mapped."""
        with self._lock:
            data = self._views("")[0][index]
        self.check_unchanged(index)
        return data

    def release_bytes(self, index: int, begin: int, end: int) -> None:
        """Give this process's pages of the source's bytes ``[begin, end)`` back where it
        can (``ByteSource.release``: see ``release``); only memory accounting suffers where it
        cannot."""
        self.byte_sources[index].release(begin, end)

    def on_close(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` when this checkpoint is closed, after its mappings."""
        self._closers.append(callback)

    def prefetch_bytes(self, index: int, begin: int, end: int) -> None:
        """Ask for the source's bytes ``[begin, end)`` ahead (``ByteSource.prefetch``: a
        file's pages read ahead by the kernel, ``MADV_WILLNEED``): from a cold page cache the
        faults of a copy out of a mapping read a little at a time."""
        self.byte_sources[index].prefetch(begin, end)

    def count_read(self, nbytes: int) -> None:
        """Add ``nbytes`` to ``bytes_read`` (a read plan copied them out of a source)."""
        self._count(nbytes)

    # -- reading

    def _locate(
        self, name: str, slices: tuple[int, list] | None = None
    ) -> tuple[TensorMeta, torch.Tensor]:
        """The tensor's metadata and a uint8 view of exactly its bytes, after checking that its
        file is still the one that was opened (it is about to be read). An object's bytes are
        fetched first: the whole tensor's, or with ``slices`` (``(dim, [(start, length)])``)
        only those slices'."""
        meta = self.meta(name)
        i, begin, end = self._where(name)
        with self._lock:
            data = self._views(f" {name!r}")[1][i]
        self._ready(meta, i, begin, end, slices)
        return meta, data[begin:end]

    def _ready(
        self, meta: TensorMeta, i: int, begin: int, end: int, slices: tuple[int, list] | None = None
    ) -> None:
        """Before bytes ``[begin, end)`` of file ``i``'s data are read: the source checked,
        and asked for them (see ``_locate``)."""
        if end > begin:
            source = self.byte_sources[i]
            source.check_unchanged(meta.name)
            base = self._data_starts[i] + begin
            if slices is None:
                source.need(base, base + end - begin)
            else:
                source.need_spans(_slice_spans(meta, base, *slices))

    def read_array(self, name: str) -> np.ndarray:
        """The whole tensor as a new numpy array, copied by numpy out of the mapping (no
        torch: see ``Checkpoint.read_array``)."""
        meta = self.meta(name)
        i, begin, end = self._where(name)
        with self._lock:
            self._check_open(f" {name!r}")
            mapped = self.byte_sources[i].map
        self._ready(meta, i, begin, end)
        carrier = dtypes.numpy_carrier(meta.dtype)[0]
        if end == begin or mapped is None:  # (only an empty file has no mapping)
            return np.zeros(meta.shape, carrier)
        raw = np.frombuffer(mapped, np.uint8, end - begin, self._data_starts[i] + begin)
        self._count(end - begin)
        return raw.copy().view(carrier).reshape(meta.shape)

    def confirm_unchanged(self) -> None:
        for source in self.byte_sources:
            source.check_unchanged()

    def check_unchanged(self, i: int, tensor: str | None = None) -> None:
        """Refuse to touch file ``i``'s mapping if the file is no longer what was mapped."""
        self.byte_sources[i].check_unchanged(tensor)

    def _count(self, n: int) -> None:
        with self._lock:  # += on an attribute is not atomic across threads
            self.bytes_read += n

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, copied once out of the mapping into a new contiguous tensor."""
        import torch

        meta, raw = self._locate(name)
        out = torch.empty(meta.shape, dtype=dtypes.to_torch(meta.dtype))
        if raw.numel():
            # Copy as bytes: offsets need not be aligned for the dtype.
            copy_blocks(out.view(-1).view(torch.uint8).view(1, -1, 1), raw.view(1, -1, 1))
        self._count(raw.numel())
        return out

    def view(self, name: str) -> torch.Tensor | None:
        """The tensor as a view of its file's private mapping (``Checkpoint.view``); ``None``
        where its offset is not aligned for its dtype (``read`` copies it as bytes), and where
        its source is not ``viewable`` (an object in object storage: a view must hold the whole
        tensor's bytes, which would fetch all of it where a read fetches only those asked)."""
        import torch

        i, _, _ = self._where(name)
        if not self.byte_sources[i].viewable:
            return None
        meta, raw = self._locate(name)
        torch_dtype = dtypes.to_torch(meta.dtype)
        if not raw.numel():
            return torch.empty(meta.shape, dtype=torch_dtype)
        if raw.storage_offset() % dtypes.itemsize(meta.dtype):
            return None
        return raw.view(torch_dtype).view(meta.shape)

    def read_narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``read(name).narrow(dim, start, length)``, copying only the slice's bytes.

        ``dim`` and ``start`` may be negative, as for ``torch.narrow``. Raises ``IndexError``
        for a ``dim`` or ``start`` out of range and ``ValueError`` for a bad ``length``.
        """
        import torch

        meta = self.meta(name)
        dim, start, length = self._slice(name, meta, dim, start, length)
        shape = meta.shape
        out = torch.empty(
            shape[:dim] + (length,) + shape[dim + 1 :], dtype=dtypes.to_torch(meta.dtype)
        )
        _, raw = self._locate(name, (dim, [(start, length)]))
        self._copy_slice(meta, raw, dim, start, length, out, 0)
        return out

    def read_ranges(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The slices ``[start, start + length)`` of ``dim``, concatenated along it, copied
        once into a new tensor: a worker's piece of a fused tensor, assembled in place."""
        import torch

        meta = self.meta(name)
        checked = [self._slice(name, meta, dim, start, length) for start, length in ranges]
        dim = checked[0][0] if checked else dim % len(meta.shape)
        total = sum(length for _, _, length in checked)
        shape = meta.shape[:dim] + (total,) + meta.shape[dim + 1 :]
        out = torch.empty(shape, dtype=dtypes.to_torch(meta.dtype))
        # one check of the file for all the ranges
        _, raw = self._locate(name, (dim, [(start, length) for _, start, length in checked]))
        offset = 0
        for _, start, length in checked:
            self._copy_slice(meta, raw, dim, start, length, out, offset)
            offset += length
        return out

    def _slice(self, name: str, meta: TensorMeta, dim, start, length) -> tuple[int, int, int]:
        dim, start, length = operator.index(dim), operator.index(start), operator.index(length)
        shape, ndim = meta.shape, len(meta.shape)
        if not -ndim <= dim < ndim:
            raise IndexError(
                f"{self.source}: tensor {name!r} has shape {shape}; dim {dim} is out of range"
            )
        dim %= ndim
        size = shape[dim]
        if not -size <= start <= size:
            raise IndexError(
                f"{self.source}: tensor {name!r} has size {size} in dim {dim}; "
                f"start {start} is out of range"
            )
        if start < 0:
            start += size
        if length < 0 or start + length > size:
            raise ValueError(
                f"{self.source}: tensor {name!r} has size {size} in dim {dim}; "
                f"cannot take {length} elements from {start}"
            )
        return dim, start, length

    def _copy_slice(
        self,
        meta: TensorMeta,
        raw: torch.Tensor,
        dim: int,
        start: int,
        length: int,
        out: torch.Tensor,
        offset: int,
    ) -> None:
        """Copy ``[start, start + length)`` of ``dim`` of the tensor whose bytes are ``raw`` to
        ``[offset, offset + length)`` of the same dim of ``out`` (contiguous, same dtype, same
        other dims)."""
        import torch

        shape = meta.shape
        # In C order the slice is `outer` runs of `length * inner` contiguous bytes, one run per
        # index of the dims before `dim`: strided uint8 views of the mapping and of `out`,
        # copied once.
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1 :]) * dtypes.itemsize(meta.dtype)
        nbytes = outer * length * inner
        if nbytes:
            src = raw.view(outer, shape[dim], inner)[:, start : start + length]
            dst = out.view(-1).view(torch.uint8).view(outer, out.shape[dim], inner)
            copy_blocks(dst[:, offset : offset + length], src)
        self._count(nbytes)

    def release(self, name: str) -> None:
        """Hand this process's mapping of the tensor's pages back once nobody here needs them
        any more. They stay in the page cache (a later read maps them again); without this
        every page ever read stays charged to the process's resident memory until close. The
        mapping is private and never written, so nothing is lost."""
        self.release_bytes(*self.locate(name))

    def close(self) -> None:
        """Unmap the files. Idempotent; tensors already returned stay valid."""
        with self._lock:
            # drop our views first: they hold buffer exports on the maps
            self._data = self._files_data = None
            self._closed = True
        for source in self.byte_sources:
            source.close()
        closers, self._closers = self._closers, []
        for callback in closers:
            callback()


def open_sources(sources: Sequence[SourceSpec], source: str = "<read plan>") -> MappedCheckpoint:
    """Map the files a read plan names, in another process than the one that opened them.

    Each is reached as ``sources.bytesource.open_spec`` says: a file must still be the one
    the controller opened (a ``FormatError`` before any byte is read); an object's bytes are
    fetched here, or mapped from the loader's memory file. The result serves
    ``source_bytes`` / ``release_bytes``; it holds no tensors.
    """
    opened: list[ByteSource] = []
    try:
        for spec in sources:
            if not isinstance(spec, FileSource):
                raise ValueError(
                    "a worker process can only read sources that are files; this "
                    f"one is {spec.to_json()!r} (the loader writes in-memory tensors to a "
                    "file first)"
                )
            opened.append(open_spec(spec))
    except BaseException:
        for done in opened:
            done.close()
        raise
    return MappedCheckpoint(source, opened, ())


def _slice_spans(
    meta: TensorMeta, base: int, dim: int, slices: list[tuple[int, int]]
) -> Iterator[tuple[int, int]]:
    """The ``[begin, end)`` bytes of the slices ``[start, start + length)`` of ``dim`` of a C-order
    tensor whose bytes start at ``base``: one run per slice per index of the dims before. A
    generator: a source with nothing to fetch never makes them."""
    shape = meta.shape
    inner = math.prod(shape[dim + 1 :]) * dtypes.itemsize(meta.dtype)
    row = shape[dim] * inner
    return (
        (base + o * row + start * inner, base + o * row + (start + length) * inner)
        for o in range(math.prod(shape[:dim]))
        for start, length in slices
        if length
    )
