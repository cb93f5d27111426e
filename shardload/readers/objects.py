"""A checkpoint in object storage: ``s3://bucket/folder/`` (a folder prefix) or one object.

Opening it (``open_object_checkpoint``):

1. **List.** A URL naming a file (its last part ends in ``.safetensors``, ``.gguf`` or
   ``.json``) is that object in its folder; any other URL is a folder prefix. The folder's
   objects (those directly under the prefix) are listed once, each with its size and ETag.
2. **Side files whole, data files never.** Every object that is not a data file
   (``DATA_SUFFIXES``: ``config.json``, the index, ``tensor-cache.json``, ``shard_info.json``,
   the tokenizer's files) of at most ``SIDE_FILE_BYTES`` is fetched whole into a scratch folder,
   under its own name, where transformers and vLLM can read the configs and the tokenizer too.
   Each data file gets an empty placeholder there, and an ``ObjectBytes`` (a sparse mapping of
   its size, filled by ranged GETs) registered for that path (``files.register_data``).
3. **The readers open the scratch folder** as any checkpoint (safetensors, GGUF, MLC): each data
   file's header is read out of its mapping through ``files.map_data``, which fetches what the
   parse asks for, never more than the reader's caps allow (a header declared 100 GB long is
   refused from its length, before it is fetched).
4. **Tensor bytes come when asked**: a tensor read directly fetches its range; a load fetches
   each worker's read-plan spans before copying them (``Checkpoint.fetch_bytes``), and a worker
   process fetches its own, from the object spec its read plan carries. Every GET names the
   ETag the listing saw (``If-Match``): an object replaced mid-load fails the load.

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
from typing import Callable

from ..errors import FormatError, StorageError
from ..files import check_member_name, data_at, register_data, unregister_data

__all__ = ["open_object_checkpoint", "write_fetched_bytes", "DATA_SUFFIXES", "SIDE_FILE_BYTES",
           "SIDE_FILES_BYTES"]

#: objects holding tensor data, mapped sparsely and fetched by range (MLC's shards are .bin)
DATA_SUFFIXES = (".safetensors", ".gguf", ".bin")
#: a URL whose last part ends in one of these names one object, not a folder
FILE_SUFFIXES = (".safetensors", ".gguf", ".json")
#: a side file larger than this is left out of the scratch folder (real tokenizers are < 30 MB)
SIDE_FILE_BYTES = 64 << 20
#: all side files together
SIDE_FILES_BYTES = 512 << 20


def _split(url) -> tuple[object, str]:
    """``(folder prefix URL, the one object's name or "")``."""
    key = url.key
    last = key.rsplit("/", 1)[-1]
    if last.endswith(FILE_SUFFIXES):
        return type(url)(url.scheme, url.bucket, key[:len(key) - len(last)]), last
    return type(url)(url.scheme, url.bucket,
                     key if not key or key.endswith("/") else key + "/"), ""


def open_object_checkpoint(url: str, open_local: Callable):
    """The checkpoint at ``url`` (``s3://...``), opened as the module docstring says;
    ``open_local(path)`` opens the scratch folder (``readers.open_local_checkpoint``)."""
    from ..sources.store import default_client
    from ..sources.urls import ObjectUrl
    from ..sources.sparse import ObjectBytes

    client = default_client()
    folder, name = _split(ObjectUrl.parse(url))
    listing = client.list_folder(folder)
    infos = {info.url.rsplit("/", 1)[-1]: info for info in listing}
    if name and name not in infos:
        client.head(folder.join(name))  # the error for what is there instead (no such key...)
        raise StorageError("no such object; check the path", url=url, usage=True)
    if not infos:
        raise StorageError("no objects under this prefix; check the path (a folder URL "
                           "stands for the objects directly under it)", url=url, usage=True)

    scratch = tempfile.mkdtemp(prefix="shardload-objects-")
    registered: list[str] = []
    objects: list[ObjectBytes] = []
    cleanup = _Cleanup(scratch, registered, objects)
    try:
        side_total = 0
        for member, info in sorted(infos.items()):
            check_member_name(member, index=str(folder), what="holds object")
            local = os.path.join(scratch, member)
            if member.endswith(DATA_SUFFIXES):
                open(local, "wb").close()  # a placeholder: folder listings find it
                data = ObjectBytes(info, client)
                objects.append(data)
                register_data(local, data)
                registered.append(local)
            elif info.size <= SIDE_FILE_BYTES and side_total + info.size <= SIDE_FILES_BYTES:
                side_total += info.size
                with open(local, "wb") as f:
                    f.write(client.get_bytes(info, 0, info.size))
        path = os.path.join(scratch, name) if name else scratch
        ckpt = _translated(lambda: open_local(path), scratch, str(folder))
    except BaseException:
        cleanup()
        raise
    ckpt.source = url
    ckpt.named_as = (scratch, str(folder))
    # cleaned when the checkpoint is closed, or collected, or at exit
    ckpt.on_close(weakref.finalize(ckpt, cleanup))
    return ckpt


def write_fetched_bytes(ckpt) -> None:
    """Fill each data file's placeholder in ``ckpt``'s scratch folder with the bytes fetched so
    far (the headers its readers parsed) as a sparse file of the object's size, whose other
    bytes read as zeros and take no disk: for a library that reads only a file's header
    (transformers builds a tokenizer from a GGUF's vocabulary). A checkpoint not in object
    storage is left alone.

    >>> with open_checkpoint("s3://models/smollm2.gguf") as ckpt:      # doctest: +SKIP
    ...     write_fetched_bytes(ckpt)
    ...     tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(ckpt.path),
    ...                                               gguf_file=os.path.basename(ckpt.path))
    """
    scratch = getattr(ckpt, "named_as", None)
    if not scratch:
        return
    for member in sorted(os.listdir(scratch[0])):
        path = os.path.join(scratch[0], member)
        data = data_at(path)
        if data is None or data.map is None:
            continue
        with open(path, "r+b") as f:
            for begin, end in data.present_spans():
                f.seek(begin)
                f.write(data.map[begin:end])
            f.truncate(data.size)


class _Cleanup:
    """Forget the data paths, close the mappings, remove the scratch folder (once)."""

    def __init__(self, scratch: str, registered: list, objects: list):
        self.scratch, self.registered, self.objects = scratch, registered, objects

    def __call__(self) -> None:
        for path in self.registered:
            unregister_data(path)
        for data in self.objects:
            data.close()
        self.registered, self.objects = [], []
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
