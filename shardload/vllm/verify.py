"""``verify``: prove, for every vLLM parameter, that it was made only of bytes this rank read.

vLLM narrows each full tensor in its own ``weight_loader``; shardload wrote only the bytes its
plan gives the rank. If the two disagree anywhere, a parameter ends up holding bytes shardload
never read. To catch every such byte, whatever the dtype or what the loader computes from them:

1. every parameter is filled with one pattern, and every stand-in byte this rank did not read
   with another ("poison");
2. the model's own ``load_weights`` runs; every parameter is copied;
3. both are filled again with two other patterns, and ``load_weights`` runs again;
4. a parameter byte that differs between the two runs came from poison (the load failed: the
   parameter is named), or was never written (its pattern both times: a parameter vLLM makes
   from the config, not the checkpoint; it gets back the value it had, and is reported).

The cost is two loads and a copy of the model, so it is an option, for tests and first runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..errors import ShardloadError
from .standins import Block

__all__ = ["VerifyError", "poison", "verified_load"]

#: (parameter pattern, poison pattern) of each of the two loads
PATTERNS = ((0x3C, 0x5A), (0xC3, 0xA5))


class VerifyError(ShardloadError):
    """Bytes this rank did not read reached vLLM parameters."""


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def poison(tensor: torch.Tensor, mine: Iterable[Block], value: int) -> None:
    """Set every byte of ``tensor`` outside the blocks ``mine`` to ``value``."""
    data = _bytes(tensor)
    outside = torch.ones(data.numel(), dtype=torch.bool)
    for b in mine:
        if b.nbytes and b.count:
            outside.as_strided((b.count, b.nbytes), (b.stride, 1), b.offset).fill_(False)
    data[outside] = value


def verified_load(
    params: dict[str, torch.Tensor], load: Callable[[int], None], rank: int
) -> list[str]:
    """Run ``load(poison_value)`` twice as the module docstring says; the names of parameters
    vLLM never wrote (restored). Raises ``VerifyError`` naming every poisoned parameter."""
    original = {name: p.detach().clone() for name, p in params.items()}
    runs = []
    for fill, bad in PATTERNS:
        for p in params.values():
            _bytes(p).fill_(fill)
        load(bad)
        runs.append({name: _bytes(p).clone() for name, p in params.items()})
    (first, second), poisoned, unwritten = runs, [], []
    (fill_a, _), (fill_b, _) = PATTERNS
    for name, p in params.items():
        a, b = first[name], second[name]
        differs = a != b
        if not bool(differs.any()):
            continue
        untouched = differs & (a == fill_a) & (b == fill_b)
        bad = int((differs & ~untouched).sum())
        if bad:
            poisoned.append(f"{name} ({bad} of {a.numel()} bytes)")
        elif bool(untouched.all()):
            unwritten.append(name)
            p.data.copy_(original[name])
        else:  # partly written: the rest keeps its pattern, which no checkpoint gave it
            poisoned.append(f"{name} ({int(untouched.sum())} of {a.numel()} bytes never written)")
    if poisoned:
        raise VerifyError(
            f"verify failed on rank {rank}: {len(poisoned)} vLLM parameter(s) hold bytes this "
            f"rank did not read, so shardload's plan is not the slice vLLM narrows: "
            + "; ".join(poisoned[:8])
            + (" ..." if len(poisoned) > 8 else "")
        )
    return unwritten
