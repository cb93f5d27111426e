"""Which numbers of workers N a planned model allows, known while it is planned.

Every tensor the planner splits is split in whole units of its own: heads, KV heads, MLP rows,
vocabulary rows, or the packed words, quantization groups, FP8 blocks or GGUF blocks that hold
them (``decoder._in_units``). Each such split is a ``Constraint``: its units must divide among
the N workers or, for KV heads (``replicable``), N may also be a multiple of them, each unit
then going whole to the workers that need it. These are exactly the rules the plan's shard
functions apply (``shardload.split``, ``shardload.split_segments``), so a plan fits N when
every constraint allows N: the planner decides so for any N without binding or validating its
plan. Constraints are kept once per distinct rule, in checkpoint order (``Constraints``), so a
refusal names the first tensor that breaks one, as validating would.

>>> kv = Constraint(3, True, "the 3 KV heads", "k_proj.weight")
>>> [n for n in range(1, 13) if kv.allows(n)]
[1, 3, 6, 9, 12]
>>> kv.why_not(2)
'the 3 KV heads do not divide among 2 workers'
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Constraint:
    """One tensor group's rule for N.

    ``units`` split whole among the workers (``units % N == 0``), or, ``replicable`` and
    N above them, each goes whole to N / units workers (``N % units == 0``). ``what`` names the
    logical units with the keys they came from (``the 3 KV heads ('num_key_value_heads' =
    3)``), ``stored`` how the tensor stores them when it holds several per stored block
    (``stored in 64 blocks of 8 (...)``), ``tensor`` the first tensor it applies to.
    ``paddable``: zero-padding for N (``padding.Padding``) lifts it (heads and MLP blocks; the
    vocabulary is never padded).
    """

    units: int
    replicable: bool
    what: str
    tensor: str
    paddable: bool = True
    stored: str = ""

    def allows(self, num_shards: int) -> bool:
        if self.replicable and num_shards > self.units:
            return num_shards % self.units == 0
        return self.units % num_shards == 0

    def why_not(self, num_shards: int) -> str:
        """Why N breaks this constraint, as one clause."""
        subject = f"{self.what}, {self.stored}," if self.stored else self.what
        if self.replicable and num_shards > self.units:
            return (
                f"{subject} can be replicated only to a multiple of {self.units} workers, "
                f"not {num_shards}"
            )
        return f"{subject} do not divide among {num_shards} workers"


@dataclass
class Constraints:
    """The distinct constraints of a plan, in the order their first tensors come."""

    _seen: dict = field(default_factory=dict)

    def add(self, constraint: Constraint) -> None:
        key = (
            constraint.units,
            constraint.replicable,
            constraint.what,
            constraint.stored,
            constraint.paddable,
        )
        self._seen.setdefault(key, constraint)

    def __iter__(self):
        return iter(self._seen.values())

    def __len__(self) -> int:
        return len(self._seen)

    def allows(self, num_shards: int) -> bool:
        return all(c.allows(num_shards) for c in self)

    def broken(self, num_shards: int) -> list[Constraint]:
        """The constraints ``num_shards`` breaks, first tensor first."""
        return [c for c in self if not c.allows(num_shards)]


__all__ = ["Constraint", "Constraints"]
