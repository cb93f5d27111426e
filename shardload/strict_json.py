"""JSON as shardload reads it from files it does not trust (plans, headers, indexes).

Stricter than ``json.loads`` in three ways, each a ``ValueError`` with a readable reason:
a key repeated in one object (``json`` silently keeps the last one, so one name could mean two
things), the non-standard ``NaN`` / ``Infinity`` literals, and nesting so deep that the parser
would hit the recursion limit.

>>> loads('{"a": 1}')
{'a': 1}
"""

from __future__ import annotations

import json
from typing import Any, Union


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(text: Union[str, bytes]) -> Any:
    """Parse ``text``; ``ValueError`` for invalid, duplicate-keyed, NaN or absurdly nested JSON."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from None
