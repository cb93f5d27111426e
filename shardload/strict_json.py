"""JSON as shardload reads it from files it does not trust (plans, headers, indexes).

Stricter than ``json.loads``, each refusal a ``ValueError`` with a readable reason:

- the text must be **UTF-8** (RFC 8259 §8.1). ``json.loads(bytes)`` would quietly detect and
  decode UTF-16 and UTF-32; here bytes are decoded as UTF-8 and nothing else, and a text that
  looks like UTF-16/32 (a byte order mark, or NUL bytes, which JSON text never holds) is named as
  such. A UTF-8 byte order mark is refused too: RFC 8259 forbids writing one, Python's
  ``json.loads(str)`` and the safetensors library refuse it, and the fix is one re-save;
- a key repeated in one object (``json`` silently keeps the last one, so one name could mean two
  things);
- the non-standard ``NaN`` / ``Infinity`` literals, and numbers such as ``1e400`` that overflow a
  float64 to infinity (they would fail later, far from the file, e.g. in a process session's
  transport, which refuses non-finite numbers);
- a string holding a lone UTF-16 surrogate (``"\\ud800"``): it is not Unicode text, and a
  message quoting it could not even be printed to a UTF-8 terminal;
- nesting so deep that the parser would hit the recursion limit.

>>> loads('{"a": 1}')
{'a': 1}
>>> loads('[1e400]')
Traceback (most recent call last):
...
ValueError: number 1e400 is out of the float64 range (it would be infinity)
"""

from __future__ import annotations

import codecs
import contextlib
import gc
import json
import math
import re
import threading
from typing import Any, Iterator, Union

from .errors import quote

__all__ = ["loads", "gc_paused", "is_text"]

_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
         (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))
# a \u escape of a UTF-16 surrogate: the only way a lone surrogate gets into parsed JSON
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building a large acyclic structure.

    Parsing a 50 MB document creates millions of lists and dicts; each allocation burst
    triggers a collection that walks every object made so far, which makes the parse several
    times slower as it grows. Nothing built here has cycles (reference counting frees it), so
    collection only waits. Nests, and is safe across threads: the collector comes back when
    the last one leaves, if it was on when the first entered.
    """
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {quote(key)}")
            seen.add(key)
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        raise ValueError(f"number {shown} is out of the float64 range (it would be infinity)")
    return value


def _decode(data: bytes) -> str:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            raise ValueError(f"not UTF-8: the text starts with a {encoding} byte order mark; "
                             "JSON must be UTF-8 (re-save it as UTF-8)")
    if data.startswith(codecs.BOM_UTF8):
        raise ValueError("not UTF-8 as JSON needs it: the text starts with a UTF-8 byte order "
                         "mark, which JSON forbids (re-save it as UTF-8 without a BOM)")
    if b"\x00" in data[:4]:
        raise ValueError("not UTF-8: the text holds NUL bytes, so it looks like UTF-16 or "
                         "UTF-32; JSON must be UTF-8 (re-save it as UTF-8)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None


def is_text(s: str) -> bool:
    """False for a string holding a lone surrogate: json turns the escape ``"\\ud800"`` into
    one, which is not text and cannot be printed, written back or matched with a name from
    anywhere else."""
    if s.isascii():  # the common case, and O(1)
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(data: Any) -> "str | None":
    """The first string (or key) in ``data`` that holds a lone surrogate, or None."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not is_text(item):
                return item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def loads(text: Union[str, bytes, bytearray, memoryview], *,
          allow_lone_surrogates: bool = False) -> Any:
    """Parse ``text``; ``ValueError`` for text that is not UTF-8, invalid, duplicate-keyed,
    non-finite, not valid Unicode or absurdly nested JSON.

    ``allow_lone_surrogates=True`` keeps strings such as ``"\\ud800"`` (for a transport
    between trusted processes that must carry any Python string ``json.dumps`` wrote)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = _decode(bytes(text))
    elif text.startswith("\ufeff"):
        raise ValueError("the text starts with a byte order mark, which JSON forbids (re-save "
                         "it as UTF-8 without a BOM)")
    try:
        with gc_paused():
            data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                              parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not allow_lone_surrogates and "\\u" in text and _SURROGATE_ESCAPE.search(text):
        bad = _lone_surrogate(data)
        if bad is not None:
            raise ValueError(f"the string {quote(bad)} holds a lone UTF-16 surrogate (a \\ud800-"
                             "\\udfff escape without its pair): it is not valid Unicode text")
    return data
