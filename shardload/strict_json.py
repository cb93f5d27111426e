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
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson

from .errors import quote
from .gc_pause import gc_paused

__all__ = [
    "NotAnObjectError",
    "is_text",
    "loads",
    "loads_object",
    "loads_plain",
    "members_match",
    "object_pieces",
]

_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
# a \u escape of a UTF-16 surrogate: the only way a lone surrogate gets into parsed JSON
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
            raise ValueError(
                f"not UTF-8: the text starts with a {encoding} byte order mark; "
                "JSON must be UTF-8 (re-save it as UTF-8)"
            )
    if data.startswith(codecs.BOM_UTF8):
        raise ValueError(
            "not UTF-8 as JSON needs it: the text starts with a UTF-8 byte order "
            "mark, which JSON forbids (re-save it as UTF-8 without a BOM)"
        )
    if b"\x00" in data[:4]:
        raise ValueError(
            "not UTF-8: the text holds NUL bytes, so it looks like UTF-16 or "
            "UTF-32; JSON must be UTF-8 (re-save it as UTF-8)"
        )
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


def _lone_surrogate(data: Any) -> str | None:
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


def _text(text: str | bytes | bytearray | memoryview) -> str:
    if isinstance(text, (bytes, bytearray, memoryview)):
        return _decode(bytes(text))
    if text.startswith("\ufeff"):
        raise ValueError(
            "the text starts with a byte order mark, which JSON forbids (re-save "
            "it as UTF-8 without a BOM)"
        )
    return text


def _has_surrogate_escape(text: str) -> bool:
    return "\\u" in text and _SURROGATE_ESCAPE.search(text) is not None


def loads(
    text: str | bytes | bytearray | memoryview, *, allow_lone_surrogates: bool = False
) -> Any:
    """Parse ``text``; ``ValueError`` for text that is not UTF-8, invalid, duplicate-keyed,
    non-finite, not valid Unicode or absurdly nested JSON.

    ``allow_lone_surrogates=True`` keeps strings such as ``"\\ud800"`` (for a transport
    between trusted processes that must carry any Python string ``json.dumps`` wrote)."""
    text = _text(text)
    try:
        with gc_paused():
            data = json.loads(
                text,
                object_pairs_hook=_unique_keys,
                parse_constant=_no_constant,
                parse_float=_finite_float,
            )
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not allow_lone_surrogates and _has_surrogate_escape(text):
        bad = _lone_surrogate(data)
        if bad is not None:
            raise _surrogate_error(bad)
    return data


# -- the plain parse: orjson, with no hook, and what proves it lost nothing ---------------------
#
# A hook called for every object (``object_pairs_hook``, to refuse a repeated key) costs a Python
# call per object, the most of a parse of a header or an index of 100,000 tensors. Without it, a
# parser keeps the last of two members with one key; the count of members says whether it did.
# In a text the parser accepted, every ':' either ends an object's key (one per member) or lies
# inside a string, written as itself: an escape can only spell one as ``\\u003a``. So a text
# without a ``\\u`` escape holds ``text.count(":")`` members less the colons of its strings, and
# if the parsed value holds that many (the sum of its objects' sizes), no key was repeated.
#
# The parser is orjson's (Rust): it takes a header of DeepSeek-V3 in about half the time of the
# standard library's C parser (0.07 s of opening its 139 files, 0.12 s at 150k tensors), and it
# refuses what RFC 8259 refuses (NaN, Infinity, numbers that overflow to infinity, lone
# surrogates, control characters). One difference from ``json``: an integer beyond 64 bits
# comes back as a float, so a caller checks the types it needs (every number of a header is an
# int, checked), and anything else goes to the precise parse.


def loads_plain(text: str) -> Any:
    """``text`` parsed at native speed (orjson), checked for nothing more than RFC 8259 asks;
    ``None`` where the text needs the precise parse instead: it holds an escape (a ``\\u``
    one may spell a lone surrogate, or a colon ``members_match`` cannot see), or the parser
    refuses it (the precise parse says why, in its own words), or it is ``null``. An integer
    beyond 64 bits is a float here (see above).

    A caller that gets a value checks what it holds, then ``members_match``; anything that
    fails goes to the precise parse, which refuses it with the reason or accepts it."""
    if "\\" in text:  # (a search for one character: many times faster than for "\\u")
        return None
    try:
        with gc_paused():
            return orjson.loads(text)
    except (orjson.JSONDecodeError, RecursionError):
        return None


def members_match(text: str, members: int, strings: Callable[[], Iterable[str]]) -> bool:
    """Whether ``loads_plain(text)`` kept every member of every object, so no key was
    repeated: ``members`` is the sum of the sizes of every dict it made, ``strings()`` yields
    every string it holds (keys and values; asked for only when the text has more colons
    than ``members``). See the comment above for why the colons tell."""
    colons = text.count(":")
    if colons == members:  # the common case: no string holds a colon
        return True
    return colons - sum(s.count(":") for s in strings()) == members


#: after a member whose value is an object: the one place ``object_pieces`` cuts
_CUT = re.compile(r'\},[ \t\n\r]*"')


def object_pieces(text: str, chars: int) -> Iterator[str]:
    """The text of one large object cut, after about every ``chars`` characters, into the
    texts of objects that hold its members in order, for ``loads_plain`` to parse one at a
    time, so that the parsed JSON of the whole never exists at once. A text of at most
    ``chars`` is its own one piece; a piece may be longer where no cut is found.

    A cut is made after a ``}``, a ``,`` and the ``"`` of what looks like the next key, where
    a member whose value is an object ends. It may be wrong: that ``}`` may lie in a string
    (``"a},"``) or close an object nested deeper. But then the piece it ends does not parse:
    json reads each piece as it would read the whole text from the same place, so a piece
    that parses ends where a member of the outer object ends, and the next one starts where
    the next member does. The caller trusts the pieces only if every one of them parses."""
    start, search, prefix = 0, _CUT.search, ""
    while len(text) - start > chars:
        cut = search(text, start + chars)
        if cut is None:
            break
        yield prefix + text[start : cut.start() + 1] + "}"
        start, prefix = cut.end() - 1, "{"
    yield prefix + text[start:] if start else text


def _surrogate_error(bad: str) -> ValueError:
    return ValueError(
        f"the string {quote(bad)} holds a lone UTF-16 surrogate (a \\ud800-"
        "\\udfff escape without its pair): it is not valid Unicode text"
    )


_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float
)
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, and only it
# from the end of a member's value to just inside the next key's opening quote
_NEXT_KEY = re.compile(r'[ \t\n\r]*,[ \t\n\r]*"')
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")


def _skip_space(text: str, i: int = 0) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    m = _SPACE.match(text, i)
    return m.end() if m else i  # ``*`` matches the empty string too: ``m`` is never None


# json's C scanners: public in the module, but typeshed does not declare them
_SCAN = _DECODER.scan_once  # type: ignore[attr-defined]  # set by JSONDecoder.__init__
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]  # see above
#: a document that is not an object is parsed whole only up to this size, to say what is wrong
#: with it (it may not be JSON at all); a larger one is named by its first character
_NOT_OBJECT_PARSED_CHARS = 1 << 20
_FIRST_CHAR_TYPES = {
    "[": "list",
    '"': "str",
    "t": "bool",
    "f": "bool",
    "n": "NoneType",
    "-": "number",
    **{d: "number" for d in "0123456789"},
}


class NotAnObjectError(TypeError):
    """``loads_object`` was given valid JSON that is not an object; ``type_name`` says what
    it is (``"list"``)."""

    def __init__(self, type_name: str):
        super().__init__(f"must be a JSON object, got {type_name}")
        self.type_name = type_name


def loads_object(
    text: str | bytes | bytearray | memoryview, convert: Callable[[str, Any], Any]
) -> dict[str, Any]:
    """A JSON object parsed one member at a time, each as strictly as ``loads``: every value
    goes to ``convert(key, value)`` as soon as it is parsed, and only what that returns is
    kept, in a dict by key, in the text's order (a key twice is a ``ValueError``).

    For a large object of small members (a safetensors header of a million tensors) the
    parsed JSON of the whole never exists at once: memory is the text plus what ``convert``
    keeps, where ``loads`` would build every member's dicts and lists first (about eight
    times the text). Valid JSON that is not an object is a ``NotAnObjectError``; one over
    1 MiB is named by its first character without being parsed (``loads`` would build it
    whole: a list of empty lists takes 80 bytes for every 3 of text).

    >>> loads_object('{"a": [1, 2], "b": [3]}', lambda key, value: sum(value))
    {'a': 3, 'b': 3}
    """
    text = _text(text)
    i = _skip_space(text)
    if text[i : i + 1] != "{":
        raise _not_object(text, i)
    surrogates = _has_surrogate_escape(text)  # a rare escape: checked member by member only then
    out: dict[str, Any] = {}
    i = _skip_space(text, i + 1)
    first = text[i : i + 1]
    if first == "}":
        return _end(text, i + 1, out)
    if first != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
    # One regular expression before each key and one after it, and json's own C scanner for
    # the strings and values: a million members parse in seconds.
    next_key, colon, scan_key, scan = _NEXT_KEY.match, _COLON.match, _scanstring, _SCAN
    k = i + 1  # just inside the key's opening quote
    try:
        with gc_paused():
            while True:
                key, i = scan_key(text, k, True)
                c = colon(text, i)
                if c is None:
                    raise json.JSONDecodeError(
                        "Expecting ':' delimiter", text, _skip_space(text, i)
                    )
                try:
                    value, i = scan(text, c.end())
                except StopIteration as err:
                    raise json.JSONDecodeError("Expecting value", text, err.value) from None
                if key in out:
                    raise ValueError(f"duplicate key {quote(key)}")
                if surrogates:
                    bad = _lone_surrogate([key, value])
                    if bad is not None:
                        raise _surrogate_error(bad)
                out[key] = convert(key, value)
                m = next_key(text, i)
                if m is None:
                    break
                k = m.end()
    except RecursionError:
        raise ValueError("nested too deeply") from None
    # after the last member: the object's end, or what is wrong instead
    i = _skip_space(text, i)
    if text[i : i + 1] == "}":
        return _end(text, i + 1, out)
    if text[i : i + 1] == ",":
        raise json.JSONDecodeError(
            "Expecting property name enclosed in double quotes", text, _skip_space(text, i + 1)
        )
    raise json.JSONDecodeError("Expecting ',' delimiter", text, i)


def _end(text: str, i: int, out: dict[str, Any]) -> dict[str, Any]:
    i = _skip_space(text, i)
    if i != len(text):
        raise json.JSONDecodeError("Extra data", text, i)
    return out


def _not_object(text: str, i: int) -> NotAnObjectError:
    """The error for a document that is not an object (``ValueError`` if it is not JSON)."""
    if len(text) - i <= _NOT_OBJECT_PARSED_CHARS:
        return NotAnObjectError(type(loads(text)).__name__)
    type_name = _FIRST_CHAR_TYPES.get(text[i : i + 1])
    if type_name is None:
        raise json.JSONDecodeError("Expecting value", text, i)
    return NotAnObjectError(type_name)
