"""The one place where model metadata is read: typed, range-checked fields that name their file.

A checkpoint's metadata (HF ``config.json`` with its ``quantization_config`` or
``quantize_config.json``, GGUF key-values, MLC's ``mlc-chat-config.json``) is written by many
tools, and sometimes wrongly. The planners never index those dicts themselves; they ask a
``Fields`` for a field by name, type and range, and get either a value they can trust or a
``FormatError`` that names the file and the key, says what was found and what is allowed::

    ckpt/config.json: key 'quantization_config.group_size' is 'x' (a string); it must be an
    integer >= 1 or -1

The rules, the same for every source:

- **No coercion.** An integer field takes a JSON/GGUF integer only: ``true`` is not 1 (booleans
  are refused), ``"4"`` and ``"four"`` are not 4, and ``4.0`` is not 4.
- **Every integer has a range**, checked before the value sizes an allocation or a loop
  (``MAX_HEADS`` and friends below give the planners' bounds).
- **Absent** fields take the ``default`` where one is given, else they are refused.
- **Null** (JSON ``null``) counts as absent only where the caller says so (``nullable=True``:
  fields HF writes as ``null`` when unset, such as ``head_dim``); anywhere else it is refused,
  so ``"bits": null`` is an error, not 4.

>>> cfg = Fields({"num_attention_heads": 8, "quantization_config": {"bits": 4}},
...              file="ckpt/config.json")
>>> heads = cfg.int("num_attention_heads", min=1, max=MAX_HEADS)
>>> cfg.int("num_key_value_heads", min=1, max=heads, default=heads, nullable=True)
8
>>> q = cfg.sub("quantization_config", optional=True)
>>> q.int("bits", choices=(2, 3, 4, 8), default=4), q.int("group_size", min=1, also=(-1,),
...                                                         default=-1)
(4, -1)
>>> Fields({"bits": "four"}, file="q.json").int("bits", choices=(2, 3, 4, 8))
Traceback (most recent call last):
...
shardload.errors.FormatError: q.json: key 'bits' is 'four' (a string); it must be one of 2, 3, 4, 8

GGUF keys carry the architecture as a prefix: ``Fields(kv, file=path, prefix="llama.")`` reads
``cfg.int("attention.head_count")`` from ``llama.attention.head_count`` and names it so.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .errors import FormatError, quote

__all__ = [
    "MAX_GROUP",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_LAYERS",
    "MAX_WIDTH",
    "Fields",
    "describe_value",
]

#: bounds on what planners read: generous for every real model (the largest have 128 heads,
#: head_dim 256, under 2**17 MLP rows, a 2**18 vocabulary), small enough that nothing sized by
#: them (the per-head and per-block lists of a zero-padded plan) can exhaust memory or time
MAX_HEADS = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_WIDTH = 1 << 22  # hidden, intermediate and vocabulary sizes
MAX_LAYERS = 1 << 16
MAX_GROUP = 1 << 22  # quantization group / block sizes
#: the longest string field a planner compares
MAX_STRING = 1024

_MISSING: Any = object()
_ABSENT: Any = object()

FileLabel = str | Callable[[], str]


def describe_value(value: Any) -> str:
    """``'x' (a string)``: a found value, cut short, with its JSON kind."""
    if value is None:
        return "null"
    return f"{quote(value)} ({_kind(value)})"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction or exponent" if value == value else "NaN"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _int_rule(
    min: int | None, max: int | None, choices: Sequence[int] | None, also: Sequence[int]
) -> str:
    if choices is not None:
        return "one of " + ", ".join(map(str, choices))
    if min is not None and max is not None:
        rule = f"an integer from {min} to {max}"
    elif min is not None:
        rule = f"an integer >= {min}"
    elif max is not None:
        rule = f"an integer <= {max}"
    else:
        rule = "an integer"
    return rule + "".join(f" or {a}" for a in also)


class Fields:
    """Typed access to one JSON object (or the GGUF key-values) of a checkpoint's metadata.

    ``file`` names the file for messages (or is a function giving the name, called only when
    there is an error to report); ``prefix`` is prepended to every key looked up (GGUF's
    ``"llama."``); ``path`` is where this object sits in its file (``"quantization_config"``),
    so nested keys are named in full.
    """

    def __init__(self, data: Any, *, file: FileLabel, prefix: str = "", path: str = ""):
        if not isinstance(data, Mapping):
            where = f"key {quote(path)}" if path else "the metadata"
            raise FormatError(
                f"{where} is {describe_value(data)}; it must be an object",
                file=file() if callable(file) else file,
            )
        self._data = data
        self._file = file
        self.prefix = prefix
        self.path = path

    # -- naming

    @property
    def file(self) -> str:
        """The file these fields come from, for messages."""
        return self._file() if callable(self._file) else self._file

    @property
    def file_label(self) -> FileLabel:
        """``file`` as given: a name, or the function that gives it."""
        return self._file

    def name(self, key: str) -> str:
        """The key as the file spells it, in full: ``quantization_config.bits``,
        ``llama.attention.head_count``."""
        full = self.prefix + key
        return f"{self.path}.{full}" if self.path else full

    def error(self, key: str, message: str) -> FormatError:
        """``FormatError`` naming the file and ``key``: ``<file>: key '<key>' <message>``."""
        return FormatError(f"key {quote(self.name(key))} {message}", file=self.file)

    def refuse(self, key: str, value: Any, allowed: str) -> FormatError:
        """``FormatError``: ``key 'k' is <value> (<kind>); it must be <allowed>``."""
        return self.error(key, f"is {describe_value(value)}; it must be {allowed}")

    # -- presence

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.prefix + key in self._data

    def has(self, key: str, *, nullable: bool = False) -> bool:
        """``key`` is present (and, with ``nullable``, not null)."""
        value = self._data.get(self.prefix + key, _MISSING)
        return value is not _MISSING and not (nullable and value is None)

    def keys(self) -> Iterator[str]:
        """The keys of this object (with the prefix, for GGUF: as stored)."""
        return iter(list(self._data))

    @property
    def raw(self) -> Mapping[str, Any]:
        """The object itself, unchecked: for comparing, never for reading a field."""
        return self._data

    def _get(self, key: str, default: Any, nullable: bool, allowed: str) -> Any:
        """The stored value, or ``_ABSENT`` when the caller's default applies."""
        value = self._data.get(self.prefix + key, _MISSING)
        if value is None and nullable:
            value = _MISSING
        if value is _MISSING:
            if default is _MISSING:
                raise self.error(key, f"is absent; it must be {allowed}")
            return _ABSENT
        return value

    # -- typed getters

    def int(
        self,
        key: str,
        *,
        min: int | None = None,
        max: int | None = None,
        choices: Sequence[int] | None = None,
        also: Sequence[int] = (),
        default: Any = _MISSING,
        nullable: bool = False,
    ) -> Any:
        """An integer (``type(v) is int``: no booleans, floats or strings) within ``min`` ..
        ``max``, or one of ``choices``; ``also`` lists single values allowed outside the
        range (``-1`` for "per channel")."""
        allowed = _int_rule(min, max, choices, also)
        value = self._get(key, default, nullable, allowed)
        if value is _ABSENT:
            return default
        if type(value) is not int:
            raise self.refuse(key, value, allowed)
        if value in also:
            return value
        if choices is not None:
            if value not in choices:
                raise self.refuse(key, value, allowed)
        elif (min is not None and value < min) or (max is not None and value > max):
            raise self.refuse(key, value, allowed)
        return value

    def str(
        self,
        key: str,
        *,
        choices: Iterable[str] | None = None,
        default: Any = _MISSING,
        nullable: bool = False,
        max_len: builtins.int = MAX_STRING,
    ) -> Any:
        """A string of at most ``max_len`` characters, or one of ``choices``."""
        choices = None if choices is None else tuple(choices)
        allowed = (
            "one of " + ", ".join(map(repr, choices))
            if choices is not None
            else f"a string of at most {max_len} characters"
        )
        value = self._get(key, default, nullable, allowed)
        if value is _ABSENT:
            return default
        if not isinstance(value, str) or len(value) > max_len:
            raise self.refuse(key, value, allowed)
        if choices is not None and value not in choices:
            raise self.refuse(key, value, allowed)
        return value

    def bool(self, key: builtins.str, *, default: Any = _MISSING, nullable: bool = False) -> Any:
        """``true`` or ``false`` (not 0, 1 or ``"yes"``)."""
        value = self._get(key, default, nullable, "true or false")
        if value is _ABSENT:
            return default
        if type(value) is not bool:
            raise self.refuse(key, value, "true or false")
        return value

    def one_of(
        self,
        key: builtins.str,
        choices: Sequence[Any],
        *,
        default: Any = _MISSING,
        nullable: builtins.bool = False,
    ) -> Any:
        """One of ``choices``, compared by type and value (``True`` is not ``1``)."""
        allowed = "one of " + ", ".join(
            "null" if c is None else "true" if c is True else "false" if c is False else repr(c)
            for c in choices
        )
        value = self._get(key, default, nullable, allowed)
        if value is _ABSENT:
            return default
        if not any(type(value) is type(c) and value == c for c in choices):
            raise self.refuse(key, value, allowed)
        return value

    def int_list(
        self,
        key: builtins.str,
        *,
        length: builtins.int | None = None,
        min: builtins.int | None = None,
        max: builtins.int | None = None,
        default: Any = _MISSING,
        nullable: builtins.bool = False,
    ) -> Any:
        """A list of integers (each as ``int`` checks them), of exactly ``length`` items."""
        rule = _int_rule(min, max, None, ())
        allowed = (
            f"a list of {length} items, each {rule}"
            if length is not None
            else f"a list of integers, each {rule}"
        )
        value = self._get(key, default, nullable, allowed)
        if value is _ABSENT:
            return default
        if not isinstance(value, (list, tuple)) or (length is not None and len(value) != length):
            raise self.refuse(key, value, allowed)
        for item in value:
            if (
                type(item) is not int
                or (min is not None and item < min)
                or (max is not None and item > max)
            ):
                raise self.refuse(key, value, allowed)
        return list(value)

    def sub(
        self, key: builtins.str, *, optional: builtins.bool = False, file: FileLabel | None = None
    ) -> Fields | None:
        """The object under ``key`` as ``Fields`` (its keys named ``key.inner``). With
        ``optional``, an absent or null ``key`` gives ``None``; an int, string or list is
        always refused. ``file`` names the file the object came from when it is not this
        one's (a reader may have merged it in from a side file)."""
        value = self._data.get(self.prefix + key, _MISSING)
        if value is _MISSING or (value is None and optional):
            if optional:
                return None
            raise self.error(key, "is absent; it must be an object")
        if not isinstance(value, Mapping):
            raise self.refuse(key, value, "an object")
        return Fields(value, file=file or self._file, path=self.name(key))

    def __repr__(self) -> builtins.str:
        return f"Fields({self.path or '<top>'!s}, prefix={self.prefix!r}, {len(self._data)} keys)"
