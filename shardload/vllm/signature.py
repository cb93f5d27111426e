"""What a refit checks first: the new checkpoint holds the tensors the engine serves.

A running engine's model was built for one set of checkpoint tensors, each of one shape and
dtype. vLLM's layerwise reload processes a layer as soon as its weights are in: a checkpoint
that lacks a tensor, or holds one of another shape, would fail or half-load midway, with some
layers new and some old. So a refit compares the new checkpoint's tensors with those of the
checkpoint the engine serves (their headers only, nothing read) before it touches the model,
and refuses any difference, naming it:

>>> old = Signature({"w": ("bfloat16", (4, 2))}, "step-1")
>>> Signature({"w": ("bfloat16", (4, 3))}, "step-2").differences(old)
['w: shape [4, 3], the engine serves [4, 2]']

A float tensor may come in another float dtype (vLLM's loaders cast it, as on a first load);
any other change of dtype is refused (a packed or quantized tensor read as another).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..readers import Checkpoint

__all__ = ["Signature"]

#: dtypes vLLM's loaders cast between on a load (shardload's canonical names)
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

#: differences named in a refusal, the rest counted
_NAMED = 3


@dataclass(frozen=True)
class Signature:
    """Every tensor of a checkpoint, ``{name: (dtype, shape)}``, and where it came from."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    origin: str

    @classmethod
    def of(cls, ckpt: Checkpoint, origin: str) -> Signature:
        """The tensors of an open checkpoint (its headers: nothing is read)."""
        return cls({m.name: (m.dtype, tuple(m.shape)) for m in ckpt.metadata().values()}, origin)

    def differences(self, served: Signature) -> list[str]:
        """What this checkpoint would change of ``served``, one phrase a tensor, in name order
        (empty: the same tensors)."""
        out = []
        for name in sorted(served.tensors.keys() | self.tensors.keys()):
            mine, theirs = self.tensors.get(name), served.tensors.get(name)
            if mine is None:
                out.append(f"{name}: missing")
            elif theirs is None:
                out.append(f"{name}: not a tensor the engine serves")
            elif mine[1] != theirs[1]:
                out.append(f"{name}: shape {list(mine[1])}, the engine serves {list(theirs[1])}")
            elif mine[0] != theirs[0] and not {mine[0], theirs[0]} <= _FLOATS:
                out.append(f"{name}: dtype {mine[0]}, the engine serves {theirs[0]}")
        return out

    def describe_differences(self, served: Signature) -> str | None:
        """``differences`` as one line (None: none), the first few named and the rest
        counted."""
        found = self.differences(served)
        if not found:
            return None
        more = f" and {len(found) - _NAMED} more" if len(found) > _NAMED else ""
        return (
            f"{len(found)} tensor(s) differ from {served.origin}, which the engine serves: "
            f"{'; '.join(found[:_NAMED])}{more}"
        )
