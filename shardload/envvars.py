"""Settings read from environment variables, each checked in one place with one wording.

A variable unset or blank means the default; anything else must parse and lie in range, or the
``ValueError`` names the variable, what it holds, what it should hold and how to get the
default back.

>>> env_number("SHARDLOAD_X", 8, parse=int, low=1, high=64, what="a whole number", environ={})
8
>>> env_number("SHARDLOAD_X", 8, parse=int, low=1, high=64, what="a whole number",
...            environ={"SHARDLOAD_X": "0"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: SHARDLOAD_X='0' is not a whole number from 1 to 64; set one, or unset it for the ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

__all__ = ["env_choice", "env_number"]

T = TypeVar("T", int, float)
D = TypeVar("D")


def _text(name: str, environ: Mapping[str, str] | None) -> str:
    return ((os.environ if environ is None else environ).get(name) or "").strip()


def env_number(
    name: str,
    default: D,
    *,
    parse: Callable[[str], T],
    low: float,
    high: float,
    what: str,
    off: Collection[str] = (),
    environ: Mapping[str, str] | None = None,
) -> T | D | None:
    """``$name`` parsed with ``parse`` and checked to lie in ``[low, high]``; ``default`` where
    it is unset or blank; None where it is one of ``off`` (compared in lower case), for a
    setting that can be turned off."""
    text = _text(name, environ)
    if not text:
        return default
    if text.lower() in off:
        return None
    try:
        value: T | None = parse(text)
    except ValueError:
        value = None
    # NaN compares false both ways, so it is refused here too
    if value is None or not low <= value <= high:
        turn_off = f", {' or '.join(sorted(off))} for none" if off else ""
        span = f"of at least {low:g}" if high == float("inf") else f"from {low:g} to {high:g}"
        raise ValueError(
            f"{name}={text!r} is not {what} {span}; set one{turn_off}, or "
            f"unset it for the default ({default})"
        )
    return value


def env_choice(
    name: str, default: str, choices: Collection[str], *, environ: Mapping[str, str] | None = None
) -> str:
    """``$name`` where it is one of ``choices``; ``default`` where it is unset or blank."""
    text = _text(name, environ)
    if not text:
        return default
    if text not in choices:
        raise ValueError(
            f"{name}={text!r} is not one of {', '.join(map(repr, choices))}; set one, or "
            f"unset it for the default ({default!r})"
        )
    return text
