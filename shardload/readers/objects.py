"""A checkpoint in object storage: ``s3://bucket/folder/``, ``gs://...``, ``az://...`` (a
folder prefix) or one object.

Opening it (``open_object_checkpoint``):

1. **List.** A URL naming a file (its last part ends in ``.safetensors``, ``.gguf`` or
   ``.json``) is that object in its folder; any other URL is a folder prefix. The folder's
   objects (those directly under the prefix) are listed once, each with its size and ETag.
2. **Side files whole, data files never.** Every object that is not a data file
   (``DATA_SUFFIXES``: ``config.json``, the index, ``tensor-cache.json``, ``shard_info.json``,
   the tokenizer's files) of at most ``SIDE_FILE_BYTES`` is fetched whole into a scratch folder,
   under its own name, where transformers and vLLM can read the configs and the tokenizer too;
   all at once (``sources.store.each``): each is a round trip.
   Each data file is an ``ObjectBytes`` (a sparse mapping of its size, filled by ranged GETs),
   in an ``ObjectFiles`` made for this open alone: no file stands in for it.
3. **The readers open the scratch folder** as any checkpoint (safetensors, GGUF, MLC), with
   the ``ObjectFiles`` handed to their open functions: they find the data files by name in
   it and read each one's header out of its mapping (``Files.map_data``), which fetches what
   the parse asks for, never more than the reader's caps allow (a header declared 100 GB long
   is refused from its length, before it is fetched). A reader of several files fetches their
   headers at once before it parses them in turn (``safetensors._fetch_headers``): 200 files
   at 20 ms a request open in under a second, where one at a time they took 400 requests in
   turn (``benchmarks/bench_objects.py --open-files 200``).
4. **Tensor bytes come when asked**: a tensor read directly fetches its range; a load streams
   the workers' spans while they copy them (``pieces.stream``). Every GET names the ETag the
   listing saw (``If-Match``): an object replaced mid-load fails the load.

Errors name the URL, not the scratch folder. The scratch folder and the mappings go when the
checkpoint is closed, or at the latest when the process exits.

>>> with open_checkpoint("s3://models/smollm2/") as ckpt:             # doctest: +SKIP
...     ckpt.meta("model.embed_tokens.weight")
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import FormatError, StorageError
from ..files import ErrorFactory, PathLike, check_member_name
from ..sources.bytesource import ByteSource, FetchedObject, Files

if TYPE_CHECKING:
    from ..sources.sparse import ObjectBytes
    from ..sources.urls import ObjectUrl

__all__ = [
    "DATA_SUFFIXES",
    "SIDE_FILES_BYTES",
    "SIDE_FILE_BYTES",
    "ObjectFiles",
    "open_object_checkpoint",
    "write_fetched_bytes",
]

#: objects holding tensor data, mapped sparsely and fetched by range (MLC's shards are .bin)
DATA_SUFFIXES = (".safetensors", ".gguf", ".bin")
#: a URL whose last part ends in one of these names one object, not a folder
FILE_SUFFIXES = (".safetensors", ".gguf", ".json")
#: a side file larger than this is left out of the scratch folder (real tokenizers are < 30 MB)
SIDE_FILE_BYTES = 64 << 20
#: all side files together
SIDE_FILES_BYTES = 512 << 20


def _split(url: ObjectUrl) -> tuple[ObjectUrl, str]:
    """``(folder prefix URL, the one object's name or "")``."""
    key = url.key
    last = key.rsplit("/", 1)[-1]
    if last.endswith(FILE_SUFFIXES):
        return type(url)(url.scheme, url.bucket, key[: len(key) - len(last)]), last
    return type(url)(url.scheme, url.bucket, key if not key or key.endswith("/") else key + "/"), ""


def open_object_checkpoint(url: str, open_local: Callable):
    """The checkpoint at ``url`` (``s3://``, ``gs://``, ``az://``), opened as the module
    docstring says;
    ``open_local(path, files)`` opens the scratch folder (``readers.open_local_checkpoint``)."""
    from ..sources.sparse import ObjectBytes
    from ..sources.store import default_client, each
    from ..sources.urls import ObjectUrl

    client = default_client()
    folder, name = _split(ObjectUrl.parse(url))
    listing = client.list_folder(folder)
    infos = {info.url.rsplit("/", 1)[-1]: info for info in listing}
    if name and name not in infos:
        client.head(folder.join(name))  # the error for what is there instead (no such key...)
        raise StorageError("no such object; check the path", url=url, usage=True)
    if not infos:
        raise StorageError(
            "no objects under this prefix; check the path (a folder URL "
            "stands for the objects directly under it)",
            url=url,
            usage=True,
        )

    scratch = tempfile.mkdtemp(prefix="shardload-objects-")
    files = ObjectFiles(scratch)
    cleanup = _Cleanup(scratch, files)
    try:
        side_total, side = 0, []
        for member, info in sorted(infos.items()):
            check_member_name(member, index=str(folder), what="holds object")
            local = os.path.join(scratch, member)
            if member.endswith(DATA_SUFFIXES):
                files.add(local, ObjectBytes(info, client))
            elif info.size <= SIDE_FILE_BYTES and side_total + info.size <= SIDE_FILES_BYTES:
                side_total += info.size
                side.append((local, info))

        def fetch_side(item: tuple) -> None:
            local, info = item
            with open(local, "wb") as f:
                f.write(client.get_bytes(info, 0, info.size))

        # all at once: each is a round trip (config.json, the index, the tokenizer's files)
        failed = each(side, fetch_side)
        if failed:
            raise failed[min(failed)]
        path = os.path.join(scratch, name) if name else scratch
        ckpt = _translated(lambda: open_local(path, files), scratch, str(folder))
    except BaseException:
        cleanup()
        raise
    ckpt.source = url
    ckpt.named_as = (scratch, str(folder))
    ckpt.object_files = files
    # cleaned when the checkpoint is closed, or collected, or at exit
    ckpt.on_close(weakref.finalize(ckpt, cleanup))
    return ckpt


class ObjectFiles(Files):
    """The data files of one checkpoint in object storage, by the path each would have in its
    scratch folder (``sources.bytesource.Files``): found by name, mapped as their objects'
    bytes. The scratch folder's real files (the side files) are found as files."""

    def __init__(self, scratch: str):
        self.scratch = scratch
        self.objects: dict[str, ObjectBytes] = {}

    def add(self, path: str, data: ObjectBytes) -> None:
        self.objects[os.path.abspath(path)] = data

    def remote(self, path: PathLike) -> ByteSource | None:
        data = self.objects.get(os.path.abspath(os.fspath(path)))
        return None if data is None else FetchedObject(os.fspath(path), data)

    def lexists(self, path) -> bool:
        return os.path.abspath(os.fspath(path)) in self.objects or os.path.lexists(path)

    def glob(self, folder, suffix: str) -> list[str]:
        folder = os.path.abspath(os.fspath(folder))
        names = {
            os.path.basename(p)
            for p in self.objects
            if os.path.dirname(p) == folder and p.endswith(suffix)
        }
        return sorted(names.union(super().glob(folder, suffix)))

    def map_data(
        self, path: PathLike, what: str = "the file", error: ErrorFactory | None = None
    ) -> ByteSource:
        data = self.remote(path)
        if data is None:
            return super().map_data(path, what, error)
        return data

    def close(self) -> None:
        objects, self.objects = self.objects, {}
        for data in objects.values():
            data.close()


def write_fetched_bytes(ckpt) -> None:
    """Write each data file of ``ckpt`` into its scratch folder with the bytes fetched so far
    (the headers its readers parsed), as a sparse file of the object's size whose other bytes
    read as zeros and take no disk: for a library that reads only a file's header
    (transformers builds a tokenizer from a GGUF's vocabulary). A checkpoint not in object
    storage is left alone.

    >>> with open_checkpoint("s3://models/smollm2.gguf") as ckpt:      # doctest: +SKIP
    ...     write_fetched_bytes(ckpt)
    ...     tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(ckpt.path),
    ...                                               gguf_file=os.path.basename(ckpt.path))
    """
    files = getattr(ckpt, "object_files", None)
    if files is None:
        return
    for path, data in sorted(files.objects.items()):
        if data.map is None:
            continue
        with open(path, "wb") as f:
            for begin, end in data.present_spans():
                f.seek(begin)
                f.write(data.map[begin:end])
            f.truncate(data.size)


class _Cleanup:
    """Close the objects' mappings and remove the scratch folder (once)."""

    def __init__(self, scratch: str, files: ObjectFiles):
        self.scratch, self.files = scratch, files

    def __call__(self) -> None:
        self.files.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _translated(open_it: Callable, scratch: str, folder_url: str):
    """``open_it()``, with the scratch folder's paths in its errors said as the URLs."""
    try:
        return open_it()
    except FormatError as exc:
        file = exc.file
        if file is not None and (file == scratch or file.startswith(scratch + os.sep)):
            rel = os.path.relpath(file, scratch)
            file = folder_url if rel == "." else posixpath.join(folder_url, rel)
        reason = exc.reason.replace(scratch + os.sep, folder_url).replace(scratch, folder_url)
        raise FormatError(reason, file=file, tensor=exc.tensor) from None
