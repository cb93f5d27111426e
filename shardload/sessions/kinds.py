"""Kinds of session, by name: how ``--session thread|process|torch`` (and ``open_session``) makes
one. A new kind is one registered class, not another branch in the CLI.

Each kind is a ``SessionKind``: its name, a line for people (help text, docs), and how to open
one for N workers on a device, with the plugin modules its workers import and the watchdog's
timeout. Opening a session that cannot be made as asked (a device that is not there, torchrun's
variables missing, a torchrun job of another size than N) raises ``SessionError``, one line
saying what to do.

>>> @register_session_kind("mine", "workers of my cluster")              # doctest: +SKIP
... def open_mine(num_workers, *, device, plugins, timeout):
...     return MySession(num_workers, device=device or "cpu", timeout=timeout)
>>> open_session("mine", 4)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import SessionError, Setting
from ..table import Table
from .watchdog import DEFAULT

if TYPE_CHECKING:  # pragma: no cover
    from .base import Session

__all__ = [
    "SessionKind",
    "open_session",
    "register_session_kind",
    "session_kinds",
    "unregister_session_kind",
]

Opener = Callable[..., "Session"]


@dataclass(frozen=True)
class SessionKind:
    name: str
    description: str
    open: Opener
    module: str = ""


def _unknown(name: str, known: list[str]) -> SessionError:
    kinds = ", ".join(sorted(known))
    return SessionError(f"unknown session kind {name!r}; the kinds are {kinds}")


_KINDS: Table[SessionKind] = Table("session kind", _unknown)


def register_session_kind(
    name: str, description: str, opener: Opener | None = None, *, override: bool = False
):
    """Register how to open the session kind ``name``: ``opener(num_workers, *, device,
    plugins, timeout)`` returns an open ``Session``. Usable as a decorator."""

    def register(f: Opener) -> Opener:
        _KINDS.add(SessionKind(name, description, f, getattr(f, "__module__", "") or ""), override)
        return f

    return register if opener is None else register(opener)


def unregister_session_kind(name: str) -> None:
    """Remove the kind ``name`` (tests); nothing happens if it is not there."""
    _KINDS.remove(name)


def session_kinds() -> list[SessionKind]:
    """Every session kind, sorted by name."""
    return _KINDS.entries()


def open_session(
    kind: str,
    num_workers: int,
    *,
    device=None,
    plugins: Iterable[str] = (),
    timeout: float | None = DEFAULT,
    **options: Any,
) -> Session:
    """A session of ``kind`` with ``num_workers`` workers; ``SessionError`` when it cannot be
    made as asked. ``device``: ``"cpu"``, ``"cuda"``, or one per worker (a list, or a
    comma-separated string); the kind's own default when None. ``timeout``: the watchdog (left
    out: the default, ``DEFAULT_TIMEOUT_S``; None: none). ``options``: what a kind takes
    beside (``torch``: ``group``, a process group of a running job, such as an engine's
    tensor-parallel group)."""
    if isinstance(device, str) and "," in device:
        device = device.split(",")
    opener = _KINDS.get(kind).open
    try:
        session = opener(
            num_workers, device=device, plugins=tuple(plugins), timeout=timeout, **options
        )
    except TypeError as exc:  # an option this kind does not take
        if not options or "unexpected keyword" not in str(exc):
            raise
        raise SessionError(
            f"a {kind} session takes no option {', '.join(sorted(options))}"
        ) from None
    except ValueError as exc:  # a device spec or a worker count the session refused
        if isinstance(exc, SessionError):
            raise
        raise SessionError(str(exc), settings=getattr(exc, "settings", ())) from None
    if session.num_workers != num_workers:
        session.close()
        asked = Setting(f"num_workers={num_workers}", f"--shards {num_workers}")
        raise SessionError(
            f"{asked.python} but this {kind} session has {session.num_workers} "
            "workers (a torchrun job has one per rank); they must be equal",
            settings=(asked,),
        )
    return session


@register_session_kind("thread", "threads of this process, the fastest on one host")
def _open_threads(num_workers: int, *, device, plugins, timeout) -> Session:
    from ..modules import import_modules
    from .threaded import ThreadedSession

    import_modules(plugins, "plugin")  # the workers share this process: its plugins are theirs
    return ThreadedSession(num_workers, device=device or "cpu", timeout=timeout)


@register_session_kind(
    "process",
    "worker processes of this machine, driven over pipes, so "
    "that a shard function that crashes one is an error naming it",
)
def _open_processes(num_workers: int, *, device, plugins, timeout) -> Session:
    from .process import ProcessSession

    return ProcessSession(num_workers, device=device or "cpu", plugins=plugins, timeout=timeout)


@register_session_kind(
    "torch", "the ranks of a torchrun job, one worker each, on one machine or many"
)
def _open_torchrun(num_workers: int, *, device, plugins, timeout, group=None) -> Session:
    from ..modules import import_modules
    from .torchdist import TorchDistributedSession, missing_env

    missing = missing_env() if group is None else []
    if missing:
        raise SessionError(
            f"a torch session runs under torchrun, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: start it as "
            f"`torchrun --nproc-per-node {num_workers} ...`, or use a thread or "
            "process session"
        )
    import_modules(plugins, "plugin")
    return TorchDistributedSession(device=device, timeout=timeout, group=group)
