"""What one worker's piece of a tensor consists of: ranges along one axis, in the tensor's units.

A shard function may declare a ``ranges`` rule (``register_shard_func(..., ranges=rule)``) that
returns a ``Selection`` for worker ``i`` of ``N``: the piece is the input's ranges
``[start, start + length)`` along ``axis``, concatenated in order, a range without a start
being zeros (a padded unit). From it the loader works out, before anything is read, which bytes
of which file each worker copies, so each reads only its own. The units are the stored
tensor's own (packed int32 words, rows of group scales, raw GGUF blocks): no format knowledge
is needed.

>>> Selection(0, ((0, 2), (2, 2), (None, 1))).coalesced()
Selection(axis=0, ranges=((0, 4), (None, 1)))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Range", "Selection"]

#: ``(start, length)`` along the axis; ``start`` None: ``length`` units of zeros
Range = tuple[int | None, int]


@dataclass(frozen=True)
class Selection:
    """The ranges along ``axis`` that make one worker's piece; ``axis`` None is the whole
    tensor (what ``replicate`` keeps, and the only selection a 0-d tensor has)."""

    axis: int | None
    ranges: tuple[Range, ...] = ()

    @classmethod
    def whole(cls) -> Selection:
        return cls(None)

    @property
    def length(self) -> int:
        """Units of the piece along the axis."""
        return sum(length for _, length in self.ranges)

    @property
    def has_zeros(self) -> bool:
        return any(start is None for start, _ in self.ranges)

    def coalesced(self) -> Selection:
        """The same piece in as few ranges as possible: ranges that touch are merged (a worker's
        consecutive heads or blocks become one read), as are runs of zeros; empty ones go."""
        merged: list[list] = []
        for start, length in self.ranges:
            if length == 0:
                continue
            if merged:
                last = merged[-1]
                if start is None and last[0] is None:
                    last[1] += length
                    continue
                if start is not None and last[0] is not None and last[0] + last[1] == start:
                    last[1] += length
                    continue
            merged.append([start, length])
        return Selection(self.axis, tuple((s, n) for s, n in merged))

    def piece_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if self.axis is None:
            return tuple(shape)
        return (*shape[: self.axis], self.length, *shape[self.axis + 1 :])

    def check(self, shape: Sequence[int]) -> None:
        """``ValueError`` unless this selection lies within a tensor of ``shape``."""
        if self.axis is None:
            if self.ranges:
                raise ValueError("a whole-tensor selection has no ranges")
            return
        if type(self.axis) is not int or not 0 <= self.axis < len(shape):
            raise ValueError(f"axis {self.axis!r} is out of range for a {len(shape)}-D input")
        size = shape[self.axis]
        for start, length in self.ranges:
            if type(length) is not int or length < 0:
                raise ValueError(f"range length {length!r} must be a non-negative integer")
            if start is not None and (type(start) is not int or start < 0 or start + length > size):
                raise ValueError(
                    f"range [{start}, {start} + {length}) lies outside the "
                    f"{size} units of axis {self.axis}"
                )
