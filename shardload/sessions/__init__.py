"""Sessions host N workers and move messages; they know nothing of plans or formats."""

from .base import Session, resolve_devices
from .threaded import ThreadedSession

__all__ = ["Session", "ThreadedSession", "resolve_devices"]
