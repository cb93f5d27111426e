"""The GGUF reader (llama.cpp's format): the one place where GGUF bytes are trusted or refused.

A ``.gguf`` file (versions 2 and 3, little-endian) is::

    "GGUF", u32 version, u64 tensor_count, u64 kv_count
    kv_count key-values:    string key, u32 value type, value
                            (a string is u64 length + UTF-8 bytes; an array is u32 element
                            type, u64 count, the elements)
    tensor_count infos:     string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset
    padding to ``general.alignment`` (32 by default), then the data: each tensor's bytes at
    data start + offset

``ne`` is innermost first: ``ne[0]`` is the row length, so numpy/torch order is
``reversed(ne)``. Quantized types store each row as ``ne[0] // block_size`` blocks of
``type_size`` bytes (e.g. Q4_1: 32 weights in 20 bytes). This reader never dequantizes: a
quantized tensor is exposed as its raw blocks, dtype ``uint8`` and shape
``(*reversed(ne[1:]), ne[0] // block_size * type_size)`` (what gguf-py's ``tensor.data`` is), so
splitting rows, or splitting the last (byte) dim at multiples of ``type_size``, splits whole
blocks. ``tensor_format`` gives the ggml type, block size, type size and ``ne``.

Trust rules. A checkpoint is input from outside, so the whole header is checked here, at open
time, before anything is read, and every failure is a ``FormatError`` naming the file (and the
tensor where there is one). After ``open_gguf`` returns, a read is a bounds-checked copy:

* the path may be a symlink (the Hugging Face hub cache links every file into ``blobs/``); what
  it leads to must be a regular file: a FIFO, a device, a directory, a symlink loop or an
  unreadable file is refused by name, never opened in a way that could block;
* magic ``GGUF``, version 2 or 3, little-endian (big-endian files are refused, not swapped);
* every count, length and offset in the header is bounded by the file size before it is used
  (a corrupt count cannot make us loop or allocate); strings are valid UTF-8; value types are
  known; arrays are not nested; bools are 0 or 1; no key appears twice;
* ``general.alignment``, if present, is a u32 power of two;
* each tensor: a unique non-empty name, 0..4 dims each at most 2**53 (a strict reader refuses
  dims beyond 2**53) whose product fits 64-bit sizes, a ggml type gguf-py knows with a block
  size, ``ne[0]`` a multiple of that block size, an offset that is a multiple of the alignment
  (as llama.cpp requires), and a byte size (``n_elements // block_size * type_size``, which the
  header implies, never states) whose range lies inside the file and overlaps no other tensor;
* the bytes between the end of the header and the aligned data start are zeros, and the data
  region leaves no run of ``alignment`` or more bytes unclaimed, between tensors or after the
  last one. Writers (llama.cpp, gguf-py) pad with zeros, and only up to the alignment. This is
  what catches a header that lies about its own length: with a tensor count one too few, the
  data start moves back into the last tensor info, every offset then points at the wrong bytes,
  and every other check passes.

The header is parsed here, with gguf-py supplying the type tables (``GGMLQuantizationType``,
``GGML_QUANT_SIZES``, ``GGUFValueType``), rather than by ``gguf.GGUFReader``: GGUFReader builds
numpy objects for every element of every array at open time (over 2 s for the 150k tokenizer
entries of a 135M model, per process), and it neither bounds counts nor checks tensor ranges.
The tests check this reader against GGUFReader byte for byte.

The file is mapped, not read: opening reads only the header, ``read`` copies one tensor (or,
with ``read_narrow``, one slice of it) out of the mapping, and large key-value arrays (the
tokenizer) are decoded only when ``field`` asks for them. Files must not be modified while a
checkpoint has them open: a file that changes is refused before the next tensor or key is read
(see ``mapped.py``).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from .. import dtypes
from ..dtypes import shape_problem
from ..errors import FormatError, quote
from ..limits import MAX_DIM
from ..sources.bytesource import LOCAL_FILES, ByteSource, Files
from ..strict_json import gc_paused
from .base import TensorMeta
from .mapped import MappedCheckpoint

__all__ = ["CONFIG_MAX_ARRAY", "SUPPORTED_VERSIONS", "GGUFCheckpoint", "open_gguf"]

#: arrays longer than this are left out of ``config``; ``field`` returns them
CONFIG_MAX_ARRAY = 1024
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
_INT64_MAX = 2**63 - 1
_REDO = "re-download or re-convert the GGUF file"

# ggml types stored as plain elements -> canonical dtype name; every other type is raw blocks
_ELEMENT_TYPES: dict[GGMLQuantizationType, str] = {
    GGMLQuantizationType.F32: "float32",
    GGMLQuantizationType.F16: "float16",
    GGMLQuantizationType.BF16: "bfloat16",
    GGMLQuantizationType.F64: "float64",
    GGMLQuantizationType.I8: "int8",
    GGMLQuantizationType.I16: "int16",
    GGMLQuantizationType.I32: "int32",
    GGMLQuantizationType.I64: "int64",
}

# value type -> (struct format, numpy dtype) of one little-endian element
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<B", "<u1"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _type_name(code: int) -> str:
    try:
        return GGUFValueType(code).name
    except ValueError:
        return str(code)


# ----------------------------------------------------------------------------------------------
# the header


@dataclass(frozen=True)
class _KV:
    """Where one key's value lies: ``offset`` is its first byte (for an array, its first
    element), ``count`` its element count (1 for a scalar or string)."""

    key: str
    vtype: int
    offset: int
    subtype: int | None = None
    count: int = 1


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # relative to the data start


@dataclass
class _Header:
    version: int
    kvs: dict[str, _KV]
    infos: list[_TensorInfo]
    alignment: int
    data_start: int


class _NeedMore(Exception):
    """The parse reached past the bytes present (an object's header, fetched a part at a
    time): ``end`` is how far it needs them."""

    def __init__(self, end: int):
        super().__init__(end)
        self.end = end


class _Parser:
    """Bounds-checked reads of the header out of a mapping of the file. Only the first
    ``avail`` bytes are read (all of them, for a file): a read past them raises
    ``_NeedMore`` when the file holds more."""

    def __init__(self, buf: Any, size: int, path: Path, avail: int | None = None):
        self.buf, self.size, self.path = buf, size, path
        self.avail = size if avail is None else avail
        self.pos = 0
        self.where = "the header"  # what is being read, for messages
        self.tensor: str | None = None

    def fail(self, msg: str, *, redo: bool = True) -> FormatError:
        return FormatError(
            f"{msg}{'; ' + _REDO if redo else ''}", file=str(self.path), tensor=self.tensor
        )

    def need(self, n: int, what: str) -> None:
        if n > self.avail - self.pos:
            if self.avail < self.size and n <= self.size - self.pos:
                raise _NeedMore(self.pos + n)
            raise self.fail(
                f"{what} in {self.where} (at byte {self.pos}, {n} bytes) runs past the "
                f"end of the {self.size}-byte file: the file is truncated or its "
                f"header is corrupt"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, f"{what} ({n} bytes long)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} in {self.where} is not valid UTF-8 ({e})") from None

    def skip_strings(self, count: int, what: str) -> None:
        """Walk ``count`` strings, checking each is inside the file and valid UTF-8."""
        self.need(8 * count, f"{count} strings of {what}")  # each has at least its length
        buf, size, pos, unpack = self.buf, self.avail, self.pos, _U64.unpack_from
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"the length of string {i} of {what}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"string {i} of {what} ({n} bytes long)")
            try:
                str(buf[pos : pos + n], "utf-8")
            except UnicodeDecodeError as e:
                raise self.fail(f"string {i} of {what} is not valid UTF-8 ({e})") from None
            pos += n
        self.pos = pos

    def value(self, key: str, vtype: int) -> _KV:
        """Check and skip the value of ``key``, returning where it lies."""
        what = f"the value of key {quote(key)}"
        if vtype == GGUFValueType.STRING:
            start = self.pos
            self.string(what)
            return _KV(key, vtype, start)
        if vtype in _SCALARS:
            fmt, _ = _SCALARS[vtype]
            n = struct.calcsize(fmt)
            self.need(n, what)
            start = self.pos
            if vtype == GGUFValueType.BOOL and self.buf[start] > 1:
                raise self.fail(
                    f"{what} is a bool stored as {self.buf[start]}; a GGUF bool is 0 or 1"
                )
            self.pos += n
            return _KV(key, vtype, start)
        if vtype == GGUFValueType.ARRAY:
            subtype = self.u32(f"the element type of {what}")
            count = self.u64(f"the length of {what}")
            start = self.pos
            if subtype == GGUFValueType.STRING:
                self.skip_strings(count, what)
            elif subtype in _SCALARS:
                _, np_type = _SCALARS[subtype]
                n = np.dtype(np_type).itemsize
                self.need(count * n, f"{what} ({count} elements of {n} bytes)")
                if subtype == GGUFValueType.BOOL and count:
                    flags = np.frombuffer(self.buf, np.uint8, count, start)
                    bad = int(flags.max()) > 1
                    del flags  # a view holds the mapping; do not keep it
                    if bad:
                        raise self.fail(
                            f"{what} is an array of bools holding a value other than 0 or 1"
                        )
                self.pos += count * n
            elif subtype == GGUFValueType.ARRAY:
                raise self.fail(
                    f"{what} is an array of arrays; nested arrays are not part of "
                    f"GGUF as llama.cpp reads it"
                )
            else:
                raise self.fail(f"{what} is an array of unknown value type {subtype}")
            return _KV(key, vtype, start, subtype, count)
        raise self.fail(
            f"key {quote(key)} has unknown value type {vtype}; known: "
            f"{', '.join(t.name for t in GGUFValueType)}"
        )

    def header(self) -> _Header:
        if self.size < 24:
            raise self.fail(
                f"file is {self.size} bytes, too short for the 24-byte GGUF header: "
                f"it is truncated or not a GGUF file"
            )
        if self.avail < 24:
            raise _NeedMore(24)
        magic, version = struct.unpack_from("<II", self.buf, 0)
        if magic != GGUF_MAGIC:
            raise self.fail(
                f"magic is {bytes(self.buf[0:4])!r}, not b'GGUF': this is not a GGUF "
                f"file (or its start is corrupt)"
            )
        if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
            raise self.fail(
                "file is a big-endian GGUF; shardload reads little-endian GGUF "
                "only. Convert it with gguf-py's gguf_convert_endian (little)",
                redo=False,
            )
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(
                f"GGUF version {version} is not supported (shardload reads versions "
                f"{' and '.join(map(str, SUPPORTED_VERSIONS))}); re-convert the model "
                f"with a current llama.cpp",
                redo=False,
            )
        self.pos = 8
        n_tensors = self.u64("the tensor count")
        n_kv = self.u64("the key-value count")
        # Bound the counts by what the rest of the file could hold: a key-value is at least
        # 8 + 4 + 1 bytes, a tensor info at least 8 + 4 + 4 + 8.
        if n_kv * 13 + n_tensors * 24 > self.size - self.pos:
            raise self.fail(
                f"header claims {n_kv} key-values and {n_tensors} tensors, more than "
                f"the {self.size}-byte file can hold: the header is corrupt or the "
                f"file is truncated"
            )

        kvs: dict[str, _KV] = {}
        for i in range(n_kv):
            self.where = f"key-value {i}"
            key = self.string("the key")
            self.where = f"key-value {i} ({quote(key)})"
            vtype = self.u32("the value type")
            if key in kvs:
                raise self.fail(f"key {quote(key)} appears twice; every key must be unique")
            kvs[key] = self.value(key, vtype)

        infos: list[_TensorInfo] = []
        names: set[str] = set()
        for i in range(n_tensors):
            self.where, self.tensor = f"tensor info {i}", None
            name = self.string("the tensor name")
            if not name:
                raise self.fail("a tensor has an empty name")
            self.tensor = name
            if name in names:
                raise self.fail("two tensors have this name; every tensor name must be unique")
            names.add(name)
            n_dims = self.u32("the dimension count")
            if n_dims > GGML_MAX_DIMS:
                raise self.fail(
                    f"tensor has {n_dims} dimensions; GGUF tensors have at most {GGML_MAX_DIMS}"
                )
            ne = tuple(self.u64(f"dimension {d}") for d in range(n_dims))
            code = self.u32("the tensor type")
            offset = self.u64("the data offset")
            infos.append(_TensorInfo(name, ne, self._ggml_type(code), offset))
        self.where, self.tensor = "the header", None

        alignment = GGUF_DEFAULT_ALIGNMENT
        kv = kvs.get("general.alignment")
        if kv is not None:
            if kv.vtype != GGUFValueType.UINT32:
                raise self.fail(
                    f"general.alignment is a {_type_name(kv.vtype)}; it must be a UINT32"
                )
            (alignment,) = _U32.unpack_from(self.buf, kv.offset)
            if alignment == 0 or alignment & (alignment - 1):
                raise self.fail(f"general.alignment is {alignment}; it must be a power of two")
        data_start = -(-self.pos // alignment) * alignment
        self._check_padding(self.pos, data_start, n_tensors)
        return _Header(version, kvs, infos, alignment, data_start)

    def _check_padding(self, header_end: int, data_start: int, n_tensors: int) -> None:
        """The bytes between the header and the data start must be the zeros writers put
        there: anything else means the header ended somewhere it did not really end."""
        stop = min(data_start, self.size)
        if stop <= header_end:
            return
        if stop > self.avail:
            raise _NeedMore(stop)
        pad = np.frombuffer(self.buf, np.uint8, stop - header_end, header_end)
        nonzero = np.flatnonzero(pad)
        del pad  # a view holds the mapping; do not keep it
        if nonzero.size:
            at = header_end + int(nonzero[0])
            raise self.fail(
                f"the padding between the end of the header (byte {header_end}) and "
                f"the aligned data start (byte {data_start}) holds a non-zero byte at "
                f"byte {at}; writers pad with zeros, so the header is not as long as "
                f"it says: the tensor count ({n_tensors}) or a tensor info is wrong"
            )

    def _ggml_type(self, code: int) -> GGMLQuantizationType:
        try:
            ggml_type = GGMLQuantizationType(code)
        except ValueError:
            ggml_type = None
        if ggml_type is None or ggml_type not in GGML_QUANT_SIZES:
            raise self.fail(
                f"unknown ggml tensor type {code}; the gguf package (gguf-py) "
                f"installed knows {len(GGML_QUANT_SIZES)} types. If the file is from "
                f"a newer llama.cpp, upgrade the gguf package",
                redo=False,
            )
        return ggml_type


def _check_tensors(path: Path, header: _Header, size: int) -> list[tuple[TensorMeta, int, int]]:
    """(meta, begin, end) of each tensor, ``begin``/``end`` file offsets, in storage order."""
    placed = []
    for info in header.infos:

        def bad(msg: str, redo: bool = True, tensor: str = info.name) -> FormatError:
            return FormatError(
                f"{msg}{'; ' + _REDO if redo else ''}", file=str(path), tensor=tensor
            )

        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        kind = info.ggml_type.name
        if any(d > MAX_DIM for d in info.ne):
            raise bad(
                f"ne {list(info.ne)} has a dimension beyond 2**53: a strict reader refuses "
                f"dims beyond 2**53"
            )
        if math.prod(max(d, 1) for d in info.ne) > _INT64_MAX:
            raise bad(f"dimensions {list(info.ne)} overflow 64-bit sizes")
        ne0 = info.ne[0] if info.ne else 1
        if ne0 % block_size:
            raise bad(
                f"ne[0] (the row length) is {ne0}, not a multiple of the {kind} block size "
                f"{block_size}; the header is corrupt"
            )
        if info.offset % header.alignment:
            raise bad(
                f"data offset {info.offset} is not a multiple of the file's alignment "
                f"{header.alignment} (llama.cpp refuses such files); the header is corrupt"
            )
        n_elements = math.prod(info.ne)
        nbytes = n_elements // block_size * type_size
        begin = header.data_start + info.offset
        end = begin + nbytes
        if end > size:
            raise bad(
                f"data [{begin}, {end}) ({nbytes} bytes of {kind} at offset {info.offset} "
                f"from the data start {header.data_start}) runs past the end of the "
                f"{size}-byte file: the file is truncated or its header is corrupt"
            )
        dtype = _ELEMENT_TYPES.get(info.ggml_type)
        np_ne = tuple(reversed(info.ne))
        if dtype is None:  # raw blocks: the row length in bytes
            shape = np_ne[:-1] + (ne0 // block_size * type_size,) if info.ne else (type_size,)
            dtype = "uint8"
        else:
            shape = np_ne
        problem = shape_problem(shape, dtypes.itemsize(dtype))
        if problem:  # (the byte dim of raw blocks, times the other dims)
            raise bad(problem)
        meta = TensorMeta(info.name, shape, dtype)
        assert meta.nbytes == nbytes, (info, meta)
        placed.append((meta, begin, end))

    placed.sort(key=lambda t: (t[1], t[2]))  # storage order; stable
    _check_data_region(path, header, placed, size)
    return placed


def _check_data_region(
    path: Path, header: _Header, placed: list[tuple[TensorMeta, int, int]], size: int
) -> None:
    """No overlaps, and no unclaimed run of ``alignment`` bytes or more: writers pad each
    tensor only up to the alignment. ``placed`` is in storage order."""
    align = header.alignment
    cursor, prev = header.data_start, None
    for meta, begin, end in placed:
        if end == begin:
            continue  # an empty range overlaps nothing and claims nothing
        if begin < cursor:
            raise FormatError(
                f"data [{begin}, {end}) overlaps tensor {quote(prev)} (which ends "
                f"at {cursor}); every byte belongs to one tensor. The header is "
                f"corrupt; {_REDO}",
                file=str(path),
                tensor=meta.name,
            )
        if begin - cursor >= align:
            after = (
                f"after the end of tensor {quote(prev)}"
                if prev is not None
                else "after the data start"
            )
            raise FormatError(
                f"data [{begin}, {end}) starts {begin - cursor} bytes {after} (byte "
                f"{cursor}), leaving them unclaimed; writers pad only up to the "
                f"alignment ({align}), so the offsets or the tensor count are "
                f"wrong. The header is corrupt; {_REDO}",
                file=str(path),
                tensor=meta.name,
            )
        cursor, prev = end, meta.name
    if size - cursor >= align:
        last = f"the last tensor, {quote(prev)}," if prev is not None else "the data start"
        raise FormatError(
            f"{size - cursor} bytes after {last} (which ends at byte {cursor}) "
            f"belong to no tensor; writers pad only up to the alignment ({align}), "
            f"so the tensor count is too small, or the file was appended to. The "
            f"header is corrupt; {_REDO}",
            file=str(path),
        )


# ----------------------------------------------------------------------------------------------
# the checkpoint


def open_gguf(path: str | os.PathLike, files: Files = LOCAL_FILES) -> GGUFCheckpoint:
    """Open a ``.gguf`` file lazily, found in ``files`` (this machine's, or a checkpoint's
    in object storage). The header is validated before this returns
    (``FormatError`` otherwise); no tensor data is read.

    >>> ckpt = open_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")          # doctest: +SKIP
    >>> ckpt.meta("blk.0.attn_q.weight")                              # doctest: +SKIP
    TensorMeta(name='blk.0.attn_q.weight', shape=(576, 360), dtype='uint8')
    >>> ckpt.tensor_format("blk.0.attn_q.weight")                     # doctest: +SKIP
    {'ggml_type': 'Q4_1', 'block_size': 32, 'type_size': 20, 'ne': [576, 576]}
    """
    p = Path(path)
    if not files.lexists(p):
        raise FormatError("no such file", file=str(p))
    if p.is_dir():
        raise FormatError("not a file; pass the path of a .gguf file", file=str(p))
    # the source under its absolute path (what a read's refusal names), opening refusals
    # naming the path as given
    data = files.map_data(
        os.path.abspath(p), "the GGUF file", lambda msg: FormatError(msg, file=str(p))
    )
    try:
        if data.size == 0 or data.map is None:  # (only an empty file has no mapping)
            raise FormatError(
                f"file is empty: it is truncated or not a GGUF file; {_REDO}", file=str(p)
            )
        with gc_paused():  # see gc_paused: a header of many tensors must open in time linear in it
            header = _parse_header(p, data)
            tensors = _check_tensors(p, header, data.size)
            return GGUFCheckpoint(str(path), data, header, tensors)
    except BaseException:
        data.close()
        raise


#: an object's header is fetched this much at first, then twice as much each time the parse
#: needs more, up to ``MAX_FETCHED_HEADER`` (real headers, a 150k-token vocabulary with its
#: merges included, are tens of MB): a header that claims more is refused before it is fetched
FIRST_HEADER_FETCH = 1 << 20
MAX_FETCHED_HEADER = 512 << 20


def _parse_header(p: Path, data: ByteSource) -> _Header:
    """The validated header; for an object (a source whose bytes are fetched as asked for, not
    ``viewable``), parsed again on a longer prefix each time the parse reaches past what was
    fetched (a parse is milliseconds, a GET a round trip)."""
    if data.viewable:
        return _Parser(data.map, data.size, p).header()
    avail = min(data.size, FIRST_HEADER_FETCH)
    while True:
        data.need(0, avail)
        try:
            return _Parser(data.map, data.size, p, avail).header()
        except _NeedMore as more:
            if more.end > MAX_FETCHED_HEADER:
                raise FormatError(
                    f"the header reaches byte {more.end}, past the "
                    f"{MAX_FETCHED_HEADER}-byte limit on a header fetched from "
                    f"object storage: the header is corrupt or hostile (nothing "
                    f"past the limit was fetched)",
                    file=str(p),
                ) from None
            avail = min(data.size, max(2 * avail, more.end))


class GGUFCheckpoint(MappedCheckpoint):
    """The tensors of one validated, memory-mapped GGUF file, under their GGUF names.

    Made by ``open_gguf``. ``read`` and ``read_narrow`` are safe to call from several threads at
    once. After ``close()`` they, and ``field``, raise ``ValueError``; tensors already returned
    stay valid (they own their memory), and so does ``config``.

    ``config`` holds the key-values with arrays of up to ``CONFIG_MAX_ARRAY`` items;
    ``field(key)`` decodes any key, the tokenizer arrays included; ``field_names()`` lists them.
    """

    def __init__(
        self,
        source: str,
        data: ByteSource,
        header: _Header,
        tensors: list[tuple[TensorMeta, int, int]],
    ):
        # tensor offsets count from the start of the file (header.data_start included)
        super().__init__(source, [data], ((meta, 0, begin, end) for meta, begin, end in tensors))
        self.path = os.path.abspath(source)
        self.version: int = header.version
        self.alignment: int = header.alignment
        #: file offset of the tensor data (tensor offsets in the header count from here)
        self.data_offset: int = header.data_start
        # the whole file as numpy bytes, for decoding key-values on demand; a view through
        # numpy, so it keeps the mapping alive while a decode is in flight
        mapped = data.map
        assert mapped is not None, "open_gguf refuses an empty file, the one without a mapping"
        self._bytes: np.ndarray | None = np.frombuffer(mapped, dtype=np.uint8)
        self._kvs = header.kvs
        infos = {info.name: info for info in header.infos}
        self._format: dict[str, tuple[str, int, int, tuple[int, ...]]] = {
            meta.name: (
                infos[meta.name].ggml_type.name,
                *GGML_QUANT_SIZES[infos[meta.name].ggml_type],
                infos[meta.name].ne,
            )
            for meta, _, _ in tensors
        }
        self._config: dict[str, Any] | None = None

    # -- metadata ------------------------------------------------------------------------------

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    def tensor_format(self, name: str) -> dict:
        """``{"ggml_type": "Q4_1", "block_size": 32, "type_size": 20, "ne": [ne0, ne1, ...]}``.

        Every tensor has one; element types have block size 1 and type size their item size.
        """
        self.meta(name)
        ggml_type, block_size, type_size, ne = self._format[name]
        return {
            "ggml_type": ggml_type,
            "block_size": block_size,
            "type_size": type_size,
            "ne": list(ne),
        }

    def field_names(self) -> list[str]:
        """Every key of the file's key-values, in file order."""
        return list(self._kvs)

    def field(self, key: str) -> Any:
        """The value of any key: a Python scalar, a ``str``, or a list for an array, decoded
        now (arrays of strings as ``str``). ``KeyError`` if the file has no such key."""
        kv = self._kvs.get(key)
        if kv is None:
            raise KeyError(f"{self.source}: no key named {quote(key)}")
        with self._lock:
            buf = self._bytes  # a view: it keeps the mapping alive while we decode
        if buf is None:
            raise ValueError(
                f"{self.source}: checkpoint is closed; open it again to read key {quote(key)}"
            )
        self.check_unchanged(0)  # a decode reads the mapping too
        try:
            return _decode(buf, kv)
        except (UnicodeDecodeError, struct.error, ValueError) as e:  # the file changed under us
            raise FormatError(
                f"key {quote(key)} cannot be decoded ({e}); do not modify a "
                f"checkpoint while it is open",
                file=self.path,
            ) from None

    @property
    def config(self) -> dict:
        """The key-values as a plain dict, without arrays of over ``CONFIG_MAX_ARRAY`` items
        (use ``field`` for those). Built on first use; a new dict each time."""
        with self._lock:
            config, buf = self._config, self._bytes
        if config is None:
            if buf is None:
                raise ValueError(
                    f"{self.source}: checkpoint is closed; open it again to read its config"
                )
            self.check_unchanged(0)
            config = {
                kv.key: _decode(buf, kv)
                for kv in self._kvs.values()
                if kv.count <= CONFIG_MAX_ARRAY
            }
            with self._lock:
                if self._config is None:
                    self._config = config
                config = self._config
        return dict(config)

    # -- tensors -------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the file. Idempotent; tensors already returned stay valid, and so does
        ``config`` (built now if it was not yet)."""
        try:
            if self._config is None and self._bytes is not None:
                _ = self.config  # built while the bytes are still mapped
        except (ValueError, FormatError):
            pass  # closed by another thread meanwhile, or the file changed: no config then
        with self._lock:
            self._bytes = None  # drop our view first: it holds a buffer export on the map
        super().close()


def _decode(buf: np.ndarray, kv: _KV) -> Any:
    """The value ``kv`` points at, as Python objects. ``buf`` is the file's bytes."""
    if kv.vtype == GGUFValueType.STRING:
        return _strings(buf, kv.offset, 1)[0]
    if kv.vtype == GGUFValueType.ARRAY:
        if kv.subtype == GGUFValueType.STRING:
            return _strings(buf, kv.offset, kv.count)
        if kv.subtype is None:
            raise ValueError(f"GGUF key {kv.key!r}: an array without an element type")
        _, np_type = _SCALARS[kv.subtype]
        values = np.frombuffer(buf, np_type, kv.count, kv.offset)
        if kv.subtype == GGUFValueType.BOOL:
            values = values.astype(bool)
        return values.tolist()
    fmt, _ = _SCALARS[kv.vtype]
    # numpy's stubs do not declare ndarray's buffer protocol
    (value,) = struct.unpack_from(fmt, buf, kv.offset)  # type: ignore[arg-type]
    return bool(value) if kv.vtype == GGUFValueType.BOOL else value


def _strings(buf: np.ndarray, pos: int, count: int) -> list[str]:
    out, unpack = [], _U64.unpack_from
    for _ in range(count):
        (n,) = unpack(buf, pos)  # type: ignore[arg-type]  # (as in _decode)
        pos += 8
        if n > len(buf) - pos:
            raise ValueError(f"a string of {n} bytes at byte {pos} runs past the end of the file")
        out.append(str(buf[pos : pos + n].tobytes(), "utf-8"))
        pos += n
    return out
