"""Source specs: what a read plan says each of its byte sources is, typed, and as JSON.

* ``FileSource``: a file any process may map, with its identity as the controller opened it
  (``(st_dev, st_ino, st_size, st_mtime_ns)``, None: not checked), and where an object in
  object storage holds it, the object (``ObjectSpec``);
* ``TensorSource``: a tensor's bytes held only in the controller's process.

``to_json`` writes the JSON read plans have always carried (a worker process receives it;
``shardload inspect --reads`` prints it); ``source_from_json`` reads it back and refuses
anything else with a ``ValueError`` naming the field.

>>> spec = FileSource("/m/model.safetensors", (1, 2, 3, 4))
>>> spec.to_json()
{'file': '/m/model.safetensors', 'identity': [1, 2, 3, 4]}
>>> source_from_json(spec.to_json(), 0) == spec
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeGuard

__all__ = ["FileSource", "ObjectSpec", "SourceSpec", "TensorSource", "source_from_json"]


def _whole(value: object) -> TypeGuard[int]:
    return type(value) is int


class _Bad:
    """The ``ValueError`` for source ``index``'s field that is not what it must be."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, field: str, must: str) -> ValueError:
        return ValueError(f"a read plan's source {self.index}: {field!r} is not {must}")


@dataclass(frozen=True)
class ObjectSpec:
    """An object in object storage as a listing saw it (``sources.store.ObjectInfo``), and
    ``shared``: where the loader's memory file of its bytes is, for a worker process to map
    (``sources.sparse``), or None."""

    url: str
    size: int
    etag: str
    last_modified: str
    shared: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.url,
            "size": self.size,
            "etag": self.etag,
            "last_modified": self.last_modified,
        }
        if self.shared is not None:
            out["shared"] = self.shared
        return out

    @classmethod
    def from_json(cls, data: object, bad: _Bad) -> ObjectSpec:
        if not isinstance(data, dict):
            raise bad("object", "an object")
        for field in ("url", "etag", "last_modified"):
            if not isinstance(data.get(field), str):
                raise bad(f"object/{field}", "a string")
        size = data.get("size")
        if not _whole(size) or size < 0:
            raise bad("object/size", "a whole number of bytes")
        shared = data.get("shared")
        if shared is not None and not isinstance(shared, str):
            raise bad("object/shared", "a path or absent")
        extra = set(data) - {"url", "size", "etag", "last_modified", "shared"}
        if extra:
            raise bad(f"object/{sorted(extra)[0]}", "a field of an object")
        return cls(data["url"], size, data["etag"], data["last_modified"], shared)


@dataclass(frozen=True)
class FileSource:
    """A file any process may map (see the module docstring)."""

    path: str
    identity: tuple[int, int, int, int] | None = None
    object: ObjectSpec | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.path,
            "identity": None if self.identity is None else list(self.identity),
        }
        if self.object is not None:
            out["object"] = self.object.to_json()
        return out

    def describe(self) -> str:
        """The file's name, for a line of ``inspect --reads``."""
        return self.path.rsplit("/", 1)[-1]

    def with_object(self, obj: ObjectSpec | None) -> FileSource:
        return dataclasses.replace(self, object=obj)

    def unshared(self) -> FileSource:
        """This source without the loader's memory file (its object fetched by whoever maps
        it)."""
        if self.object is None or self.object.shared is None:
            return self
        return self.with_object(dataclasses.replace(self.object, shared=None))

    @classmethod
    def from_json(cls, data: dict[str, Any], bad: _Bad) -> FileSource:
        path, ident, obj = data["file"], data.get("identity"), data.get("object")
        if not isinstance(path, str) or not path:
            raise bad("file", "a path")
        if ident is not None and not (
            isinstance(ident, list) and len(ident) == 4 and all(_whole(v) for v in ident)
        ):
            raise bad("identity", "null or a list of 4 whole numbers")
        extra = set(data) - {"file", "identity", "object"}
        if extra:
            raise bad(sorted(extra)[0], "a field of a file source")
        return cls(
            path,
            None if ident is None else (ident[0], ident[1], ident[2], ident[3]),
            None if obj is None else ObjectSpec.from_json(obj, bad),
        )


@dataclass(frozen=True)
class TensorSource:
    """A tensor's bytes held only in the controller's process (an in-memory checkpoint)."""

    tensor: str

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor}

    def describe(self) -> str:
        return f"tensor {self.tensor}"

    @classmethod
    def from_json(cls, data: dict[str, Any], bad: _Bad) -> TensorSource:
        if not isinstance(data["tensor"], str):
            raise bad("tensor", "a string")
        if len(data) != 1:
            raise bad(sorted(set(data) - {"tensor"})[0], "a field of a tensor source")
        return cls(data["tensor"])


#: a read plan's byte source
SourceSpec = FileSource | TensorSource


def source_from_json(data: object, index: int) -> SourceSpec:
    """Source ``index`` of a read plan, as ``to_json`` wrote it; a ``ValueError`` naming the
    field that is not what it must be."""
    bad = _Bad(index)
    if not isinstance(data, dict):
        raise ValueError(f"a read plan's source {index} is not an object: {type(data).__name__}")
    if "file" in data:
        return FileSource.from_json(data, bad)
    if "tensor" in data:
        return TensorSource.from_json(data, bad)
    raise ValueError(f"a read plan's source {index} names neither a 'file' nor a 'tensor'")
