"""The interface every checkpoint reader implements, and the limits every reader applies.

Limits shared by the file readers (each refusal a ``FormatError`` that states the limit):

* ``MAX_DIM``: no tensor dimension beyond 2**53, the largest integer a double (and so a JSON
  number in most tools) holds exactly; real tensors are nowhere near it;
* ``MAX_NDIM``: at most 64 dimensions (numpy's limit: a tensor handed to a numpy shard function
  must fit);
* the product of a shape's dimensions, zero dimensions counted as 1 (that is what strides are
  computed from), times the item size, fits a signed 64-bit integer: torch and numpy refuse
  ``(0, 2**53, 2**53)`` although it holds no element;
* ``MAX_INDEX_BYTES``: a checkpoint index (``model.safetensors.index.json``,
  ``tensor-cache.json``) is at most 64 MiB; the largest real ones are about 10 MB.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

from .. import dtypes
from ..sources.specs import SourceSpec, TensorSource

if TYPE_CHECKING:  # pragma: no cover  (imported where used: planning needs no torch)
    import numpy as np
    import torch

    from ..sources.bytesource import ByteSource

#: cap on an index file's size (the shape limits every reader applies are ``limits.MAX_DIM``
#: and ``limits.MAX_NDIM``, checked by ``dtypes.shape_problem``)
MAX_INDEX_BYTES = 64 << 20


#: copies out of a file larger than this are made in pieces, reporting progress between them
COPY_CHUNK_BYTES = 64 << 20
_copy_progress: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "shardload_copy_progress", default=None
)


@contextlib.contextmanager
def copy_progress(hook: Callable[[], None]) -> Iterator[None]:
    """Within this block, in this thread, a reader copying a large tensor calls ``hook()`` after
    every ``COPY_CHUNK_BYTES``: the liveness a watchdog needs while one tensor takes long to read
    (a 4 GB embedding from a network disk), which per-parameter progress alone would miss.

    >>> with copy_progress(lambda: print("alive")):                # doctest: +SKIP
    ...     ckpt.read("model.embed_tokens.weight")
    """
    token = _copy_progress.set(hook)
    try:
        yield
    finally:
        _copy_progress.reset(token)


def copy_progress_hook() -> Callable[[], None] | None:
    """The hook a reader calls between the pieces of a long copy (``None`` outside
    ``copy_progress``)."""
    return _copy_progress.get()


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the planner and validator may know about a tensor without reading it.

    Slots, not a ``__dict__``: a checkpoint may hold a million of these (56 bytes each).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # canonical name, see shardload.dtypes

    @classmethod
    def many(
        cls, names: Iterable[str], shapes: Iterable[tuple[int, ...]], dtypes: Iterable[str]
    ) -> list[TensorMeta]:
        """``[TensorMeta(n, s, d) for n, s, d in zip(names, shapes, dtypes)]``, for a reader
        that has checked every field, in a few passes in C: a frozen dataclass's ``__init__``
        sets each field through ``object.__setattr__`` (about 1 us a tensor, 0.1 s of opening
        DeepSeek-V3's 92k); here each slot is set by its own descriptor, in a third of that."""
        made = list(map(object.__new__, repeat(cls, len(names := list(names)))))
        slots = vars(cls)  # each field's slot descriptor
        for field, values in (("name", names), ("shape", shapes), ("dtype", dtypes)):
            deque(map(slots[field].__set__, made, values), maxlen=0)
        return made

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)


class Checkpoint(abc.ABC):
    """A named set of stored tensors, read lazily.

    Readers validate everything they are given at open time and raise ``FormatError`` naming the
    file and tensor; after that, ``read`` only moves bytes. ``bytes_read`` counts the tensor
    bytes handed out, so loaders can report what each worker read.
    """

    #: where the tensors come from (a path, or "<memory>"), for messages
    source: str = "<checkpoint>"
    #: a path ``open_checkpoint`` reopens this checkpoint from (in another process), or None
    path: str | None = None

    def __init__(self) -> None:
        self.bytes_read = 0

    @abc.abstractmethod
    def metadata(self) -> dict[str, TensorMeta]:
        """Every tensor's metadata, by name, in storage order."""

    @abc.abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The whole tensor as a CPU torch tensor that owns its memory."""

    def read_array(self, name: str) -> np.ndarray:
        """The whole tensor as a numpy array that owns its memory, a dtype numpy lacks as its
        same-width integer (``dtypes.numpy_carrier``). For a planner looking at a few small
        tensors (GPTQ's ``g_idx``, compressed-tensors' ``weight_shape``): file readers copy
        them with numpy, so planning and validating import no torch.

        >>> ckpt.read_array("model.layers.0.self_attn.q_proj.g_idx")[:4]   # doctest: +SKIP
        array([0, 0, 0, 0], dtype=int32)
        """
        carrier, view = dtypes.numpy_carrier(self.meta(name).dtype)
        tensor = self.read(name)
        if view:
            tensor = tensor.view(dtypes.to_torch(str(carrier)))
        return tensor.numpy()

    def read_narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``read(name).narrow(dim, start, length)`` as an owned tensor.

        Readers backed by files override this to read only the bytes of the slice.
        """
        full = self.read(name)
        self.bytes_read -= full.numel() * full.element_size()
        piece = full.narrow(dim, start, length).clone()
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def read_ranges(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Slices ``[start, start + length)`` of ``dim``, concatenated along it, as an owned
        tensor. Readers backed by files override this to copy each byte once."""
        import torch

        parts = [self.read_narrow(name, dim, start, length) for start, length in ranges]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([dtypes.movable_view(p) for p in parts], dim=dim).view(parts[0].dtype)

    # -- where the bytes are: what read plans are made of ---------------------------------------
    # A read plan names a tensor's bytes as (source, begin, end). The default makes each tensor
    # its own source, read whole; file-backed readers name their files instead, which another
    # process can map (``readers.mapped.open_sources``).

    #: the bytes of each file ``locate`` refers to, by index (``sources.bytesource``): what a
    #: load asks of them (a stream picks the objects among them); none for tensors held here
    byte_sources: Sequence[ByteSource] = ()

    def sources(self) -> list[SourceSpec]:
        """The byte sources ``locate`` refers to, by index (``sources.specs``): a
        ``FileSource`` for a file any process may map, a ``TensorSource`` for bytes held only
        here."""
        return [TensorSource(name) for name in self.metadata()]

    def locate(self, name: str) -> tuple[int, int, int]:
        """``(source, begin, end)``: the tensor's bytes, in C order, within source ``source``."""
        meta = self.meta(name)
        return self._source_index()[name], 0, meta.nbytes

    def locate_all(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """``(source, begin)`` of each tensor of ``names`` (``locate``'s first two, for a read
        plan of every tensor at once)."""
        return [self.locate(name)[:2] for name in names]

    def source_bytes(self, index: int) -> torch.Tensor:
        """Source ``index`` as a 1-D uint8 tensor (a view where it can be), checked to be what
        was opened (a changed file is a ``FormatError``)."""
        import torch

        return self.read(self.names()[index]).view(-1).view(torch.uint8)

    def view(self, name: str) -> torch.Tensor | None:
        """The tensor where it lies, not a copy: a view of a mapped file's pages, or ``None``
        where this reader has none to give (it then reads with ``read``).

        For a caller that asks for it (vLLM's weight loaders narrow a whole tensor themselves
        and copy only their slice out of it): the bytes are faulted in only as they are read,
        writes to the view stay in this process, and the view keeps its mapping alive after
        ``close``. A file checkpoint checks the file is unchanged before giving it.

        >>> ckpt.view("model.norm.weight").shape            # doctest: +SKIP
        torch.Size([2048])
        """
        return None

    def release_bytes(self, index: int, begin: int, end: int) -> None:  # noqa: B027 - an optional hook
        """A hint that bytes ``[begin, end)`` of source ``index`` are not needed here soon."""

    def prefetch_bytes(self, index: int, begin: int, end: int) -> None:  # noqa: B027 - an optional hook
        """A hint that bytes ``[begin, end)`` of source ``index`` will be read soon (a file's
        reader asks the kernel to start reading them into the page cache)."""

    def _source_index(self) -> dict[str, int]:
        cached = getattr(self, "_source_indices", None)
        if cached is None:
            cached = self._source_indices = {n: k for k, n in enumerate(self.metadata())}
        return cached

    def release(self, name: str) -> None:  # noqa: B027 - an optional hook
        """A hint that this process will not read ``name`` again soon: readers backed by
        mapped files give its pages back (the loader calls it once every worker here has its
        piece)."""

    def tensor_format(self, name: str) -> dict | None:
        """Format details a planner needs beyond shape and dtype, or ``None``.

        GGUF answers ``{"ggml_type": "Q4_1", "block_size": 32, "type_size": 20}`` for a
        quantized tensor stored as raw blocks.
        """
        return None

    @property
    def config(self) -> dict:
        """Architecture metadata stored with the tensors: HF ``config.json`` (with
        ``quantize_config.json`` as ``quantization_config``), GGUF key-values, MLC's
        ``mlc-chat-config.json``. Empty when there is none."""
        return {}

    def meta(self, name: str) -> TensorMeta:
        try:
            return self.metadata()[name]
        except KeyError:
            raise KeyError(f"{self.source}: no tensor named {name!r}") from None

    def names(self) -> list[str]:
        return list(self.metadata())

    #: ``(local folder, what it stands for)`` where this checkpoint's files were brought here
    #: from elsewhere (object storage: ``readers.objects``), for ``name_of``
    named_as: tuple[str, str] | None = None

    def name_of(self, path: str) -> str:
        """What messages call a local file of this checkpoint: its path, or, for a checkpoint
        brought from object storage, its URL there."""
        if self.named_as is None:
            return path
        local, remote = self.named_as
        rel = os.path.relpath(path, local)
        if rel == "." or rel.startswith(".."):
            return remote if rel == "." else path
        return remote.rstrip("/") + "/" + rel.replace(os.sep, "/")

    def confirm_unchanged(self) -> None:  # noqa: B027 - an optional hook
        """A ``FormatError`` if a file of the checkpoint is no longer the one opened: each read
        checks its file before it starts, this checks them all once a job's reads are done (an
        engine that takes new weights asks before it lets go of its old ones)."""

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release files and mappings. Tensors already returned stay valid."""

    def __contains__(self, name: object) -> bool:
        return name in self.metadata()

    def __iter__(self) -> Iterator[str]:
        return iter(self.metadata())

    def __len__(self) -> int:
        return len(self.metadata())

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r}, {len(self)} tensors)"
