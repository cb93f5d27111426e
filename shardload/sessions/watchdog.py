"""The watchdog's settings: how long a worker may go without progress before its session gives
up on it, by default and as given. Torch-free, so that the CLI's help can name them without
importing torch."""

from __future__ import annotations

import math
from typing import Any

from ..envvars import env_number

__all__ = [
    "DEFAULT",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "check_timeout",
    "default_timeout",
    "session_timeout",
]

#: an argument left out (``timeout=DEFAULT``: the default watchdog, or the session's)
DEFAULT: Any = object()

#: The default watchdog: seconds a worker may go without progress before the session gives
#: up on it. Progress is a piece done, 64 MiB of a long copy, a call answered, or a turn
#: waited for, so the slowest legitimate silence is one shard function's run on one tensor
#: (a custom chain over a multi-GB tensor on a slow CPU: minutes); ten minutes is NCCL's own
#: default. ``SHARDLOAD_TIMEOUT`` (seconds; ``0`` or ``off``: none) changes it for a process.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "SHARDLOAD_TIMEOUT"
#: the least watchdog ``$SHARDLOAD_TIMEOUT`` may set (any positive number would do; a float
#: range needs a bound)
_SMALLEST_S = 1e-3


def default_timeout() -> float | None:
    """The watchdog a session gets when it is given none: ``$SHARDLOAD_TIMEOUT`` if set (``0``
    or ``off``: no watchdog), else ``DEFAULT_TIMEOUT_S``.

    >>> default_timeout()                                    # doctest: +SKIP
    600.0
    """
    seconds = env_number(
        TIMEOUT_ENV,
        DEFAULT_TIMEOUT_S,
        parse=float,
        low=_SMALLEST_S,
        high=math.inf,
        what="a number of seconds",
        off=("0", "off", "none"),
    )
    return check_timeout(seconds)  # refuses inf too


def session_timeout(timeout: Any) -> float | None:
    """A session's watchdog from its ``timeout`` argument: left out (``DEFAULT``), the default
    watchdog (``default_timeout``); ``None``, none; else positive seconds."""
    return default_timeout() if timeout is DEFAULT else check_timeout(timeout)


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as a float of seconds, or ``None`` (no watchdog); ``ValueError`` otherwise.

    >>> check_timeout(2)
    2.0
    """
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)
