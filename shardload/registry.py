"""The closed registry of shard functions.

A plan names functions; the loader looks the names up here and nowhere else. Nothing is ever
imported because a plan mentions it: plugins come from modules the user names (``plugins=[...]``,
``--plugin MODULE``) or from the ``shardload.shard_functions`` entry point group.

A shard function uses destination-passing style: ``func(input, *extra_args, output)``. The
loader allocates ``output`` with the shape and dtype the plan declares; the return value is
ignored. ``array`` says what the function receives: torch tensors (default), numpy arrays or
cupy arrays, both zero-copy views through DLPack.

A ``shape_rule(in_shape, in_dtype, *extra_args, num_shards=N) -> (out_shape, out_dtype)`` lets
plans be checked before any data is read; it raises ``ValueError`` with a reason when the
arguments do not fit the input.

A ``ranges(in_shape, in_dtype, *extra_args, num_shards=N, index=i) -> Selection`` rule says
which elements of the input worker ``i``'s piece consists of, so that worker reads only those
bytes instead of the loader building the whole output. It must agree with the function: the
piece is ``func``'s ``output[i]``, after the optional ``fixup(piece, *extra_args,
num_shards=N, index=i)``, which edits the piece in place (``split_rebase`` rebases indices).
A function without one is computed whole and sliced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import UnknownShardFunctionError
from .modules import import_modules
from .selection import Selection
from .table import Table

__all__ = [
    "ENTRY_POINT_GROUP",
    "Selection",
    "ShardFunc",
    "get_shard_func",
    "list_shard_funcs",
    "load_plugins",
    "register_shard_func",
    "unregister_shard_func",
]

ENTRY_POINT_GROUP = "shardload.shard_functions"
ARRAY_KINDS = ("torch", "numpy", "cupy")

ShapeRule = Callable[..., tuple[Sequence[int], str]]
RangesRule = Callable[..., Selection]
Fixup = Callable[..., None]


@dataclass(frozen=True)
class ShardFunc:
    """A registered shard function and what the loader and validator need to know about it."""

    name: str
    func: Callable[..., Any]
    array: str = "torch"
    shape_rule: ShapeRule | None = None
    #: which input elements worker i's piece is (see the module docstring), or None
    ranges: RangesRule | None = None
    #: the in-place edit a piece read by ``ranges`` still needs, or None
    fixup: Fixup | None = None
    #: number of extra args, or (minimum, None) for a variadic function
    nargs: tuple[int, int | None] = (0, 0)
    module: str = ""

    @property
    def doc(self) -> str:
        """The first line of the function's docstring."""
        text = inspect.getdoc(self.func) or ""
        return text.strip().splitlines()[0] if text.strip() else ""

    def accepts(self, n_extra: int) -> bool:
        lo, hi = self.nargs
        return n_extra >= lo and (hi is None or n_extra <= hi)

    def arity_text(self) -> str:
        lo, hi = self.nargs
        return f"at least {lo}" if hi is None else str(lo)


#: the registry: a function registered again (a re-imported plugin) is the same one
_table: Table[ShardFunc] = Table(
    "shard function", UnknownShardFunctionError, same=lambda old, new: old.func is new.func
)
#: held while the built-ins and the entry points are loaded (once), as around each operation
_lock = _table.lock
_entry_points_loaded = False


def _extra_arity(func: Callable[..., Any]) -> tuple[int, int | None]:
    """How many extra args ``func(input, *extra, output)`` takes, from its signature."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: trust the plan
        return (0, None)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        # func(input, dim, *rest) where rest ends with output
        return (max(len(positional) - 1, 0), None)
    required = [p for p in positional if p.default is p.empty]
    if len(positional) < 2:
        raise TypeError(
            f"shard function {getattr(func, '__name__', func)!r} must take "
            "(input, *extra_args, output)"
        )
    return (max(len(required) - 2, 0), len(positional) - 2)


def register_shard_func(
    name: str,
    func: Callable[..., Any] | None = None,
    *,
    override: bool = False,
    array: str = "torch",
    shape_rule: ShapeRule | None = None,
    ranges: RangesRule | None = None,
    fixup: Fixup | None = None,
):
    """Register ``func`` under ``name``; usable as a decorator or a plain call.

    Registering a name twice raises ``ValueError`` unless ``override=True``. ``shape_rule``,
    ``ranges`` and ``fixup`` are described in the module docstring; a ``ranges`` rule needs a
    ``shape_rule`` (the plan is checked with it before the rule is asked anything).

    >>> @register_shard_func("tests.disco.shard_dim_1", array="numpy")   # doctest: +SKIP
    ... def shard_dim_1(input, num_shards, output):
    ...     output[...] = input.reshape(input.shape[0], num_shards, -1).transpose(1, 0, 2)
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"shard function name must be a non-empty string, got {name!r}")
    if array not in ARRAY_KINDS:
        raise ValueError(f"array must be one of {ARRAY_KINDS}, got {array!r}")
    if ranges is not None and shape_rule is None:
        raise ValueError(f"shard function {name!r}: a ranges rule needs a shape_rule")
    if fixup is not None and ranges is None:
        raise ValueError(
            f"shard function {name!r}: a fixup applies to pieces read by a ranges rule; give one"
        )

    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"shard function {name!r} must be callable, got {f!r}")
        # a different function under a taken name needs override; registering the same
        # function again, as a re-imported plugin does, is harmless
        _table.add(
            ShardFunc(
                name=name,
                func=f,
                array=array,
                shape_rule=shape_rule,
                ranges=ranges,
                fixup=fixup,
                nargs=_extra_arity(f),
                module=getattr(f, "__module__", "") or "",
            ),
            override,
        )
        return f

    return register if func is None else register(func)


def get_shard_func(name: str) -> ShardFunc:
    """The registered ``ShardFunc`` for ``name``; ``UnknownShardFunctionError`` (a ``KeyError``)
    with close-match suggestions if there is none."""
    _ensure_loaded()
    return _table.get(name)


def list_shard_funcs() -> list[ShardFunc]:
    """Every registered function, sorted by name."""
    _ensure_loaded()
    return _table.entries()


def unregister_shard_func(name: str) -> None:
    """Remove ``name`` (tests and interactive sessions)."""
    _table.remove(name)


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Import the modules the user named, so their ``@register_shard_func`` calls run.

    A module that fails to import, for whatever reason (a missing module, a syntax error, an
    exception at import, a duplicate registration), is an ``ImportError`` naming it.
    """
    _ensure_loaded()
    import_modules(modules, "shard-function plugin")


def _ensure_loaded() -> None:
    """Register the built-ins and the entry-point plugins, once."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        from .shard_functions.builtin import BUILTINS

        for name, func, rules in BUILTINS:
            register_shard_func(name, func, **rules)

        load_entry_points()


def load_entry_points() -> list[str]:
    """Load every plugin in the ``shardload.shard_functions`` entry point group.

    Each entry point names a module (or an object in one); loading it runs its registrations.
    Returns the loaded entry point names.
    """
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:
            raise ImportError(
                f"shard-function plugin entry point {ep.name!r} ({ep.value}) failed to load: {exc}"
            ) from exc
        loaded.append(ep.name)
    return loaded
