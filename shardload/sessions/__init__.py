"""Sessions host N workers and move messages; they know nothing of plans or formats.

``ThreadedSession`` (threads in this process), ``ProcessSession`` (worker processes driven over
pipes) and ``TorchDistributedSession`` (the ranks of a torch.distributed job) share one API.
"""

from .base import Session, WorkerContext, resolve_devices
from .process import ProcessSession
from .threaded import ThreadedSession
from .torchdist import TorchDistributedSession

__all__ = ["Session", "WorkerContext", "ThreadedSession", "ProcessSession",
           "TorchDistributedSession", "resolve_devices"]
