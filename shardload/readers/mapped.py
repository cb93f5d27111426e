"""The reading half every file-backed reader shares: validated byte ranges in mapped files.

A reader (safetensors, GGUF, MLC) validates its headers, maps its files, and hands this class
each tensor's metadata and byte range. From then on a read is a bounds-checked copy out of the
mapping: ``read`` copies a whole tensor once, ``read_narrow`` / ``read_narrow_into`` copy only
the bytes of a slice. Nothing here trusts anything it was not given by a validating reader.
"""

from __future__ import annotations

import math
import mmap
import operator
import threading
from typing import Iterable, Optional

import numpy as np
import torch

from .. import dtypes
from .base import Checkpoint, TensorMeta


def unmap(m: Optional[mmap.mmap]) -> None:
    """Close a mapping, unless a view of it is still alive (a read in flight in another
    thread): then dropping our reference is enough, it is unmapped when the last view goes."""
    if m is None:
        return
    try:
        m.close()
    except BufferError:
        pass


class MappedCheckpoint(Checkpoint):
    """Tensors at known byte ranges of memory-mapped files.

    ``tensors`` yields ``(meta, file_index, begin, end)`` with offsets into file
    ``file_index``'s data, which starts at ``data_starts[file_index]`` (0 by default). Reads
    are thread-safe; ``bytes_read`` counts every byte copied out. After ``close()`` reads raise
    ``ValueError``; tensors already returned stay valid (they own their memory).
    """

    def __init__(self, source: str, files: list[str], maps: list[Optional[mmap.mmap]],
                 tensors: Iterable[tuple[TensorMeta, int, int, int]],
                 data_starts: Optional[list[int]] = None):
        super().__init__()
        self.source = source
        self.files = list(files)
        self._maps = list(maps)
        self._data_starts = list(data_starts or [0] * len(maps))
        # A uint8 view of each file's data. It goes through numpy on purpose: a numpy array
        # holds a buffer export on the mmap, so mmap.close() refuses (BufferError) while any
        # view is alive; torch.frombuffer holds none, and closing under it would leave tensors
        # pointing at unmapped memory.
        self._data: Optional[list[torch.Tensor]] = [
            torch.from_numpy(np.frombuffer(m, dtype=np.uint8))[start:] if m is not None
            else torch.empty(0, dtype=torch.uint8)
            for m, start in zip(self._maps, self._data_starts)]
        self._meta: dict[str, TensorMeta] = {}
        self._where: dict[str, tuple[int, int, int]] = {}
        for meta, index, begin, end in tensors:
            self._meta[meta.name] = meta
            self._where[meta.name] = (index, begin, end)
        self._lock = threading.Lock()

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    def byte_range(self, name: str) -> tuple[str, int, int]:
        """``(file, start, end)``: where the tensor's bytes lie, as offsets into the file."""
        self.meta(name)
        i, begin, end = self._where[name]
        return self.files[i], self._data_starts[i] + begin, self._data_starts[i] + end

    # -- reading

    def _locate(self, name: str) -> tuple[TensorMeta, torch.Tensor]:
        """The tensor's metadata and a uint8 view of exactly its bytes."""
        meta = self.meta(name)
        i, begin, end = self._where[name]
        with self._lock:
            if self._data is None:
                raise ValueError(f"{self.source}: checkpoint is closed; open it again to read "
                                 f"{name!r}")
            data = self._data[i]
        return meta, data[begin:end]

    def _count(self, n: int) -> None:
        with self._lock:  # += on an attribute is not atomic across threads
            self.bytes_read += n

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, copied once out of the mapping into a new contiguous tensor."""
        meta, raw = self._locate(name)
        out = torch.empty(meta.shape, dtype=dtypes.to_torch(meta.dtype))
        if raw.numel():
            # Copy as bytes: offsets need not be aligned for the dtype.
            out.view(-1).view(torch.uint8).copy_(raw)
        self._count(raw.numel())
        return out

    def read_narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``read(name).narrow(dim, start, length)``, copying only the slice's bytes.

        ``dim`` and ``start`` may be negative, as for ``torch.narrow``. Raises ``IndexError``
        for a ``dim`` or ``start`` out of range and ``ValueError`` for a bad ``length``.
        """
        meta = self.meta(name)
        dim, start, length = self._slice(name, meta, dim, start, length)
        shape = meta.shape
        out = torch.empty(shape[:dim] + (length,) + shape[dim + 1:],
                          dtype=dtypes.to_torch(meta.dtype))
        self._copy_slice(name, dim, start, length, out, 0)
        return out

    def read_ranges(self, name: str, dim: int,
                    ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The slices ``[start, start + length)`` of ``dim``, concatenated along it, copied
        once into a new tensor: a worker's piece of a fused tensor, assembled in place."""
        meta = self.meta(name)
        checked = [self._slice(name, meta, dim, start, length) for start, length in ranges]
        dim = checked[0][0] if checked else dim % len(meta.shape)
        total = sum(length for _, _, length in checked)
        shape = meta.shape[:dim] + (total,) + meta.shape[dim + 1:]
        out = torch.empty(shape, dtype=dtypes.to_torch(meta.dtype))
        offset = 0
        for _, start, length in checked:
            self._copy_slice(name, dim, start, length, out, offset)
            offset += length
        return out

    def _slice(self, name: str, meta: TensorMeta, dim, start, length) -> tuple[int, int, int]:
        dim, start, length = operator.index(dim), operator.index(start), operator.index(length)
        shape, ndim = meta.shape, len(meta.shape)
        if not -ndim <= dim < ndim:
            raise IndexError(f"{self.source}: tensor {name!r} has shape {shape}; dim {dim} is "
                             f"out of range")
        dim %= ndim
        size = shape[dim]
        if not -size <= start <= size:
            raise IndexError(f"{self.source}: tensor {name!r} has size {size} in dim {dim}; "
                             f"start {start} is out of range")
        if start < 0:
            start += size
        if length < 0 or start + length > size:
            raise ValueError(f"{self.source}: tensor {name!r} has size {size} in dim {dim}; "
                             f"cannot take {length} elements from {start}")
        return dim, start, length

    def _copy_slice(self, name: str, dim: int, start: int, length: int, out: torch.Tensor,
                    offset: int) -> None:
        """Copy ``[start, start + length)`` of ``dim`` to ``[offset, offset + length)`` of the
        same dim of ``out`` (contiguous, same dtype, same other dims)."""
        meta, raw = self._locate(name)
        shape = meta.shape
        # In C order the slice is `outer` runs of `length * inner` contiguous bytes, one run per
        # index of the dims before `dim`: strided uint8 views of the mapping and of `out`,
        # copied once.
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1:]) * dtypes.itemsize(meta.dtype)
        nbytes = outer * length * inner
        if nbytes:
            src = raw.view(outer, shape[dim], inner)[:, start:start + length]
            dst = out.view(-1).view(torch.uint8).view(outer, out.shape[dim], inner)
            dst[:, offset:offset + length].copy_(src)
        self._count(nbytes)

    def release(self, name: str) -> None:
        """Hand this process's mapping of the tensor's pages back once nobody here needs them
        any more. They stay in the page cache (a later read maps them again); without this
        every page ever read stays charged to the process's resident memory until close. The
        mapping is private and never written, so nothing is lost."""
        i, begin, end = self._where[name]
        with self._lock:
            m = self._maps[i] if i < len(self._maps) else None
        if m is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = (self._data_starts[i] + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            m.madvise(mmap.MADV_DONTNEED, first, self._data_starts[i] + end - first)
        except (OSError, ValueError):
            pass  # closed meanwhile, or unsupported: only memory accounting suffers

    def close(self) -> None:
        """Unmap the files. Idempotent; tensors already returned stay valid."""
        with self._lock:
            self._data = None  # drop our views first: they hold buffer exports on the maps
            maps, self._maps = self._maps, []
        for m in maps:
            unmap(m)
