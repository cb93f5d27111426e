"""Checkpoint readers: formats and bytes, nothing about sharding.

``open_checkpoint`` picks the reader for a path; ``ArrayCheckpoint`` wraps an in-memory mapping.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from .base import Checkpoint, TensorMeta
from .memory import ArrayCheckpoint

__all__ = ["Checkpoint", "TensorMeta", "ArrayCheckpoint", "open_checkpoint", "as_checkpoint"]


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint lazily: a ``.safetensors`` file or a folder of them.

    A folder holds one ``*.safetensors`` file or an HF-sharded set listed by
    ``model.safetensors.index.json``. Nothing but headers is read until a tensor is asked for.

    >>> ckpt = open_checkpoint("examples/tiny_llama_q4")          # doctest: +SKIP
    >>> ckpt.meta("model.embed_tokens.weight").shape               # doctest: +SKIP
    (512, 256)
    """
    from .safetensors import open_safetensors

    return open_safetensors(path)


def as_checkpoint(params: Any) -> Checkpoint:
    """``params`` as a ``Checkpoint``: a checkpoint, a path, or a mapping of arrays."""
    if isinstance(params, Checkpoint):
        return params
    if isinstance(params, (str, os.PathLike)):
        return open_checkpoint(params)
    if isinstance(params, Mapping):
        return ArrayCheckpoint(params)
    raise TypeError("params must be a Checkpoint, a path, or a mapping of name -> numpy/torch "
                    f"array, not {type(params).__name__}")
