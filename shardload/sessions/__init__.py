"""Sessions host N workers and move messages; they know nothing of plans, formats or loading.

``ThreadedSession`` (threads in this process), ``ProcessSession`` (worker processes driven over
pipes) and ``TorchDistributedSession`` (the ranks of a torch.distributed job) share one API:
``run`` a registered session function on every worker with per-worker arguments, ``call``,
``set_value`` / ``get_value``, ``collective``. The loader drives every load through it.
"""

from .base import Session, Stopped, WorkerContext, resolve_devices
from .functions import (SessionFunc, get_session_func, list_session_funcs,
                        register_session_func, unregister_session_func)
from .process import ProcessSession
from .threaded import ThreadedSession
from .torchdist import TorchDistributedSession

__all__ = ["Session", "Stopped", "WorkerContext", "ThreadedSession", "ProcessSession",
           "TorchDistributedSession", "resolve_devices", "SessionFunc", "register_session_func",
           "get_session_func", "list_session_funcs", "unregister_session_func"]
