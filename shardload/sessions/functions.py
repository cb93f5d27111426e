"""Session functions: what workers run on request, by name.

A session function is ``func(ctx, *args)``, ``ctx`` being the worker's ``WorkerContext``. The
table is closed like the shard-function registry (both are a ``table.Table``): a name is looked
up, never imported. A worker process learns a function the controller registered by importing
the module it came from (``modules.importable_module``), code the controller already ran; a
function defined in ``__main__`` or inside another function cannot be re-created there.

The loader's own per-worker load is a session function like any other
(``shardload.load_pieces``); sessions run it without knowing what it does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UnknownSessionFunctionError
from ..table import Table

__all__ = [
    "SessionFunc",
    "get_session_func",
    "list_session_funcs",
    "register_session_func",
    "unregister_session_func",
]


@dataclass(frozen=True)
class SessionFunc:
    """A function workers run on request: ``func(ctx, *args)``, ``ctx`` a ``WorkerContext``."""

    name: str
    func: Callable[..., Any]
    module: str = ""


#: the table: a function registered again (a re-imported module) is the same one
_table: Table[SessionFunc] = Table(
    "session function", UnknownSessionFunctionError, same=lambda old, new: old.func is new.func
)


def register_session_func(
    name: str, func: Callable[..., Any] | None = None, *, override: bool = False
):
    """Register a function sessions can run on every worker with ``session.call(name, *args)``.

    It is called as ``func(ctx, *args)`` on each worker, where ``ctx`` is that worker's
    ``WorkerContext`` (``rank``, ``world_size``, ``device``, ``shards``, ``values``); args and
    results are JSON values or torch tensors. Registering a taken name with another function
    raises ``ValueError`` unless ``override=True``.

    >>> @register_session_func("my_org.count_params")                 # doctest: +SKIP
    ... def count_params(ctx):
    ...     return sum(t.numel() for t in ctx.shards.values())
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"session function name must be a non-empty string, got {name!r}")

    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"session function {name!r} must be callable, got {f!r}")
        # registering the same function again, as a re-imported module does, is harmless
        _table.add(SessionFunc(name, f, getattr(f, "__module__", "") or ""), override)
        return f

    return register if func is None else register(func)


def get_session_func(name: str) -> SessionFunc:
    """The registered ``SessionFunc``; ``UnknownSessionFunctionError`` (a ``KeyError``) with
    close-match suggestions if there is none."""
    return _table.get(name)


def list_session_funcs() -> list[SessionFunc]:
    """Every registered session function, sorted by name."""
    return _table.entries()


def unregister_session_func(name: str) -> None:
    """Remove ``name`` (tests and interactive sessions); nothing happens if it is unknown."""
    _table.remove(name)
