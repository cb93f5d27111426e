"""Importing the modules a user names, and knowing which module re-creates a function.

Plugins (shard functions, session functions) are registered by importing modules the user
named: never a module a plan or a message names. A worker process learns a function the
controller registered by importing the module it came from (code the controller already ran).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["import_modules", "importable_module", "lazy_names"]


def import_modules(modules: Iterable[str], what: str = "plugin module") -> None:
    """Import each of ``modules``; one that fails to import, whatever the reason (missing, a
    syntax error, an exception at import, a duplicate registration), is an ``ImportError``
    naming it.

    >>> import_modules(["no_such_module_x"])
    Traceback (most recent call last):
    ImportError: cannot import plugin module 'no_such_module_x': No module named 'no_such_module_x'
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            why = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
            raise ImportError(f"cannot import {what} {module!r}: {why}") from exc


def importable_module(func: Callable[..., Any]) -> str | None:
    """The module another process can import to define ``func`` too, or ``None``.

    Functions defined in ``__main__`` or inside another function cannot be re-created by
    importing anything; their registration stays in the process that ran it.

    >>> importable_module(importable_module)
    'shardload.modules'
    """
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in qualname:
        return None
    return module


def lazy_names(package: str, table: dict[str, str], namespace: dict, names: list[str]):
    """``__getattr__`` and ``__dir__`` for a package whose public names are imported when first
    used: ``table`` maps each to the submodule defining it, ``namespace`` is the package's
    ``globals()`` (a name, once imported, is kept there), ``names`` its ``__all__``. So a
    package can list its API without importing torch until something needs it.

    >>> getattr_, dir_ = lazy_names("shardload", {"Staging": "staging"}, {}, ["Staging"])
    >>> dir_()
    ['Staging']
    """

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return list(names)

    return __getattr__, __dir__
