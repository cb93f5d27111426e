"""A closed table of named entries: what every registry of shardload is built on.

A table holds entries by name; nothing is ever imported because a name is asked for. Its rules
are the registries' (shard functions, session functions, and those to come):

* ``add(entry)``: an entry under a free name is added; the same entry again (as ``same``
  judges it: a re-imported plugin registers the same function again) is harmless and replaces
  the old one; a different one under a taken name is a ``ValueError`` naming the table's kind
  and the module that holds the name, unless ``override=True``;
* ``get(name)``: the entry, or the table's own missing-name error, made by ``missing(name,
  known names)`` (a ``KeyError`` with close-match suggestions, as ``errors`` defines them);
* ``names()`` and ``entries()`` sorted by name; ``remove(name)``, a no-op for a free name.

An entry is any object with a ``name`` (and a ``module``, where the "already registered"
message can say who took the name). Every operation holds the table's ``lock``, a re-entrant
one, so a registry may hold it across several operations (loading its built-ins once).

This module imports nothing of shardload: any layer may build a table on it.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class Format:
...     name: str
...     bits: int
...     module: str = "my_formats"
>>> formats = Table("quantization format", lambda name, known: KeyError(name),
...                 same=lambda old, new: old.bits == new.bits)
>>> formats.add(Format("q4", 4))
Format(name='q4', bits=4, module='my_formats')
>>> formats.add(Format("q4", 4))                   # the same again: harmless
Format(name='q4', bits=4, module='my_formats')
>>> formats.add(Format("q4", 8))                   # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: quantization format 'q4' is already registered (by my_formats); pass override=...
>>> formats.add(Format("q8", 8)).name, formats.names(), formats.get("q8").bits
('q8', ['q4', 'q8'], 8)
>>> formats.remove("q8"); "q8" in formats
False
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Table"]

E = TypeVar("E")


def _identical(old: object, new: object) -> bool:
    """The default ``same``: an entry is the same again when it is the same object."""
    return old is new


class Table(Generic[E]):
    """Entries by name, closed: added, looked up, listed and removed, never imported.

    ``kind`` names what the entries are in messages (``"shard function"``); ``missing(name,
    known)`` makes the error ``get`` raises for a name not there (``known``: the names that
    are); ``same(old, new)`` says whether ``new``, added under ``old``'s name, is the same entry
    again (default: the same object).
    """

    def __init__(
        self,
        kind: str,
        missing: Callable[[str, list[str]], BaseException],
        *,
        same: Callable[[E, E], bool] | None = None,
    ):
        self.kind = kind
        self._missing = missing
        self._same = _identical if same is None else same
        self._entries: dict[str, E] = {}
        #: held by every operation; re-entrant, so a caller may hold it across several
        self.lock = threading.RLock()

    def add(self, entry: E, override: bool = False) -> E:
        """Put ``entry`` under its name; returns it. A different entry under a taken name is a
        ``ValueError`` unless ``override``; the same one again replaces it quietly."""
        name = entry.name  # type: ignore[attr-defined]
        with self.lock:
            old = self._entries.get(name)
            if old is not None and not override and not self._same(old, entry):
                by = getattr(old, "module", "") or "unknown module"
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {by}); pass "
                    "override=True to replace it"
                )
            self._entries[name] = entry
        return entry

    def get(self, name: str) -> E:
        """The entry named ``name``; the table's missing-name error if there is none."""
        with self.lock:
            entry = self._entries.get(name)
            if entry is None:
                raise self._missing(name, list(self._entries))
            return entry

    def names(self) -> list[str]:
        """Every name, sorted."""
        with self.lock:
            return sorted(self._entries)

    def entries(self) -> list[E]:
        """Every entry, sorted by name."""
        with self.lock:
            return [self._entries[k] for k in sorted(self._entries)]

    def remove(self, name: str) -> None:
        """Take ``name`` out; nothing happens if it is not there."""
        with self.lock:
            self._entries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        with self.lock:
            return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Table({self.kind!r}, {len(self)} entries)"
