"""Sessions host N workers and move messages; they know nothing of plans, formats or loading.

``ThreadedSession`` (threads in this process), ``ProcessSession`` (worker processes driven over
pipes) and ``TorchDistributedSession`` (the ranks of a torch.distributed job) share one API:
``run`` a registered session function on every worker with per-worker arguments, ``call``,
``set_value`` / ``get_value``, ``collective``, and each supplies its workers' collectives
(``ctx.group``: ``groups.py``). The loader drives every load through it. Kinds of session are
opened by name (``kinds.py``: ``open_session("process", 4)``).

Names are imported lazily, so that the table of session kinds (the CLI's ``--session``
choices) is read without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..modules import lazy_names

# public name -> module that defines it
_LAZY = {
    "Session": "base",
    "Stopped": "base",
    "WorkerContext": "base",
    "resolve_devices": "base",
    "SessionFunc": "functions",
    "get_session_func": "functions",
    "list_session_funcs": "functions",
    "register_session_func": "functions",
    "unregister_session_func": "functions",
    "ProcessSession": "process",
    "ThreadedSession": "threaded",
    "TorchDistributedSession": "torchdist",
    "SessionKind": "kinds",
    "register_session_kind": "kinds",
    "session_kinds": "kinds",
    "open_session": "kinds",
    "Group": "groups",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)


if TYPE_CHECKING:  # pragma: no cover
    from .base import Session, Stopped, WorkerContext, resolve_devices
    from .functions import (
        SessionFunc,
        get_session_func,
        list_session_funcs,
        register_session_func,
        unregister_session_func,
    )
    from .groups import Group
    from .kinds import SessionKind, open_session, register_session_kind, session_kinds
    from .process import ProcessSession
    from .threaded import ThreadedSession
    from .torchdist import TorchDistributedSession
