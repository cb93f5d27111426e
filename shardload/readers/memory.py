"""A checkpoint made of arrays already in memory (what TVM's own tests pass to the loader)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes
from ..dtypes import shape_problem
from ..errors import FormatError
from .base import Checkpoint, TensorMeta

if TYPE_CHECKING:  # pragma: no cover  (imported where used: planning needs no torch)
    import torch


def _to_torch(name: str, value: Any) -> torch.Tensor:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        dtypes.from_numpy(value.dtype)  # refuse dtypes we cannot name, with a clear message
        return torch.from_numpy(np.ascontiguousarray(value))
    if hasattr(value, "__dlpack__"):
        return torch.from_dlpack(value)
    raise TypeError(
        f"parameter {name!r}: expected a numpy array or torch tensor, got {type(value).__name__}"
    )


class ArrayCheckpoint(Checkpoint):
    """Wrap ``{name: numpy or torch array}``; ``read`` returns a CPU copy.

    >>> ckpt = ArrayCheckpoint({"w": np.zeros((4, 2), np.float16)})
    >>> ckpt.meta("w")
    TensorMeta(name='w', shape=(4, 2), dtype='float16')
    """

    source = "<memory>"

    def __init__(self, arrays: Mapping[str, Any]):
        super().__init__()
        self._tensors: dict[str, torch.Tensor] = {}
        for name, value in arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"parameter names must be strings, got {name!r}")
            self._tensors[name] = _to_torch(name, value)
        self._meta = {}
        for name, t in self._tensors.items():
            meta = TensorMeta(name, tuple(t.shape), dtypes.from_torch(t.dtype))
            # torch accepts an empty (0, 2**60) tensor; the readers' limits hold here too, so a
            # plan is never validated against a shape no file could hold
            problem = shape_problem(meta.shape, t.element_size())
            if problem:
                raise FormatError(problem, file=self.source, tensor=name)
            self._meta[name] = meta

    def metadata(self) -> dict[str, TensorMeta]:
        return self._meta

    def read(self, name: str) -> torch.Tensor:
        self.meta(name)
        tensor = self._tensors[name].detach().to("cpu", copy=True).contiguous()
        self.bytes_read += self._meta[name].nbytes
        return tensor

    def source_bytes(self, index: int) -> torch.Tensor:
        """The stored tensor's own bytes (no copy when it is a contiguous CPU tensor)."""
        import torch

        tensor = self._tensors[self.names()[index]].detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.to("cpu").contiguous()
        return tensor.reshape(-1).view(torch.uint8)
