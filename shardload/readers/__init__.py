"""Checkpoint readers: formats and bytes, nothing about sharding.

``open_checkpoint`` picks the reader for a path; ``ArrayCheckpoint`` wraps an in-memory mapping.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..sources.bytesource import LOCAL_FILES, Files
from .base import Checkpoint, TensorMeta
from .memory import ArrayCheckpoint

__all__ = ["ArrayCheckpoint", "Checkpoint", "TensorMeta", "as_checkpoint", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint lazily, whatever its format.

    - a ``.gguf`` file (llama.cpp), tensors under their GGUF names;
    - a folder with ``tensor-cache.json`` (or the older ``ndarray-cache.json``): MLC-LLM;
    - a ``.safetensors`` file, or a folder with one or an HF-sharded set listed by
      ``model.safetensors.index.json``;
    - a Hugging Face hub cache repository folder (``models--org--name``, with ``refs/main`` and
      ``snapshots/``): the snapshot ``refs/main`` names. A snapshot folder itself (its files are
      symlinks into ``blobs/``) is an ordinary folder;
    - any of these in object storage, ``s3://bucket/folder/``, ``gs://bucket/model.gguf``,
      ``az://container/folder/`` (``readers.objects``: headers by ranged GETs, tensor bytes
      fetched when needed).

    Nothing but headers is read until a tensor is asked for. The checkpoint's ``path`` is what
    was opened: for a hub cache repository folder, the snapshot folder, which is where the plan
    (``shard_info.json``) and ``config.json`` lie.

    >>> ckpt = open_checkpoint("examples/tiny_llama_q4")          # doctest: +SKIP
    >>> ckpt.meta("model.embed_tokens.weight").shape               # doctest: +SKIP
    (512, 256)
    """
    from ..sources import is_object_url

    if is_object_url(path):
        from .objects import open_object_checkpoint

        return open_object_checkpoint(os.fspath(path), open_local_checkpoint)
    return open_local_checkpoint(path)


def open_local_checkpoint(path: str | os.PathLike, files: Files = LOCAL_FILES) -> Checkpoint:
    """``open_checkpoint`` of a path on this machine, its data files found in ``files``
    (``readers.objects`` hands the ``ObjectFiles`` of a checkpoint in object storage)."""
    from .hub_cache import resolve_snapshot

    path = resolve_snapshot(os.fspath(path))
    # Chosen by name, not by what the name leads to, so that a FIFO, a dangling link or a
    # symlink loop reaches the reader that names the problem.
    if path.endswith(".gguf"):
        from .gguf import open_gguf

        return open_gguf(path, files)
    if os.path.isdir(path) and any(
        os.path.lexists(os.path.join(path, name))
        for name in ("tensor-cache.json", "ndarray-cache.json")
    ):
        from .mlc import open_mlc

        return open_mlc(path, files)
    from .safetensors import open_safetensors

    return open_safetensors(path, files)


def as_checkpoint(params: Any) -> Checkpoint:
    """``params`` as a ``Checkpoint``: a checkpoint, a path, or a mapping of arrays."""
    if isinstance(params, Checkpoint):
        return params
    if isinstance(params, (str, os.PathLike)):
        return open_checkpoint(params)
    if isinstance(params, Mapping):
        return ArrayCheckpoint(params)
    raise TypeError(
        "params must be a Checkpoint, a path, or a mapping of name -> numpy/torch "
        f"array, not {type(params).__name__}"
    )
