"""What the loader asks of each worker: ``LoadRequest``, the one argument of the session function
``shardload.load_pieces``, as JSON on the wire.

>>> LoadRequest("123-0").to_json()
{'load': '123-0', 'plan': None, 'stream': None, 'modules': [], 'staging': None}
>>> LoadRequest.from_json({"load": "123-0"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: a load request with keys ['load']; expected ['load', 'modules', ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..gc_pause import gc_paused
from ..readplan import ReadPlan
from ..staging import Staging
from . import wire

__all__ = ["LoadRequest"]

_KEYS = ("load", "modules", "plan", "staging", "stream")


@dataclass(frozen=True)
class LoadRequest:
    """One worker's part of a load.

    ``load`` names it (``sharing.local_load``'s token); ``plan`` is the worker's read plan, or
    None for a worker in the loader's process (it takes the load's own, ``LocalLoad.plans``);
    ``stream`` is its side of the load's stream of object bytes (``ObjectStream.spec``'s JSON),
    for a worker process; ``modules`` are plugin modules defining shard functions the plan
    computes with; ``staging`` sends the pieces through the staged pipeline (None: direct)."""

    load: str
    plan: ReadPlan | None = None
    stream: dict | None = None
    modules: tuple[str, ...] = ()
    staging: Staging | None = None

    def to_json(self) -> dict[str, Any]:
        """The request as JSON values, its plan as ``wire.encode`` writes it."""
        return {
            "load": self.load,
            "plan": None if self.plan is None else wire.encode(self.plan),
            "stream": self.stream,
            "modules": list(self.modules),
            "staging": None if self.staging is None else self.staging.to_json(),
        }

    @classmethod
    def from_json(cls, data: Any) -> LoadRequest:
        """The request ``to_json`` wrote; ``ValueError`` where it is not one."""
        if not isinstance(data, dict) or sorted(data) != list(_KEYS):
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a load request with keys {keys}; expected {list(_KEYS)}")
        load, plan, stream, modules, staging = (
            data["load"],
            data["plan"],
            data["stream"],
            data["modules"],
            data["staging"],
        )
        if not isinstance(load, str):
            raise ValueError(f"a load request naming its load by {load!r}, not a string")
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise ValueError(f"a load request whose modules are {modules!r}, not names")
        for key, value in (("plan", plan), ("stream", stream), ("staging", staging)):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"a load request whose {key} is {value!r}, not an object")
        read: ReadPlan | None = None
        if plan is not None:
            with gc_paused():  # a tuple per piece and run, all kept
                read = wire.decode(plan)
        return cls(
            load,
            read,
            stream,
            tuple(modules),
            None if staging is None else Staging.from_json(staging),
        )
