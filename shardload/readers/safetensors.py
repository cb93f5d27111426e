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

* the header length is 1..100 MB and lies inside the file; the header is a UTF-8 JSON object
  with no duplicate keys and no NaN/Infinity;
* each entry has exactly ``dtype`` (a known one), ``shape`` (non-negative ints) and
  ``data_offsets`` (``[begin, end]``, ``begin <= end``), and ``end - begin`` is exactly what the
  shape and dtype need;
* the tensors tile the data buffer: inside it, no overlaps, no gaps, no trailing bytes
  (as the safetensors library requires);
* an index names only files inside its folder (no absolute paths, no ``..``, no symlinks out),
  every file it names exists, and it lists exactly the tensors each file holds.

Where we are stricter than the safetensors library (0.8), the code says so.

Files are mapped, not read: opening a checkpoint reads only the headers, and ``read`` copies one
tensor (or, with ``read_narrow``, one slice of it) out of the mapping. Files must not be
modified while a checkpoint has them open.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from .. import dtypes, strict_json
from ..errors import FormatError
from .base import TensorMeta
from .mapped import MappedCheckpoint, unmap

__all__ = ["open_safetensors", "SafetensorsCheckpoint", "INDEX_NAME", "MAX_HEADER_SIZE"]

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_SIZE = 100_000_000  # the safetensors library's limit: headers are small, files are not
_REDO = "re-download or re-save the checkpoint"


# ----------------------------------------------------------------------------------------------
# strict JSON


def _load_json(text: str, what: str, path: Path) -> Any:
    # Duplicate keys are refused: the library refuses duplicate fields inside an entry, but
    # silently keeps the last of two top-level entries with one name; we are stricter.
    try:
        return strict_json.loads(text)
    except ValueError as e:  # includes json.JSONDecodeError
        raise FormatError(f"{what} is not valid JSON: {e}; {_REDO}", file=path) from None


#: config files are small; a bigger one is a mistake
_MAX_CONFIG_BYTES = 16 << 20


def _read_small_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a small side file, ``None`` if it does not exist."""
    if not path.is_file():
        return None
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise FormatError(f"larger than {_MAX_CONFIG_BYTES} bytes; not a config file", file=path)
    obj = _load_json(path.read_bytes(), "the file", path)
    if not isinstance(obj, dict):
        raise FormatError("must hold a JSON object", file=path)
    return obj


# ----------------------------------------------------------------------------------------------
# one file


@dataclass
class _Shard:
    """One validated, mapped file."""

    path: Path
    metadata: dict[str, str]  # the header's __metadata__
    tensors: list[tuple[TensorMeta, int, int]]  # storage order; offsets into the data buffer
    data_start: int  # 8 + N
    map: mmap.mmap


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0  # type(), not isinstance(): JSON true is not a 1


def _check_entry(path: Path, name: str, entry: Any) -> tuple[TensorMeta, int, int]:
    """One header entry as (meta, begin, end), or a FormatError saying what is wrong with it."""
    def bad(msg: str) -> FormatError:
        return FormatError(f"{msg}; {_REDO}", file=path, tensor=name)

    if not isinstance(entry, dict):
        raise bad(f"header entry must be an object, got {type(entry).__name__}")
    want = {"dtype", "shape", "data_offsets"}
    if set(entry) != want:
        # The library ignores unknown keys; we refuse them, so a typo cannot go unnoticed.
        missing, extra = sorted(want - set(entry)), sorted(set(entry) - want)
        raise bad(f"header entry must have exactly dtype, shape and data_offsets "
                  f"(missing {missing}, unexpected {extra})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in dtypes.SAFETENSORS:
        raise bad(f"unknown dtype {dtype!r}; shardload reads {', '.join(dtypes.SAFETENSORS)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise bad(f"shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise bad(f"data_offsets must be [begin, end], two non-negative integers, got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets [{begin}, {end}] end before they begin")
    meta = TensorMeta(name, tuple(shape), dtypes.SAFETENSORS[dtype])
    if end - begin != meta.nbytes:
        raise bad(f"data_offsets [{begin}, {end}] span {end - begin} bytes, but shape {shape} of "
                  f"{dtype} needs {meta.nbytes}: the header lies about the size")
    return meta, begin, end


def _check_layout(path: Path, tensors: list[tuple[TensorMeta, int, int]], data_len: int) -> None:
    """The tensors must tile the data buffer exactly, as the safetensors library requires."""
    for meta, begin, end in tensors:  # bounds first: a cut file should be called truncated
        if end > data_len:
            raise FormatError(f"data_offsets [{begin}, {end}] run past the end of the "
                              f"{data_len}-byte data buffer: the file is truncated or the header "
                              f"is wrong; {_REDO}", file=path, tensor=meta.name)
    expected, prev = 0, None
    for meta, begin, end in tensors:  # sorted by (begin, end)
        if begin < expected:
            raise FormatError(f"data_offsets [{begin}, {end}] overlap tensor {prev!r} "
                              f"(which ends at {expected}); every byte belongs to one tensor. "
                              f"The header is corrupt; {_REDO}", file=path, tensor=meta.name)
        if begin > expected:
            after = f"after tensor {prev!r}" if prev is not None else "at the start of the buffer"
            raise FormatError(f"data_offsets [{begin}, {end}] leave a gap of {begin - expected} "
                              f"unclaimed bytes {after}; tensors must cover the data buffer "
                              f"exactly. The header is corrupt; {_REDO}", file=path, tensor=meta.name)
        expected, prev = end, meta.name
    if expected != data_len:
        raise FormatError(f"{data_len - expected} trailing bytes after the last tensor (the "
                          f"tensors end at {expected}, the data buffer at {data_len}); the file "
                          f"is corrupt or was appended to; {_REDO}", file=path)


def _open_shard(path: Path) -> _Shard:
    """Read, validate and map one file. Only the header is read; the data is mapped."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise FormatError(f"file is {size} bytes, too short for the 8-byte header length: it is "
                              f"truncated or not a safetensors file; {_REDO}", file=path)
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0:
            raise FormatError(f"header length is 0; a safetensors header is at least '{{}}'; "
                              f"{_REDO}", file=path)
        if n > MAX_HEADER_SIZE:
            raise FormatError(f"header length {n} is over the {MAX_HEADER_SIZE}-byte limit: the "
                              f"file is corrupt or not a safetensors file", file=path)
        if 8 + n > size:
            raise FormatError(f"header length {n} runs past the end of the {size}-byte file: the "
                              f"file is truncated; {_REDO}", file=path)
        raw = f.read(n)
        if len(raw) != n:
            raise FormatError("file shrank while being opened; do not modify a checkpoint while "
                              "it is loading", file=path)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"header is not valid UTF-8 ({e}); {_REDO}", file=path) from None
        # (Like the library, we accept whitespace around the JSON object.)
        header = _load_json(text, "header", path)
        if not isinstance(header, dict):
            raise FormatError(f"header must be a JSON object, got {type(header).__name__}; "
                              f"{_REDO}", file=path)

        # The library also takes "__metadata__": null; we want an object if the key is there.
        metadata = header.pop("__metadata__", {})
        if not (isinstance(metadata, dict)
                and all(isinstance(v, str) for v in metadata.values())):
            raise FormatError(f"__metadata__ must be an object of string -> string, got "
                              f"{metadata!r:.200}; {_REDO}", file=path)
        tensors = [_check_entry(path, name, entry) for name, entry in header.items()]
        tensors.sort(key=lambda t: (t[1], t[2]))  # storage order; stable, so ties keep header order
        data_start = 8 + n
        _check_layout(path, tensors, size - data_start)

        # ACCESS_COPY: a private copy-on-write mapping. torch sees a writable buffer (so no
        # "non-writable buffer" warning), and no write through a tensor can reach the file.
        # The mapping holds its own handle on the file, so the file object can be closed.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mapped) != size:
        mapped.close()
        raise FormatError("file changed size while being opened; do not modify a checkpoint "
                          "while it is loading", file=path)
    return _Shard(path, metadata, tensors, data_start, mapped)


# ----------------------------------------------------------------------------------------------
# the index of a sharded folder


def _read_index(index: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(metadata, weight_map) of an index file, checked to be the right shape."""
    try:
        text = index.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"index is not valid UTF-8 ({e})", file=index) from None
    obj = _load_json(text, "index", index)
    if not isinstance(obj, dict):
        raise FormatError(f"index must be a JSON object, got {type(obj).__name__}", file=index)
    weight_map = obj.get("weight_map")
    if not (isinstance(weight_map, dict)
            and all(isinstance(v, str) for v in weight_map.values())):
        raise FormatError('index needs a "weight_map" object of tensor name -> file name',
                          file=index)
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise FormatError('index "metadata" must be an object', file=index)
    return metadata, weight_map


def _shard_path(index: Path, file_name: str, tensor: str) -> Path:
    """The file an index entry names, refused unless it lies inside the index's folder."""
    def bad(msg: str) -> FormatError:
        return FormatError(f"weight_map names file {file_name!r}, {msg}; an index may only name "
                           f"files in its own folder", file=index, tensor=tensor)

    if not file_name or os.path.isabs(file_name):
        raise bad("an absolute or empty path")
    if ".." in Path(file_name).parts:
        raise bad("a path with '..'")
    folder = index.parent.resolve()
    path = index.parent / file_name
    if not path.resolve().is_relative_to(folder):  # resolve() follows symlinks
        raise bad(f"which resolves to {str(path.resolve())!r}, outside the folder")
    if not path.is_file():
        raise FormatError(f"file is missing: {index.name} lists it (for tensor {tensor!r} and "
                          f"maybe others); {_REDO}", file=path)
    return path


def _open_sharded(index: Path, source: str) -> "SafetensorsCheckpoint":
    index_metadata, weight_map = _read_index(index)
    listed: dict[str, list[str]] = {}  # file name -> the tensors the index puts in it
    for tensor, file_name in weight_map.items():
        listed.setdefault(file_name, []).append(tensor)
    paths = {fn: _shard_path(index, fn, names[0]) for fn, names in listed.items()}

    shards: list[_Shard] = []
    try:
        for file_name in sorted(listed):  # HF numbers its shards, so name order is storage order
            shard = _open_shard(paths[file_name])
            shards.append(shard)
            stored = {meta.name for meta, _, _ in shard.tensors}
            for tensor in listed[file_name]:
                if tensor not in stored:
                    raise FormatError(f"{index.name} puts this tensor in {file_name!r}, but the "
                                      f"file does not hold it; {_REDO}",
                                      file=shard.path, tensor=tensor)
            for tensor in sorted(stored - set(listed[file_name])):
                other = weight_map.get(tensor)
                why = (f"{index.name} puts it in {other!r}: a tensor name must be in one file only"
                       if other is not None else f"{index.name} does not list it")
                raise FormatError(f"tensor is stored in this file, but {why}; {_REDO}",
                                  file=shard.path, tensor=tensor)
        return SafetensorsCheckpoint(source, shards, index_metadata)
    except BaseException:
        for shard in shards:
            unmap(shard.map)
        raise


# ----------------------------------------------------------------------------------------------
# the checkpoint


def open_safetensors(path: str | os.PathLike) -> "SafetensorsCheckpoint":
    """Open a ``.safetensors`` file, a folder holding one, or an HF-sharded folder, lazily.

    A sharded folder is recognised by ``model.safetensors.index.json``; the index file's own path
    is accepted too. Every header is validated before this returns (``FormatError`` otherwise).
    """
    p = Path(path)
    source = str(path)
    if not p.exists():
        raise FormatError("no such file or folder", file=p)
    if p.is_dir():
        if (p / INDEX_NAME).is_file():
            return _open_sharded(p / INDEX_NAME, source)
        found = sorted(f for f in p.glob("*.safetensors") if f.is_file())
        if not found:
            raise FormatError(f"folder holds no *.safetensors file and no {INDEX_NAME}", file=p)
        if len(found) > 1:
            names = ", ".join(f.name for f in found[:5]) + (", ..." if len(found) > 5 else "")
            raise FormatError(f"folder holds {len(found)} .safetensors files ({names}) but no "
                              f"{INDEX_NAME} saying which tensor is in which; add the index, or "
                              f"pass the one file to load", file=p)
        p = found[0]
    elif p.name.endswith(".index.json"):
        return _open_sharded(p, source)
    elif p.suffix != ".safetensors":
        raise FormatError("not a .safetensors file, an index, or a folder of them", file=p)
    shard = _open_shard(p)
    try:
        return SafetensorsCheckpoint(source, [shard])
    except BaseException:
        unmap(shard.map)
        raise


class SafetensorsCheckpoint(MappedCheckpoint):
    """Tensors in one or more validated, memory-mapped safetensors files.

    Made by ``open_safetensors``. ``read`` and ``read_narrow`` are safe to call from several
    threads at once. After ``close()`` they raise ``ValueError``; tensors already returned stay
    valid (they own their memory). ``file_metadata`` holds each file's ``__metadata__`` and
    ``index_metadata`` the index's ``metadata`` (empty without an index).
    """

    def __init__(self, source: str, shards: list[_Shard],
                 index_metadata: dict[str, Any] | None = None):
        super().__init__(source, [str(s.path) for s in shards], [s.map for s in shards],
                         ((meta, i, begin, end) for i, shard in enumerate(shards)
                          for meta, begin, end in shard.tensors),
                         [s.data_start for s in shards])
        self.path = os.path.abspath(source)
        self.file_metadata: dict[str, dict[str, str]] = {str(s.path): s.metadata for s in shards}
        self.index_metadata: dict[str, Any] = dict(index_metadata or {})
        self._config: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any]:
        """The folder's HF ``config.json``, with ``quantize_config.json`` (AutoGPTQ) as its
        ``quantization_config`` when the config has none; ``{}`` without a config.json."""
        if self._config is None:
            folder = Path(self.path if os.path.isdir(self.path) else os.path.dirname(self.path))
            config = _read_small_json(folder / "config.json") or {}
            quant = _read_small_json(folder / "quantize_config.json")
            if quant and "quantization_config" not in config:
                config["quantization_config"] = {"quant_method": "gptq", **quant}
            self._config = config
        return self._config
