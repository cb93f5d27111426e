"""The MLC-LLM reader: TVM "tensor cache" folders, validated strictly and read through mmap.

An MLC-LLM weight folder (what ``mlc_llm convert_weight`` writes) holds::

    tensor-cache.json       the index (``ndarray-cache.json`` before TVM renamed it)
    params_shard_0.bin      raw tensor bytes, one file per shard record
    params_shard_1.bin ...
    mlc-chat-config.json    model and quantization settings (optional here)

The index, as TVM's ``tvm.contrib.tvmjs.dump_tensor_cache`` writes it and TVM's
``src/runtime/vm/tensor_cache_support.cc`` reads it::

    {"metadata": {"ParamSize": 291, "ParamBytes": 4.0e9, "BitsPerParam": 4.5},
     "records": [                                   # one per shard file
       {"dataPath": "params_shard_0.bin", "format": "raw-shard",
        "nbytes": <the file's size>, "md5sum": "<hex>",          (md5sum: optional)
        "records": [                                # the tensors in that file
          {"name": "model.layers.0.self_attn.qkv_proj.q_weight", "shape": [12288, 512],
           "dtype": "uint32", "format": "f32-to-bf16", "nbytes": 25165824, "byteOffset": 0},
          ...]},
       ...]}

Record formats. ``"raw"``: the bytes are the tensor, C order, little-endian. ``"f32-to-bf16"``:
the writer was asked to store float32 tensors as bfloat16 bits (the high 16 bits, rounded to
nearest even); the conversion applies to records whose ``dtype`` is ``"float32"`` only, and every
other record under that label is raw. MLC's ``convert_weight`` labels *every* record
``"f32-to-bf16"``, so a q4f16_1 ``q_weight`` reads ``"dtype": "uint32", "format":
"f32-to-bf16"`` and is plain uint32. TVM's loader widens an f32-to-bf16 float32 tensor back to
float32 (bf16 bits << 16); this reader instead exposes it as what is stored, a **bfloat16**
tensor of the record's shape (``nbytes == numel * 2``), so reads stay one copy of the stored
bytes and ``read_narrow`` reads only the slice. Widening it is exact:
``t.to(torch.float32)``. ``tensor_format`` reports the record's format, so a caller can tell.

Trust rules. Everything is checked at open time, before anything is read, and every failure is
a ``FormatError`` naming the file (the index, or the shard file when that file is wrong) and the
tensor:

* every file read or mapped (the index, ``mlc-chat-config.json``, each shard file) is, once
  symlinks are followed, a regular file: a FIFO, a device, a directory, a symlink loop, a
  dangling link or an unreadable file is refused by name, never opened in a way that could
  block; the index is at most 64 MiB, the config at most 16 MiB;
* the index is UTF-8 JSON with no duplicate keys and no NaN; the top level, each shard record and
  each tensor record have exactly their known keys with the right types (unknown keys are
  refused, so a typo or an unsupported extension cannot go unnoticed; ``metadata`` and ``md5sum``
  are optional);
* ``dataPath`` is checked *by name*, before anything is opened: a plain relative path inside
  the folder (not absolute, no ``..`` or ``.`` component, no NUL, no drive letter, no
  backslash, at most 1024 characters: ``shardload.files.check_member_name``). The file it
  names may be a symlink to anywhere (an MLC model downloaded with ``huggingface_hub`` is a
  folder of links into ``blobs/``). No name is listed twice; the file exists and its size is
  the record's ``nbytes`` (TVM's check for a torn download);
* the shard format is ``"raw-shard"``, a tensor format ``"raw"`` or ``"f32-to-bf16"``, and the
  dtype one TVM writes (``float16``, ``bfloat16``, ``float32``, ``uint32``, ``int8``, ...);
* each tensor has a non-empty name that is valid Unicode, a shape of at most 64 dimensions,
  each at most 2**53 (a strict reader refuses dims beyond 2**53), whose product fits 64-bit
  sizes;
* each tensor's ``nbytes`` is exactly ``prod(shape) * itemsize`` of the stored dtype,
  ``byteOffset + nbytes`` lies inside its file, tensors in one file do not overlap (gaps are
  fine: writers may align), and no tensor name appears twice.

``md5sum`` is checked for type only: verifying it would read every byte at open time.

Files are mapped, not read (each shard once, copy-on-write); a read copies one tensor or one
slice out of the mapping. A file that changes while a checkpoint has it open is refused before
the next tensor is copied (see ``mapped.py``).
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import dtypes, strict_json
from ..dtypes import shape_problem
from ..errors import FormatError, quote
from ..files import MAX_SIDE_FILE_BYTES, check_member_name, read_json
from ..gc_pause import gc_paused
from ..sources.bytesource import LOCAL_FILES, ByteSource, Files
from .base import MAX_INDEX_BYTES, TensorMeta
from .mapped import MappedCheckpoint

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAMES",
    "MLC_DTYPES",
    "MLC_FORMATS",
    "MLCCheckpoint",
    "open_mlc",
]

#: index file names, preferred first (TVM renamed ndarray-cache.json to tensor-cache.json)
INDEX_NAMES = ("tensor-cache.json", "ndarray-cache.json")
CONFIG_NAME = "mlc-chat-config.json"

#: dtype spellings in a tensor cache -> canonical name. TVM's own names; the float8 ones in both
#: the current spelling and the older ``e4m3_float8`` one.
MLC_DTYPES: dict[str, str] = {
    "bool": "bool",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "e4m3_float8": "float8_e4m3fn",
    "e5m2_float8": "float8_e5m2",
}
#: tensor record formats
MLC_FORMATS = ("raw", "f32-to-bf16")

_REDO = "re-run mlc_llm convert_weight or re-download the weights"
_TOP_KEYS = ({"records"}, {"metadata"})  # (required, optional)
_SHARD_KEYS = ({"dataPath", "format", "nbytes", "records"}, {"md5sum"})
_TENSOR_KEYS: tuple[set[str], set[str]] = (
    {"name", "shape", "dtype", "format", "nbytes", "byteOffset"},
    set(),
)


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0  # type(), not isinstance(): JSON true is not a 1


def _check_keys(obj: dict, keys: tuple[set, set], what: str, bad) -> None:
    required, optional = keys
    missing = sorted(required - set(obj))
    extra = sorted(set(obj) - required - optional)
    if missing or extra:
        allowed = ", ".join(sorted(required)) + (
            f" (and optionally {', '.join(sorted(optional))})" if optional else ""
        )
        problems = "; ".join(
            p for p in (missing and f"missing {missing}", extra and f"unexpected {extra}") if p
        )
        raise bad(f"{what} must have exactly the keys {allowed}; {problems}")


# ----------------------------------------------------------------------------------------------
# the index


@dataclass
class _Record:
    """One validated tensor record."""

    meta: TensorMeta  # dtype: what is stored (bfloat16 for an f32-to-bf16 float32 record)
    begin: int  # byte offsets into the shard file
    end: int
    format: str  # the record's "format", verbatim


@dataclass
class _ShardSpec:
    """One validated shard record: its file and its tensors, in storage order."""

    path: Path
    nbytes: int
    records: list[_Record]
    md5sum: str | None


def _find_index(folder: Path) -> Path:
    # by name: an index that is a dangling link or a FIFO is refused when it is read
    for name in INDEX_NAMES:
        p = folder / name
        if os.path.lexists(p):
            return p
    raise FormatError(
        f"folder holds neither {' nor '.join(INDEX_NAMES)}: not an MLC-LLM weight folder",
        file=str(folder),
    )


def _shard_path(index: Path, data_path: Any, where: str, label: str, files: Files) -> Path:
    """The file a shard record names, refused by name unless it is a plain relative path inside
    the index's folder. It may be a symlink to anywhere: what it leads to is checked to be a
    regular file when it is opened."""
    if not isinstance(data_path, str):
        raise FormatError(
            f"{where}: dataPath must be a string, got {quote(data_path)}", file=str(index)
        )
    check_member_name(data_path, index=index, what=f"{label}: dataPath")
    path = index.parent / data_path
    if not files.lexists(path):
        raise FormatError(
            f"shard file is missing: {index.name} lists it ({where}); {_REDO}", file=str(path)
        )
    return path


def _check_tensor(index: Path, where: str, rec: Any) -> _Record:
    name = rec.get("name") if isinstance(rec, dict) else None
    tensor = name if isinstance(name, str) and strict_json.is_text(name) else None

    def bad(msg: str) -> FormatError:
        return FormatError(f"{where}: {msg}; {_REDO}", file=str(index), tensor=tensor)

    if not isinstance(rec, dict):
        raise bad(f"tensor record must be an object, got {type(rec).__name__}")
    _check_keys(rec, _TENSOR_KEYS, "tensor record", bad)
    if not isinstance(name, str) or not name:
        raise bad(f"name must be a non-empty string, got {quote(name)}")
    if tensor is None:
        raise bad(f"name {quote(name)} is not valid Unicode (a lone surrogate escape)")
    shape, dtype, fmt = rec["shape"], rec["dtype"], rec["format"]
    nbytes, offset = rec["nbytes"], rec["byteOffset"]
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise bad(f"shape must be a list of non-negative integers, got {quote(shape)}")
    if not isinstance(dtype, str) or dtype not in MLC_DTYPES:
        raise bad(f"unknown dtype {quote(dtype)}; shardload reads {', '.join(MLC_DTYPES)}")
    if not isinstance(fmt, str) or fmt not in MLC_FORMATS:
        raise bad(f"unknown format {quote(fmt)}; shardload reads {' and '.join(MLC_FORMATS)}")
    if not _is_uint(nbytes):
        raise bad(f"nbytes must be a non-negative integer, got {quote(nbytes)}")
    if not _is_uint(offset):
        raise bad(f"byteOffset must be a non-negative integer, got {quote(offset)}")
    stored = MLC_DTYPES[dtype]
    if fmt == "f32-to-bf16" and stored == "float32":
        stored = "bfloat16"  # the bytes are bf16 bits; see the module docstring
    problem = shape_problem(shape, dtypes.itemsize(stored))
    if problem:
        raise bad(problem)
    meta = TensorMeta(name, tuple(shape), stored)
    if nbytes != meta.nbytes:
        how = (
            f"{math.prod(shape)} elements of {dtype} stored as {stored}"
            if stored != MLC_DTYPES[dtype]
            else f"shape {shape} of {dtype}"
        )
        raise bad(
            f"nbytes is {nbytes}, but {how} is {meta.nbytes} bytes: the index lies about the size"
        )
    return _Record(meta, offset, offset + nbytes, fmt)


def _check_layout(index: Path, where: str, records: list[_Record], size: int) -> None:
    """Bounds, then no overlaps among the non-empty tensors of one file (gaps are fine)."""
    for r in records:
        if r.end > size:
            raise FormatError(
                f"{where}: byteOffset {r.begin} + nbytes {r.end - r.begin} = "
                f"{r.end} runs past the end of the {size}-byte shard file; the "
                f"index is corrupt; {_REDO}",
                file=str(index),
                tensor=r.meta.name,
            )
    covered, owner = 0, None
    for r in sorted((r for r in records if r.end > r.begin), key=lambda r: (r.begin, r.end)):
        if r.begin < covered:
            raise FormatError(
                f"{where}: bytes [{r.begin}, {r.end}) overlap tensor {quote(owner)} "
                f"(which ends at {covered}); the index is corrupt; {_REDO}",
                file=str(index),
                tensor=r.meta.name,
            )
        covered, owner = r.end, r.meta.name


def _read_index(index: Path, files: Files) -> tuple[dict[str, Any], list[_ShardSpec]]:
    doc = read_json(index, MAX_INDEX_BYTES, "index")

    def bad(msg: str) -> FormatError:
        return FormatError(msg, file=str(index))

    if not isinstance(doc, dict):
        raise bad(f"index must be a JSON object, got {type(doc).__name__}")
    _check_keys(doc, _TOP_KEYS, "index", bad)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise bad(f'"metadata" must be an object, got {type(metadata).__name__}')
    shard_records = doc["records"]
    if not isinstance(shard_records, list):
        raise bad(f'"records" must be a list of shard records, got {type(shard_records).__name__}')

    shards: list[_ShardSpec] = []
    # By name: check_member_name makes a name canonical (no "." or "" parts), and two names
    # that link to one blob are legitimate (the hub cache stores equal files once).
    seen_files: dict[str, str] = {}
    seen_names: dict[str, str] = {}
    for i, srec in enumerate(shard_records):
        where = label = f"shard record {i}"
        if isinstance(srec, dict) and isinstance(srec.get("dataPath"), str):
            where += f" ({quote(srec['dataPath'], 60)})"

        def sbad(msg: str, where=where) -> FormatError:
            return FormatError(f"{where}: {msg}", file=str(index))

        if not isinstance(srec, dict):
            raise sbad(f"must be an object, got {type(srec).__name__}")
        _check_keys(srec, _SHARD_KEYS, "a shard record", sbad)
        if srec["format"] != "raw-shard":
            raise sbad(
                f"unknown shard format {quote(srec['format'], 50)}; shardload reads "
                f'"raw-shard" only'
            )
        nbytes = srec["nbytes"]
        if not _is_uint(nbytes):
            raise sbad(f"nbytes must be a non-negative integer, got {quote(nbytes, 50)}")
        md5 = srec.get("md5sum")
        if md5 is not None and not isinstance(md5, str):
            raise sbad(f"md5sum must be a string, got {quote(md5, 50)}")
        tensor_records = srec["records"]
        if not isinstance(tensor_records, list):
            raise sbad(
                f'"records" must be a list of tensor records, got {type(tensor_records).__name__}'
            )
        records = [_check_tensor(index, where, rec) for rec in tensor_records]
        for r in records:
            if r.meta.name in seen_names:
                raise FormatError(
                    f"{where}: tensor is listed twice (also in "
                    f"{seen_names[r.meta.name]}); a name must be unique",
                    file=str(index),
                    tensor=r.meta.name,
                )
            seen_names[r.meta.name] = where
        _check_layout(index, where, records, nbytes)

        path = _shard_path(index, srec["dataPath"], where, label, files)
        key = srec["dataPath"]
        if key in seen_files:
            raise sbad(
                f"names the same file as {seen_files[key]}; each shard file may be listed once"
            )
        seen_files[key] = where
        records.sort(key=lambda r: (r.begin, r.end))  # storage order; stable for empty tensors
        shards.append(_ShardSpec(path, nbytes, records, md5))
    return metadata, shards


# ----------------------------------------------------------------------------------------------
# mapping


def _map_shard(index: Path, spec: _ShardSpec, files: Files) -> ByteSource:
    """Map one shard file of ``files`` after checking its size (``Files.map_data``: no
    mapping for an empty file, no ``fstat`` for an object)."""
    data = files.map_data(spec.path, "the shard file", None)
    if data.size != spec.nbytes:
        data.close()
        how = "truncated" if data.size < spec.nbytes else "longer than listed"
        raise FormatError(
            f"shard file is {data.size} bytes, but {index.name} says {spec.nbytes} "
            f"(its nbytes): it is {how} (an interrupted download?); {_REDO}",
            file=str(spec.path),
        )
    return data


# ----------------------------------------------------------------------------------------------
# the checkpoint


def open_mlc(folder: str | os.PathLike, files: Files = LOCAL_FILES) -> MLCCheckpoint:
    """Open an MLC-LLM weight folder lazily, its shard files found in ``files`` (this
    machine's, or a checkpoint's in object storage).

    The index is ``tensor-cache.json``, or ``ndarray-cache.json`` when there is no
    ``tensor-cache.json``. Everything is validated before this returns (``FormatError``
    otherwise); only the index and ``mlc-chat-config.json`` are read, the shard files are mapped.
    """
    p = Path(folder)
    if not p.exists():
        raise FormatError("no such file or folder", file=str(p))
    if not p.is_dir():
        raise FormatError(
            f"an MLC-LLM checkpoint is a folder (with {INDEX_NAMES[0]}), not a file", file=str(p)
        )
    index = _find_index(p)
    with gc_paused():  # see gc_paused: an index of many tensors must open in time linear in it
        metadata, specs = _read_index(index, files)

    config: dict[str, Any] = {}
    config_path = p / CONFIG_NAME
    if os.path.lexists(config_path):  # there by name: a dangling link or a FIFO is refused
        config = read_json(config_path, MAX_SIDE_FILE_BYTES, CONFIG_NAME)
        if not isinstance(config, dict):
            raise FormatError(
                f"{CONFIG_NAME} must be a JSON object, got {type(config).__name__}",
                file=config_path,
            )

    mapped: list[ByteSource] = []
    try:
        for spec in specs:
            mapped.append(_map_shard(index, spec, files))
        with gc_paused():
            return MLCCheckpoint(str(folder), index, specs, mapped, metadata, config)
    except BaseException:
        for data in mapped:
            data.close()
        raise


class MLCCheckpoint(MappedCheckpoint):
    """Tensors of a validated, memory-mapped MLC-LLM weight folder.

    Made by ``open_mlc``. ``metadata()`` lists tensors in storage order: shard records in index
    order, tensors by byte offset within each. ``read`` and ``read_narrow`` are safe to call from
    several threads at once; after ``close()`` they raise ``ValueError``, and tensors already
    returned stay valid (they own their memory).

    ``index_file`` is the index read, ``files`` the shard files, ``cache_metadata`` the index's
    ``metadata`` and ``md5sums`` each file's recorded ``md5sum`` (None where absent).
    """

    def __init__(
        self,
        source: str,
        index: Path,
        specs: list[_ShardSpec],
        mapped: list[ByteSource],
        cache_metadata: dict[str, Any],
        chat_config: dict[str, Any],
    ):
        super().__init__(
            source,
            mapped,
            ((r.meta, i, r.begin, r.end) for i, spec in enumerate(specs) for r in spec.records),
        )
        self.path = os.path.abspath(source)
        self.index_file = str(index)
        self.md5sums: dict[str, str | None] = {str(s.path): s.md5sum for s in specs}
        self.cache_metadata: dict[str, Any] = cache_metadata
        self._chat_config = chat_config
        self._format: dict[str, str] = {
            r.meta.name: r.format for spec in specs for r in spec.records
        }

    # -- what is there

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    @property
    def config(self) -> dict:
        """``mlc-chat-config.json`` (``{}`` without one), plus the index's ``metadata`` under
        ``"tensor_cache_metadata"``. A fresh copy each time."""
        cfg = copy.deepcopy(self._chat_config)
        cfg["tensor_cache_metadata"] = copy.deepcopy(self.cache_metadata)
        return cfg

    def tensor_format(self, name: str) -> dict:
        """``{"mlc_format": "raw" | "f32-to-bf16"}``, the record's format as written.

        For a float32 record labelled ``"f32-to-bf16"`` the tensor is exposed as the bfloat16 it
        is stored as; for every other dtype the label changes nothing.
        """
        self.meta(name)
        return {"mlc_format": self._format[name]}
