"""``__placement__``: whole parameters held by some workers only (expert parallelism).

A plan may hold whole parameters on some workers only (each worker holds whole experts):
``"__placement__": {"num_shards": N, "params": {name: [worker, ...]}}``. A placed parameter
takes no steps (each of its workers keeps it whole), the plan is for that N alone (binding it to
another is refused with the way to re-plan), and a worker not named neither reads nor keeps it
(``ParamPlan.workers``, ``ValidatedPlan.held_by``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .. import strict_json
from ..errors import PlanError, quote
from . import limits
from .messages import brief

__all__ = ["Placement", "check_placed"]


@dataclass(frozen=True)
class Placement:
    """Which workers hold which whole parameters (the plan's ``__placement__``), for the one
    ``num_shards`` it was written for.

    >>> Placement.from_json({"num_shards": 2, "params": {"experts.1.w": [1]}}).params
    mappingproxy({'experts.1.w': (1,)})
    """

    num_shards: int
    params: Mapping[str, tuple[int, ...]]

    KEY = "__placement__"

    @classmethod
    def from_json(cls, data: Any, source: str | None = None) -> Placement:
        def refuse(what: str) -> PlanError:
            return PlanError(f"{cls.KEY} {what}", source=source)

        if not isinstance(data, Mapping) or set(data) != {"num_shards", "params"}:
            raise refuse(
                'must be an object {"num_shards": N, "params": {name: [worker, ...]}}'
                f", got {brief(data)}"
            )
        n, params = data["num_shards"], data["params"]
        if type(n) is not int or not 1 <= n <= limits.MAX_NUM_SHARDS:
            raise refuse(
                f"num_shards is {quote(n, 40)}: an integer from 1 to {limits.MAX_NUM_SHARDS}"
            )
        if not isinstance(params, Mapping) or len(params) > limits.MAX_PARAMS:
            raise refuse(
                f"params must be an object of at most {limits.MAX_PARAMS} names, got "
                f"{brief(params)}"
            )
        out: dict[str, tuple[int, ...]] = {}
        for name, workers in params.items():
            if not isinstance(name, str) or not name or not strict_json.is_text(name):
                raise refuse(f"names a parameter {brief(name)}: names are non-empty strings")
            if (
                not isinstance(workers, list)
                or not workers
                or any(type(w) is not int or not 0 <= w < n for w in workers)
                or len(set(workers)) != len(workers)
            ):
                raise PlanError(
                    f"{cls.KEY}: the workers holding it must be a non-empty list "
                    f"of distinct workers 0..{n - 1} (num_shards={n}), got "
                    f"{brief(workers)}",
                    source=source,
                    param=name,
                )
            held = tuple(sorted(workers))
            out[name] = held
        return cls(n, MappingProxyType(out))

    def to_json(self) -> dict:
        return {
            "num_shards": self.num_shards,
            "params": {name: list(workers) for name, workers in self.params.items()},
        }


def check_placed(placement: Placement, steps: Mapping[str, tuple], source: str | None):
    """A placed parameter is held whole by its workers: it takes no steps."""
    for name in placement.params:
        if steps.get(name):
            raise PlanError(
                f"is placed on workers {list(placement.params[name])} "
                f"({Placement.KEY}) and has steps: a placed parameter is held "
                "whole by its workers, so it takes none",
                source=source,
                param=name,
            )
