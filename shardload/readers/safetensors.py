"""The safetensors reader: the one place where safetensors bytes are trusted or refused.

A ``.safetensors`` file is::

    [8 bytes]  N, the header length, a little-endian u64
    [N bytes]  the header: a UTF-8 JSON object
               {"__metadata__": {str: str},                        (optional)
                "<tensor name>": {"dtype": "F16", "shape": [4, 2], "data_offsets": [begin, end]},
                ...}
    [rest]     the data buffer; each tensor's bytes, C order, little-endian, lie at
               [begin, end) counted from the start of the data buffer

An HF-sharded checkpoint is a folder of such files plus ``model.safetensors.index.json``:
``{"metadata": {...}, "weight_map": {tensor name: file name}}``.

Trust rules. A checkpoint is input from outside, so every header is checked here, at open time,
before anything is read, and every failure is a ``FormatError`` naming the file and tensor.
After ``open_safetensors`` returns, a read is a bounds-checked copy and nothing more:

* every file read or mapped (the checkpoint, each shard, the index, ``config.json``,
  ``quantize_config.json``) is, once symlinks are followed, a regular file: a FIFO, a device, a
  directory, a symlink loop or a dangling link is refused by name, never opened in a way that
  could block (``shardload.files.open_regular``); unreadable files are refused the same way;
* the header length is 1..100 MB and lies inside the file; the header is a UTF-8 JSON object
  with no duplicate keys and no NaN/Infinity;
* each entry has a non-empty name that is valid Unicode (no lone surrogate from a ``\ud800``
  escape) and exactly ``dtype`` (a known one), ``shape`` (non-negative ints, each at most 2**53,
  at most 64 of them, their product within 64-bit sizes) and ``data_offsets`` (``[begin, end]``,
  ``begin <= end``), and ``end - begin`` is exactly what the shape and dtype need;
* the tensors tile the data buffer: inside it, no overlaps, no gaps, no trailing bytes
  (as the safetensors library requires);
* an index is at most 64 MiB of UTF-8 JSON; every file name in its ``weight_map`` is checked *by
  name* before anything is opened: a plain relative path inside the index's folder (not
  absolute, no ``..`` or ``.`` component, no NUL, no drive letter, no backslash, at most 1024
  characters: ``shardload.files.check_member_name``). Where the name leads on the user's file
  system is not the checkpoint's business: in the Hugging Face hub cache
  ``snapshots/<rev>/model-00001-of-00002.safetensors`` is a symlink to ``../../blobs/<sha256>``,
  and that loads. Every file it names exists, and it lists exactly the tensors each file holds.

Opening is linear in the header's size, in time and in memory: a 60 MB header of a million
(empty) tensors opens in seconds, not minutes, and at its peak takes at most 6x the header's
bytes (docs/performance.md): the header is parsed a piece at a time by json's C parser and its
entries checked together (``safetensors_bulk``), or, where that declines (an escape in a name,
a header it cannot vouch for), one entry at a time (``strict_json.loads_object``), which says
what is wrong; each tensor is kept as one ``TensorMeta``, its offsets in arrays. A checkpoint in
object storage has its files' headers fetched at once (``_fetch_headers``).

Where we are stricter than the safetensors library (0.8), the code says so.

Files are mapped, not read: opening a checkpoint reads only the headers, and ``read`` copies one
tensor (or, with ``read_narrow``, one slice of it) out of the mapping. A file that changes while
a checkpoint has it open is refused before the next tensor is copied (see ``mapped.py``).
"""

from __future__ import annotations

import os
import struct
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes, strict_json
from ..dtypes import shape_problem
from ..errors import FormatError, quote
from ..files import MAX_SIDE_FILE_BYTES, check_member_name, open_regular, read_json
from ..limits import MAX_DIM, MAX_NDIM
from ..sources.bytesource import LOCAL_FILES, ByteSource, Files, fetch_each
from ..strict_json import gc_paused
from .base import MAX_INDEX_BYTES, TensorMeta
from .mapped import MappedCheckpoint, TensorTable
from .safetensors_bulk import SHAPES_KEPT, parse_header

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER_SIZE",
    "MAX_INDEX_BYTES",
    "SafetensorsCheckpoint",
    "open_safetensors",
]

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_SIZE = 100_000_000  # the safetensors library's limit: headers are small, files are not
#: the bytes of each file of a checkpoint in object storage its open asks for first
#: (``_fetch_headers``): DeepSeek-V3's and Qwen3-235B's headers are about 75 KB a file
HEADER_GUESS = 128 << 10
_REDO = "re-download or re-save the checkpoint"


# ----------------------------------------------------------------------------------------------
# strict JSON


def _load_header(
    raw: bytearray, path: Path, data_len: int, shapes: dict
) -> tuple[dict[str, Any], dict[str, TensorMeta], array, array]:
    """``(__metadata__ as found, tensors by name in header order, begins, ends)``: checked in
    bulk (``safetensors_bulk``), or where that does not accept the header, member by member
    through ``_entry_reader`` (``strict_json.loads_object``), which says what is wrong. Either
    way the parsed JSON of a million entries never exists at once. ``raw`` is emptied as soon
    as it is decoded: the text is all that stays while parsing."""
    # Duplicate keys are refused (strict_json): the library refuses duplicate fields inside an
    # entry, but silently keeps the last of two top-level entries with one name.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"header is not valid UTF-8 ({exc}); JSON files must be UTF-8; {_REDO}", file=str(path)
        ) from None
    finally:
        del raw[:]
    fast = parse_header(text, data_len, shapes)
    if fast is not None:
        return fast
    begins, ends = array("q"), array("q")
    try:
        tensors = strict_json.loads_object(
            text, _entry_reader(path, data_len, begins, ends, shapes)
        )
    except strict_json.NotAnObjectError as exc:
        raise FormatError(
            f"header must be a JSON object, got {exc.type_name}; {_REDO}", file=str(path)
        ) from None
    except ValueError as exc:  # includes json.JSONDecodeError
        raise FormatError(f"header is not valid JSON: {exc}; {_REDO}", file=str(path)) from None
    # The library also takes "__metadata__": null; we want an object if the key is there.
    return tensors.pop("__metadata__", {}), tensors, begins, ends


def _read_small_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a small side file, ``None`` if there is no file of that name.

    A name that is there but leads nowhere readable (a dangling link, a FIFO, a folder) is an
    error, not an absent file: the user meant something by it.
    """
    if not os.path.lexists(path):
        return None
    obj = read_json(path, MAX_SIDE_FILE_BYTES, f"the config file {path.name}")
    if not isinstance(obj, dict):
        raise FormatError(
            f"the config file {path.name} must hold a JSON object, got {type(obj).__name__}",
            file=str(path),
        )
    return obj


# ----------------------------------------------------------------------------------------------
# one file


@dataclass
class _Shard:
    """One validated, mapped file."""

    path: Path
    metadata: dict[str, str]  # the header's __metadata__
    tensors: dict[str, TensorMeta]  # storage order
    begins: array  # each tensor's offsets into the data buffer, in the order of `tensors`
    ends: array
    data_start: int  # 8 + N
    source: ByteSource  # the file's bytes: its mapping, or an object's


_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
#: header dtype -> (canonical name, item size), looked up once per entry
_DTYPES: dict[str, tuple[str, int]] = {
    code: (name, dtypes.itemsize(name)) for code, name in dtypes.SAFETENSORS.items()
}


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0  # type(), not isinstance(): JSON true is not a 1


def _bad_name(path: Path, name: str) -> FormatError | None:
    if not name:
        return FormatError(
            f"a header entry has an empty name; every tensor needs one; {_REDO}", file=str(path)
        )
    if not strict_json.is_text(name):
        return FormatError(
            f"header entry name {quote(name)} is not valid Unicode (a lone "
            f"surrogate escape); {_REDO}",
            file=str(path),
        )
    return None


def _entry_error(path: Path, name: str, entry: Any) -> FormatError:
    """What is wrong with an entry the fast check in ``_check_entries`` did not accept."""

    def bad(msg: str) -> FormatError:
        return FormatError(f"{msg}; {_REDO}", file=str(path), tensor=name)

    if not isinstance(entry, dict):
        return bad(f"header entry must be an object, got {type(entry).__name__}")
    if entry.keys() != _ENTRY_KEYS:
        # The library ignores unknown keys; we refuse them, so a typo cannot go unnoticed.
        missing = sorted(_ENTRY_KEYS - set(entry))
        extra = [quote(k) for k in sorted(set(entry) - _ENTRY_KEYS)]
        return bad(
            f"header entry must have exactly dtype, shape and data_offsets "
            f"(missing {missing}, unexpected [{', '.join(extra)}])"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        return bad(f"unknown dtype {quote(dtype)}; shardload reads {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        return bad(f"shape must be a list of non-negative integers, got {quote(shape)}")
    problem = shape_problem(shape, _DTYPES[dtype][1])
    if problem:
        return bad(problem)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        return bad(
            f"data_offsets must be [begin, end], two non-negative integers, got {quote(offsets)}"
        )
    begin, end = offsets
    if begin > end:
        return bad(f"data_offsets [{begin}, {end}] end before they begin")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * _DTYPES[dtype][1]
    return bad(
        f"data_offsets [{begin}, {end}] span {end - begin} bytes, but shape {shape} of "
        f"{dtype} needs {nbytes}: the header lies about the size"
    )


def _entry_reader(
    path: Path, data_len: int, begins: array, ends: array, shapes: dict
) -> Callable[[str, Any], Any]:
    """The ``convert`` for ``strict_json.loads_object``: each header entry, as it is parsed,
    checked and kept as a ``TensorMeta``, its offsets appended to ``begins`` and ``ends``;
    a ``FormatError`` saying what is wrong with a bad one. ``__metadata__`` is passed through
    for the caller to check.

    These are the rules; ``safetensors_bulk`` keeps them at C speed, and a header it does not
    accept comes here. A few type tests and int comparisons per entry, inline: an entry this
    does not accept goes to ``_entry_error``, which makes the same checks one at a time to say
    which one failed.
    """
    keys, known, max_dim, max_ndim = _ENTRY_KEYS, _DTYPES, MAX_DIM, MAX_NDIM
    add_begin, add_end = begins.append, ends.append
    # one tuple per distinct shape (``shapes``, shared by a checkpoint's files): real
    # checkpoints repeat a few dozen shapes many times (a header of a million distinct ones
    # empties the cache now and then rather than double it)
    shared = shapes.setdefault

    def check(name: str, entry: Any) -> Any:
        if name == "__metadata__":
            return entry
        if not name.isascii() or not name:  # isascii() is O(1); only non-ASCII can be a surrogate
            err = _bad_name(path, name)
            if err:
                raise err
        if type(entry) is not dict or entry.keys() != keys:
            raise _entry_error(path, name, entry)
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        spec = known.get(dtype) if type(dtype) is str else None
        if (
            spec is None
            or type(shape) is not list
            or len(shape) > max_ndim
            or type(offsets) is not list
            or len(offsets) != 2
        ):
            raise _entry_error(path, name, entry)
        numel = 1
        for d in shape:
            if type(d) is not int or not 0 <= d <= max_dim:
                raise _entry_error(path, name, entry)
            numel *= d
        begin, end = offsets
        if (
            type(begin) is not int
            or type(end) is not int
            or not 0 <= begin <= end
            or end - begin != numel * spec[1]
        ):
            raise _entry_error(path, name, entry)
        # A tensor holding bytes fits the file, so its size fits 64 bits; an empty one may
        # still hide dimensions whose product does not (one dimension alone always fits).
        if numel == 0 and len(shape) > 1 and shape_problem(shape, spec[1]):
            raise _entry_error(path, name, entry)
        if end > data_len:  # here, before the layout: a cut file should be called truncated
            raise FormatError(
                f"data_offsets [{begin}, {end}] run past the end of the "
                f"{data_len}-byte data buffer: the file is truncated or the "
                f"header is wrong; {_REDO}",
                file=str(path),
                tensor=name,
            )
        add_begin(begin)
        add_end(end)
        shape = tuple(shape)
        if len(shapes) >= SHAPES_KEPT:
            shapes.clear()
        return TensorMeta(name, shared(shape, shape), spec[0])

    return check


def _tiled(begins: array, ends: array, data_len: int) -> bool:
    """Whether the tensors, in header order, tile the data buffer: each begins where the one
    before it ends (so header order is storage order), the first at 0, the last at the end.
    What writers write, checked with array comparisons; anything else goes to
    ``_storage_order`` and ``_check_layout``. (Each tensor's ``begin <= end`` is checked.)"""
    if not begins:
        return data_len == 0
    return begins[0] == 0 and ends[-1] == data_len and begins[1:] == ends[:-1]


def _check_layout(
    path: Path, tensors: dict[str, TensorMeta], begins: array, ends: array, data_len: int
) -> None:
    """The tensors, in storage order and each inside the buffer (``_entry_reader``), must tile
    the data buffer exactly, as the safetensors library requires."""
    expected, prev = 0, None
    for name, begin, end in zip(tensors, begins, ends):
        if begin != expected:
            if begin < expected:
                raise FormatError(
                    f"data_offsets [{begin}, {end}] overlap tensor {quote(prev)} "
                    f"(which ends at {expected}); every byte belongs to one "
                    f"tensor. The header is corrupt; {_REDO}",
                    file=str(path),
                    tensor=name,
                )
            after = (
                f"after tensor {quote(prev)}" if prev is not None else "at the start of the buffer"
            )
            raise FormatError(
                f"data_offsets [{begin}, {end}] leave a gap of {begin - expected} "
                f"unclaimed bytes {after}; tensors must cover the data buffer "
                f"exactly. The header is corrupt; {_REDO}",
                file=str(path),
                tensor=name,
            )
        if end != begin:
            expected, prev = end, name
    if expected != data_len:
        raise FormatError(
            f"{data_len - expected} trailing bytes after the last tensor (the "
            f"tensors end at {expected}, the data buffer at {data_len}); the file "
            f"is corrupt or was appended to; {_REDO}",
            file=str(path),
        )


def _storage_order(
    tensors: dict[str, TensorMeta], begins: array, ends: array
) -> tuple[dict[str, TensorMeta], array, array]:
    """The tensors sorted by (begin, end), ties in header order. Writers list tensors in
    storage order or close to it, so first check in one pass whether there is anything to do;
    a sort sorts the offsets (numpy: 8 bytes a tensor, not a tuple of Python ints each)."""
    prev_begin = prev_end = 0
    for begin, end in zip(begins, ends):
        if begin < prev_begin or (begin == prev_begin and end < prev_end):
            break
        prev_begin, prev_end = begin, end
    else:
        return tensors, begins, ends
    b, e = np.frombuffer(begins, dtype=np.int64), np.frombuffer(ends, dtype=np.int64)
    order = np.lexsort((e, b))  # stable: the last key sorts first
    names = list(tensors)
    tensors = {names[k]: tensors[names[k]] for k in order.tolist()}
    return tensors, array("q", b[order].tobytes()), array("q", e[order].tobytes())


def _open_shard(path: Path, files: Files, shapes: dict | None = None) -> _Shard:
    """Read, validate and map one file of ``files``. Only the header is read; the data is
    mapped (or, for an object, fetched as it is needed: ``Files.map_data``). ``shapes`` shares
    equal shape tuples between the files of a checkpoint."""
    data = files.map_data(path, "the file", None)
    try:
        return _shard_of(path, data, {} if shapes is None else shapes)
    except BaseException:
        data.close()
        raise


def _shard_of(path: Path, data: ByteSource, shapes: dict) -> _Shard:
    size, mapped = data.size, data.map
    if size < 8 or mapped is None:  # (only an empty file has no mapping)
        raise FormatError(
            f"file is {size} bytes, too short for the 8-byte header length: it "
            f"is truncated or not a safetensors file; {_REDO}",
            file=str(path),
        )
    data.need(0, 8)
    (n,) = struct.unpack_from("<Q", mapped, 0)
    if n == 0:
        raise FormatError(
            f"header length is 0; a safetensors header is at least '{{}}'; {_REDO}", file=str(path)
        )
    if n > MAX_HEADER_SIZE:
        raise FormatError(
            f"header length {n} is over the {MAX_HEADER_SIZE}-byte limit: the "
            f"file is corrupt or not a safetensors file",
            file=str(path),
        )
    if 8 + n > size:
        raise FormatError(
            f"header length {n} runs past the end of the {size}-byte file: the "
            f"file is truncated; {_REDO}",
            file=str(path),
        )
    data.need(8, 8 + n)
    raw = bytearray(n)
    with memoryview(mapped) as view:  # released before the mapping may be closed
        raw[:] = view[8 : 8 + n]
    data.release(0, 8 + n)  # the header's pages: its text is all that is kept
    data_start = 8 + n
    data_len = size - data_start
    # (Like the library, we accept whitespace around the JSON object.)
    metadata, tensors, begins, ends = _load_header(raw, path, data_len, shapes)
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise FormatError(
            f"__metadata__ must be an object of string -> string, got {quote(metadata)}; {_REDO}",
            file=str(path),
        )
    for key, value in metadata.items():
        for text in (key, value):
            if not strict_json.is_text(text):
                raise FormatError(
                    f"__metadata__ holds {quote(text)}, which is not valid "
                    f"Unicode (a lone surrogate escape); {_REDO}",
                    file=str(path),
                )
    if not _tiled(begins, ends, data_len):  # the common case, checked in C; else say why
        tensors, begins, ends = _storage_order(tensors, begins, ends)
        _check_layout(path, tensors, begins, ends, data_len)
    return _Shard(path, metadata, tensors, begins, ends, data_start, data)


# ----------------------------------------------------------------------------------------------
# the index of a sharded folder


def _read_index(index: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(metadata, weight_map) of an index file, checked to be the right shape."""
    obj = read_json(index, MAX_INDEX_BYTES, "the index", hint=f"; {_REDO}")
    if not isinstance(obj, dict):
        raise FormatError(f"index must be a JSON object, got {type(obj).__name__}", file=str(index))
    weight_map = obj.get("weight_map")
    if not (isinstance(weight_map, dict) and set(map(type, weight_map.values())) <= {str}):
        raise FormatError(
            'index needs a "weight_map" object of tensor name -> file name', file=str(index)
        )
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError('index "metadata" must be an object', file=str(index))
    return metadata, weight_map


def _first_listed(weight_map: dict[str, str], file_name: str) -> str:
    """The first tensor the index puts in ``file_name`` (for a message)."""
    return next(t for t, f in weight_map.items() if f == file_name)


def _shard_path(index: Path, file_name: str, weight_map: dict[str, str], files: Files) -> Path:
    """The file an index entry names, refused by name unless it is a plain relative path inside
    the index's folder. The path may be a symlink to anywhere (the hub cache's blobs): what it
    leads to is checked to be a regular file when it is opened."""
    try:
        check_member_name(file_name, index=index, what="weight_map names file")
    except FormatError as e:
        raise FormatError(
            e.reason, file=str(index), tensor=_first_listed(weight_map, file_name)
        ) from None
    path = index.parent / file_name
    if not files.lexists(path):
        raise FormatError(
            f"file is missing: {index.name} lists it (for tensor "
            f"{quote(_first_listed(weight_map, file_name))} and maybe others); "
            f"{_REDO}",
            file=str(path),
        )
    return path


def _check_listed(index: Path, weight_map: dict[str, str], file_name: str, shard: _Shard) -> None:
    """The tensors the index puts in ``file_name`` are exactly those the file holds."""
    listed = [t for t, f in weight_map.items() if f == file_name]
    stored = shard.tensors
    for tensor in listed:
        if tensor not in stored:
            raise FormatError(
                f"{index.name} puts this tensor in {quote(file_name)}, but the file "
                f"does not hold it; {_REDO}",
                file=str(shard.path),
                tensor=tensor,
            )
    for tensor in sorted(set(stored) - set(listed)):  # (the names listed are all stored)
        other = weight_map.get(tensor)
        why = (
            f"{index.name} puts it in {quote(other)}: a tensor name must be in one file only"
            if other is not None
            else f"{index.name} does not list it"
        )
        raise FormatError(
            f"tensor is stored in this file, but {why}; {_REDO}",
            file=str(shard.path),
            tensor=tensor,
        )


def _fetch_headers(paths: list[Path], files: Files) -> dict[Path, BaseException]:
    """Where the files are objects in object storage (``Files.remote``), each one's header
    fetched now, all of them at once (``sources.bytesource.fetch_each``): opened in turn, 200 files
    would wait 400 round trips (the length, then the header). Each file's first GET asks for
    its first ``HEADER_GUESS`` bytes, as the Hugging Face hub's reader does: the header of a
    file of a large checkpoint lies within, so one round trip fetches it; a longer header's
    rest is a second GET, and a length the rules refuse fetches nothing more (it is refused
    when the file is opened). Returns what fetching failed with, by path, up to the first
    failure (each file after it is left to be fetched, if ever, when it is opened); opening
    in order raises it where it would have met it."""
    remote = [(path, data) for path in paths if (data := files.remote(path)) is not None]
    if len(remote) < 2:
        return {}

    def fetch(data: ByteSource) -> None:
        first = min(data.size, HEADER_GUESS)
        if first < 8 or data.map is None:
            return
        data.need(0, first, small=True)
        (n,) = struct.unpack_from("<Q", data.map, 0)
        if 0 < n <= MAX_HEADER_SIZE and first < 8 + n <= data.size:
            data.need(first, 8 + n, small=True)

    failed = fetch_each([data for _, data in remote], fetch)
    return {remote[k][0]: exc for k, exc in failed.items()}


def _open_sharded(index: Path, source: str, files: Files) -> SafetensorsCheckpoint:
    index_metadata, weight_map = _read_index(index)
    # how many tensors the index puts in each file, the files in the order it first names them
    counts = Counter(weight_map.values())
    # every name is checked before any file is opened
    paths = {fn: _shard_path(index, fn, weight_map, files) for fn in counts}

    order = sorted(counts)  # HF numbers its shards, so name order is storage order
    failed = _fetch_headers([paths[fn] for fn in order], files)
    shards: list[_Shard] = []
    shapes: dict = {}  # one tuple per distinct shape, for all the files
    try:
        for file_name in order:
            if paths[file_name] in failed:  # what opening it would have met
                raise failed[paths[file_name]]
            shard = _open_shard(paths[file_name], files, shapes)
            shards.append(shard)
            # The index lists exactly this file's tensors if it puts each of them here and
            # puts as many here as there are: counted in C, and said in words where not.
            stored = shard.tensors
            if counts[file_name] != len(stored) or list(map(weight_map.get, stored)).count(
                file_name
            ) != len(stored):
                _check_listed(index, weight_map, file_name, shard)
        return SafetensorsCheckpoint(source, shards, index_metadata)
    except BaseException:
        for shard in shards:
            shard.source.close()
        raise


# ----------------------------------------------------------------------------------------------
# the checkpoint


def open_safetensors(path: str | os.PathLike, files: Files = LOCAL_FILES) -> SafetensorsCheckpoint:
    """Open a ``.safetensors`` file, a folder holding one, or an HF-sharded folder, lazily,
    finding its data files in ``files`` (this machine's, or a checkpoint's in object storage).

    A sharded folder is recognised by ``model.safetensors.index.json``; the index file's own path
    is accepted too. Every header is validated before this returns (``FormatError`` otherwise).
    """
    with gc_paused():  # see gc_paused: a header of a million tensors must open in seconds
        return _open(Path(path), str(path), files)


def _open(p: Path, source: str, files: Files) -> SafetensorsCheckpoint:
    if not files.lexists(p):
        raise FormatError("no such file or folder", file=str(p))
    if p.is_dir():
        # By name, not by what the name leads to: an index that is a dangling link or a FIFO
        # is refused, not silently passed over for the folder's other files.
        if os.path.lexists(p / INDEX_NAME):
            return _open_sharded(p / INDEX_NAME, source, files)
        # whatever they are: see _open_shard
        found = [p / name for name in files.glob(p, ".safetensors")]
        if not found:
            ggufs = files.glob(p, ".gguf")
            hint = f"; a GGUF checkpoint is one file: pass it ({p / ggufs[0]})" if ggufs else ""
            raise FormatError(
                f"folder holds no checkpoint shardload reads: no *.safetensors "
                f"file or {INDEX_NAME} (Hugging Face), no tensor-cache.json (MLC), "
                f"and a GGUF checkpoint is a .gguf file{hint}",
                file=str(p),
            )
        if len(found) > 1:
            names = ", ".join(f.name for f in found[:5]) + (", ..." if len(found) > 5 else "")
            raise FormatError(
                f"folder holds {len(found)} .safetensors files ({names}) but no "
                f"{INDEX_NAME} saying which tensor is in which; add the index, or "
                f"pass the one file to load",
                file=str(p),
            )
        p = found[0]
    elif p.name.endswith(".index.json"):
        return _open_sharded(p, source, files)
    elif p.suffix != ".safetensors":
        # what the path is comes first: "a FIFO" says more than "not a .safetensors file"
        f, _ = open_regular(p, "the checkpoint")
        f.close()
        raise FormatError("not a .safetensors file, an index, or a folder of them", file=str(p))
    shard = _open_shard(p, files)
    try:
        return SafetensorsCheckpoint(source, [shard])
    except BaseException:
        shard.source.close()
        raise


#: files beside config.json holding the quantization config when config.json has none, and the
#: ``quant_method`` they imply: AutoGPTQ's, and ModelOpt's (its settings under "quantization")
QUANT_SIDE_FILES = {"quantize_config.json": "gptq", "hf_quant_config.json": "modelopt"}


class SafetensorsCheckpoint(MappedCheckpoint):
    """Tensors in one or more validated, memory-mapped safetensors files.

    Made by ``open_safetensors``. ``read`` and ``read_narrow`` are safe to call from several
    threads at once. After ``close()`` they raise ``ValueError``; tensors already returned stay
    valid (they own their memory). ``file_metadata`` holds each file's ``__metadata__`` and
    ``index_metadata`` the index's ``metadata`` (empty without an index).
    """

    def __init__(
        self, source: str, shards: list[_Shard], index_metadata: dict[str, Any] | None = None
    ):
        table = TensorTable()
        for i, shard in enumerate(shards):
            table.extend(i, shard.tensors, shard.begins, shard.ends)
            shard.tensors = shard.begins = shard.ends = None  # type: ignore[assignment]
        super().__init__(source, [s.source for s in shards], table, [s.data_start for s in shards])
        self.path = os.path.abspath(source)
        self.file_metadata: dict[str, dict[str, str]] = {str(s.path): s.metadata for s in shards}
        self.index_metadata: dict[str, Any] = dict(index_metadata or {})
        self._config: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The folder's HF ``config.json``, with ``quantize_config.json`` (AutoGPTQ) or
        ``hf_quant_config.json``'s ``quantization`` (NVIDIA ModelOpt) as its
        ``quantization_config`` when the config has none; ``{}`` without a config.json."""
        if self._config is None:
            path = os.path.abspath(self.source) if self.path is None else self.path
            folder = Path(path if os.path.isdir(path) else os.path.dirname(path))
            config = _read_small_json(folder / "config.json") or {}
            for side, method in QUANT_SIDE_FILES.items():
                if "quantization_config" in config:
                    break
                quant = _read_small_json(folder / side)
                if quant and method == "modelopt":
                    quant = quant.get("quantization")
                if quant and isinstance(quant, dict):
                    config["quantization_config"] = {"quant_method": method, **quant}
            self._config = config
        return self._config
