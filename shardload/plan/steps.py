"""A step, as written (``RawStep``) and as bound (``Step``), and the one way a plan is written.

``step_json`` writes a step as ``shard_info.json`` has it, and ``plan_json`` a whole plan;
``RawStep``, ``Step``, ``ShardInfo.to_dict``/``dumps``, ``Plan.to_dict`` and the planners all go
through them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import dtypes
from .placement import Placement

__all__ = ["METADATA_KEY", "RawStep", "Scalar", "Step", "plan_json", "step_json"]

Scalar = int | float | bool | None | str

#: the reserved key for information about the plan itself (not a parameter)
METADATA_KEY = "__metadata__"


def step_json(func: str, out_shape: Any, dtype: str, extra: Any = ()) -> list:
    """One step as ``shard_info.json`` writes it: ``[func, [out_shape, dtype], *extra]``.

    The one serialisation of a step: ``RawStep.to_json``, ``Step.to_json``,
    ``ShardInfo.to_dict`` (and so ``dumps``), ``Plan.to_dict`` and the planners all use it.

    >>> step_json("shardload.split", ("num_shards", "8 // num_shards"), "float16", (0,))
    ['shardload.split', [['num_shards', '8 // num_shards'], 'float16'], 0]
    """
    return [func, [list(out_shape), dtype], *extra]


def plan_json(
    metadata: Mapping[str, Any], params: Mapping[str, tuple], placement: Placement | None = None
) -> dict:
    """``{"__metadata__": ..., "__placement__": ..., name: [step, ...]}``: a plan's steps
    (``RawStep`` or ``Step``, each written by ``step_json``) as ``shard_info.json`` holds them."""
    out: dict[str, Any] = {METADATA_KEY: metadata} if metadata else {}
    if placement is not None:
        out[Placement.KEY] = placement.to_json()
    out.update({name: [s.to_json() for s in steps] for name, steps in params.items()})
    return out


@dataclass(frozen=True)
class RawStep:
    """One step as written: shapes and args may still be ``num_shards`` expressions."""

    func: str
    out_shape: tuple[int | str, ...]
    dtype: str
    extra: tuple[Scalar, ...]
    #: whether ``out_shape`` / ``extra`` hold expressions: computed once (C-speed scans), since
    #: binding asks for every step
    symbolic_shape: bool = field(init=False, repr=False, compare=False)
    symbolic_extra: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "symbolic_shape", str in map(type, self.out_shape))
        object.__setattr__(self, "symbolic_extra", str in map(type, self.extra))

    @property
    def is_symbolic(self) -> bool:
        return self.symbolic_shape or self.symbolic_extra

    def to_json(self) -> list:
        return step_json(self.func, self.out_shape, self.dtype, self.extra)


@dataclass(frozen=True)
class Step:
    """One step with every expression evaluated."""

    index: int
    func: str
    out_shape: tuple[int, ...]
    dtype: str
    extra: tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.out_shape) * dtypes.itemsize(self.dtype)

    def to_json(self) -> list:
        return step_json(self.func, self.out_shape, self.dtype, self.extra)
