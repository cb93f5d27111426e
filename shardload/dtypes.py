"""Dtype names, as plans and checkpoints spell them, mapped to torch and numpy.

Plans use torch-style names (``"float16"``, ``"int32"``, ``"float8_e4m3fn"``); TVM's spellings
(``"e4m3_float8"``) are accepted as aliases. This module knows names only; torch is imported
when a name is turned into a ``torch.dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import quote
from .limits import INT64_MAX, MAX_DIM, MAX_NDIM

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

# canonical name -> bytes per element
ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}

#: the range of each integer dtype, for values written into one (``shardload.constant``)
INTEGER_RANGE: dict[str, tuple[int, int]] = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}

ALIASES: dict[str, str] = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "e4m3_float8": "float8_e4m3fn",
    "e5m2_float8": "float8_e5m2",
}

# safetensors header dtype -> canonical name
SAFETENSORS: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}

# Dtypes whose torch support is limited to copies and views: byte-moving code works on a
# same-width signed integer view of them.
_MOVABLE_VIEW = {
    "uint16": "int16",
    "uint32": "int32",
    "uint64": "int64",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "bool": "uint8",
}


def canonical(name: str) -> str:
    """The canonical spelling of a dtype name; ``ValueError`` if unknown.

    >>> canonical("e4m3_float8")
    'float8_e4m3fn'
    """
    if not isinstance(name, str):
        raise ValueError(f"dtype must be a string, got {quote(name)}")
    if name in ITEMSIZE:
        return name
    name = ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {quote(name)}; known: {', '.join(sorted(ITEMSIZE))}")
    return name


def shape_problem(shape: Sequence[int], dtype: str | int) -> str | None:
    """Why a tensor of ``shape`` (non-negative ints) and ``dtype`` (a name, or an item size in
    bytes) cannot exist, or ``None`` if it can: the one rule every reader and the plan apply.

    More than ``MAX_NDIM`` dims, a dim beyond ``MAX_DIM``, or a byte size beyond int64 once
    zero dims are counted as 1: torch computes strides that way, so ``[0, 2**62, 2]`` holds no
    element and still overflows (``Stride calculation overflowed``). The product is cut short
    as soon as it overflows, so a hostile shape costs time linear in its length.

    >>> print(shape_problem([0, 2**40, 2**30], "int8"))  # doctest: +NORMALIZE_WHITESPACE
    shape [0, 1099511627776, 1073741824] overflows 64-bit sizes: it would span more than
    2**63 - 1 bytes (zero dims count as 1, as strides do)
    """
    if len(shape) > MAX_NDIM:
        return f"shape has {len(shape)} dimensions; at most {MAX_NDIM} are allowed"
    span = dtype if isinstance(dtype, int) else itemsize(dtype)
    for k, d in enumerate(shape):
        if d > MAX_DIM:
            return (
                f"shape {_short(shape)} has dim {k} = {d}, beyond the {MAX_DIM} (2**53) any "
                f"shape may have (a strict reader refuses dims beyond 2**53)"
            )
        span *= max(d, 1)
        if span > INT64_MAX:
            return (
                f"shape {_short(shape)} overflows 64-bit sizes: it would span more than "
                f"2**63 - 1 bytes (zero dims count as 1, as strides do)"
            )
    return None


def _short(shape: Sequence[int]) -> str:
    text = str(list(shape))
    return text if len(text) <= 120 else text[:120] + "...]"


def itemsize(name: str) -> int:
    size = ITEMSIZE.get(name) if isinstance(name, str) else None
    return size if size is not None else ITEMSIZE[canonical(name)]


def to_torch(name: str) -> torch.dtype:
    dtype = _TORCH.get(name)
    if dtype is None:  # a load asks for every piece's: looked up once per name
        import torch

        dtype = _TORCH[name] = getattr(torch, canonical(name))
    return dtype


_TORCH: dict[str, torch.dtype] = {}


def from_torch(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return canonical(name)


def from_numpy(dtype) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    try:
        return canonical(name)
    except ValueError:
        raise ValueError(f"numpy dtype {name!r} has no shardload equivalent") from None


def numpy_carrier(name: str) -> tuple[np.dtype, bool]:
    """The numpy dtype a tensor of dtype ``name`` is made as, and whether torch must view it as
    ``name`` afterwards: numpy's own dtype where it has one, else a same-width integer
    (bfloat16 as int16, float8 as uint8).

    >>> numpy_carrier("bfloat16")
    (dtype('int16'), True)
    """
    carrier = _NUMPY.get(name)
    if carrier is None:
        import numpy as np

        name = canonical(name)
        if name in _NUMPY_OWN:
            carrier = _NUMPY[name] = (np.dtype(name), False)
        else:
            carrier = _NUMPY[name] = (
                np.dtype(f"{'u' if name.startswith('float8') else ''}int{8 * ITEMSIZE[name]}"),
                True,
            )
    return carrier


#: dtypes numpy has under the same name (the others are carried by an integer of their width)
_NUMPY_OWN = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "uint16",
        "float16",
        "int32",
        "uint32",
        "float32",
        "int64",
        "uint64",
        "float64",
    }
)
_NUMPY: dict[str, tuple[np.dtype, bool]] = {}


def movable_view(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor`` with a dtype that supports every copy/cat/index op in torch.

    Shard functions that only move elements (splits, concatenation, replication) work on this
    view so that uint32 (MLC) and float8 (FP8) tensors move exactly like any other.
    """
    import torch

    target = _MOVABLE_VIEW.get(from_torch(tensor.dtype))
    return tensor if target is None else tensor.view(getattr(torch, target))
