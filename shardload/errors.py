"""The exception tree. Every error shardload raises on purpose is a ``ShardloadError``.

The CLI maps the classes to exit codes (see ``cli.py``): checkpoint and plan problems are the
user's input (exit 2), worker failures are load failures (exit 1).

This module imports nothing heavy, so ``shardload --help`` stays fast.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "FormatError",
    "PlanError",
    "SessionClosedError",
    "SessionError",
    "Setting",
    "ShardloadError",
    "Stopped",
    "StorageError",
    "UnknownSessionFunctionError",
    "UnknownShardFunctionError",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerFailure",
    "WorkingShards",
    "cli_text",
    "mention",
    "quote",
]

#: longest excerpt of an input value an error message repeats
QUOTE_LIMIT = 120
#: longest name UnknownShardFunctionError looks for close matches of
_MATCH_LIMIT = 256


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to about ``limit`` characters: a 50 MB parameter name from a hostile
    plan must not be echoed back whole.

    >>> quote("w" * 300, 20)
    "'wwwwwwwwwwwwwwwwwww... (300 characters)"
    """
    if isinstance(value, str):
        text = repr(value[:limit])  # never repr() a huge string just to cut it
        if len(value) <= limit and len(text) <= limit + 2:
            return text
        return f"{text[:limit]}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _located(message: str, *where: object) -> str:
    """``"file: parameter 'x': step 2: message"``, leaving out the parts that are None."""
    parts = [str(w) for w in where if w is not None]
    return ": ".join([*parts, message])


@dataclass(frozen=True)
class Setting:
    """A setting an error message tells the user to change, as the Python API says it and as
    the command line does. The core writes ``python`` into its messages and records the
    setting with ``mention``; the CLI shows ``cli`` in its place (``cli_text``), so no core
    message names a command-line flag.

    >>> str(mention(ShardloadError(f"load with {DEVICE_CUDA.python}"), DEVICE_CUDA))
    "load with device='cuda'"
    >>> cli_text(mention(ShardloadError(f"load with {DEVICE_CUDA.python}"), DEVICE_CUDA))
    'load with --device cuda'
    """

    python: str
    cli: str


def mention(exc: BaseException, *settings: Setting) -> BaseException:
    """Record that ``exc``'s message names ``settings`` (in their Python form); returns ``exc``."""
    # any exception may carry them (an OSError the CLI words for the user), not only ours
    exc.settings = (*getattr(exc, "settings", ()), *settings)  # type: ignore[attr-defined]
    return exc


def cli_text(exc: BaseException) -> str:
    """``str(exc)`` with each setting it mentions said the way the command line says it."""
    text = str(exc)
    for setting in getattr(exc, "settings", ()):
        text = text.replace(setting.python, setting.cli)
    return text


DEVICE_CUDA = Setting("device='cuda'", "--device cuda")
DEVICE_CPU = Setting("device='cpu'", "--device cpu")
PLUGINS = Setting("plugins=[MODULE, ...]", "--plugin MODULE")
LIST_FUNCS = Setting("list_shard_funcs() lists", "`shardload funcs` lists")
#: a plan file given explicitly (``load_sharded(params, shard_info=FILE, ...)``)
SHARD_INFO = Setting("shard_info=FILE", "--shard-info FILE")
#: every tensor whole on every worker, chosen explicitly
REPLICATE = Setting("shard_info=shardload.REPLICATE", "--replicate")
EXPERTS_EP = Setting("experts='ep'", "--experts ep")
EXPERTS_TP = Setting("experts='tp'", "--experts tp")


class ShardloadError(Exception):
    """Root of every error shardload raises on purpose."""


class WorkingShards(Protocol):
    """The N a plan works for, as a refusal carries them (``plan.ValidNumShards``)."""

    def describe(self) -> str:
        """``N that work (up to 64): 1, 2, 4``, or why they are not known."""
        ...


class PlanError(ShardloadError):
    """A ``shard_info.json`` plan is malformed or does not fit the checkpoint.

    ``source`` is the plan file (or ``None`` for an in-memory plan), ``param`` the parameter and
    ``step`` the 0-based step index the problem is in, where they apply. A refusal of one N
    carries the N that do work as data (``working``, else None) beside ``constraint``, what is
    wrong without them; ``reason`` says both, as the message does:

    >>> from shardload.plan import ValidNumShards
    >>> err = PlanError("9 heads do not divide by 2", working=ValidNumShards([1, 3], tried=64))
    >>> err.constraint, list(err.working)
    ('9 heads do not divide by 2', [1, 3])
    >>> err.reason
    '9 heads do not divide by 2. N that work (up to 64): 1, 3'
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        param: str | None = None,
        step: int | None = None,
        working: WorkingShards | None = None,
    ):
        self.source = source
        self.param = param
        self.step = step
        self.constraint = message
        self.working = working
        self.reason = message if working is None else f"{message}. {working.describe()}"
        super().__init__(
            _located(
                self.reason,
                source,
                param and f"parameter {quote(param)}",
                None if step is None else f"step {step}",
            )
        )


def _suggest(name: object, known: Iterable[str]) -> list[str]:
    # difflib is quadratic in the name's length: a 100k-character name is no typo
    if not isinstance(name, str) or len(name) > _MATCH_LIMIT:
        return []
    return difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)


def _did_you_mean(suggestions: Sequence[str]) -> str:
    return f" Did you mean {', '.join(quote(s) for s in suggestions)}?" if suggestions else ""


class UnknownShardFunctionError(PlanError, KeyError):
    """A plan (or ``get_shard_func``) names a shard function that is not registered.

    Also a ``KeyError``, as a failed registry lookup is. ``suggestions`` holds close matches.
    """

    def __init__(
        self,
        name: str,
        known: Iterable[str],
        *,
        source: str | None = None,
        param: str | None = None,
        step: int | None = None,
    ):
        self.name = name
        self.suggestions = _suggest(name, known)
        message = (
            f"unknown shard function {quote(name)}.{_did_you_mean(self.suggestions)} "
            "Functions are never imported by name: register it with "
            f"@register_shard_func in a module you pass as a plugin ({PLUGINS.python}) "
            "or through the 'shardload.shard_functions' entry point group; "
            "list_shard_funcs() lists the shard functions."
        )
        PlanError.__init__(self, message, source=source, param=param, step=step)
        mention(self, PLUGINS, LIST_FUNCS)

    # KeyError.__str__ would repr() the message; keep the readable one.
    __str__ = Exception.__str__


class UnknownSessionFunctionError(ShardloadError, KeyError):
    """``session.call`` (or ``get_session_func``) names a session function that is not
    registered. Also a ``KeyError``; ``suggestions`` holds close matches."""

    def __init__(self, name: str, known: Iterable[str]):
        self.name = name
        self.suggestions = _suggest(name, known)
        super().__init__(
            f"unknown session function {quote(name)}."
            f"{_did_you_mean(self.suggestions)} Register it with "
            "@register_session_func in a module the workers import (a module of "
            f"its own, passed as a plugin: {PLUGINS.python})."
        )
        mention(self, PLUGINS)

    __str__ = Exception.__str__


class SessionClosedError(ShardloadError, RuntimeError):
    """A session that is closed was asked to run something, or for a piece its worker processes
    held. Also a ``RuntimeError``, as a closed session raised before this class.

    ``session`` is the kind of session (its class name); ``worker`` and ``param`` the piece
    asked for (``ShardedParams.shard``), or None.
    """

    def __init__(self, session: str, *, worker: int | None = None, param: str | None = None):
        self.session = session
        self.worker = worker
        self.param = param
        if worker is None:
            message = (
                f"this {session} is closed (by close() or its with block ending, or by "
                "itself after a crash, Ctrl-C or a timeout), so it runs nothing more; "
                "open a new session to go on"
            )
        else:
            message = (
                f"worker {worker}'s piece of {quote(param)} was asked for, but the "
                f"{session} is closed: a worker process's pieces live in that process "
                "and went with it. Fetch or copy what you need (sharded.shard(name, "
                "worker), sharded.worker(worker)) before closing the session."
            )
        super().__init__(message)


class SessionError(ShardloadError, ValueError):
    """A session cannot be opened as asked: a device that is not there, torchrun's variables
    missing, a torchrun job of another size than the workers asked for, a kind nobody
    registered. Also a ``ValueError``, as a bad device spec raised before this class. The CLI
    answers it as bad usage (exit 2)."""

    def __init__(self, message: str, *, settings=()):
        super().__init__(message)
        mention(self, *settings)


class FormatError(ShardloadError):
    """A checkpoint file is malformed: truncated, a header that lies, a bad index.

    ``file`` names the file and ``tensor`` the tensor, where one is concerned.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = None if file is None else str(file)
        self.tensor = tensor
        self.reason = message
        super().__init__(_located(message, self.file, tensor and f"tensor {quote(tensor)}"))


def _url_text(url: object) -> str:
    """A URL as an error message leads with it: as written when it is a printable string of
    sane length (real checkpoint URLs are), else quoted and cut, as a hostile name would be."""
    limit = 3 * QUOTE_LIMIT
    if isinstance(url, str) and url.isprintable() and 0 < len(url) <= limit:
        return url
    return quote(url, limit)


class StorageError(ShardloadError):
    """Object storage (``s3://``, ``gs://``, ``az://``) could not give the bytes asked for.

    ``url`` is the object or folder, ``byte_range`` the ``(begin, end)`` bytes a ranged read
    was after (or None), and ``usage`` says whose move it is: True when the user must change
    something (a bad URL, a missing bucket or key, access denied, no or refused credentials,
    obstore not installed, a process forked after reading objects), False for transport
    failures (an endpoint that does not answer, retries exhausted). The message is one line,
    ``"<url>: <what happened>; <what to do>"``,
    built from error codes, never from a server's raw text, so it never carries a credential.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        byte_range: tuple[int, int] | None = None,
        usage: bool = False,
    ):
        self.url = url
        self.byte_range = None if byte_range is None else (int(byte_range[0]), int(byte_range[1]))
        self.usage = bool(usage)
        self.reason = message
        super().__init__(
            _located(
                message,
                _url_text(url),
                self.byte_range and f"bytes [{self.byte_range[0]}, {self.byte_range[1]})",
            )
        )


def annotate(exc: BaseException, where: str) -> None:
    """Record where ``exc`` happened (the parameter and step), for the worker's failure report.

    The exception itself is re-raised unchanged, so callers see the original type.
    """
    if not getattr(exc, "_shardload_where", None):
        exc._shardload_where = where  # type: ignore[attr-defined]


def describe(exc: BaseException) -> str:
    """``exc``'s message, prefixed with where it happened when that was recorded."""
    where = getattr(exc, "_shardload_where", None)
    return f"{where}: {exc}" if where else str(exc)


@dataclass(frozen=True)
class WorkerFailure:
    """One worker's failure: its index, the exception's type name, message and traceback."""

    worker: int
    exc_type: str
    message: str
    traceback: str = ""


class WorkerError(ShardloadError):
    """One or more workers raised. ``failures`` lists them, the earliest failure first."""

    def __init__(self, failures: Sequence[WorkerFailure], context: str = ""):
        if not failures:
            raise ValueError("WorkerError needs at least one failure")
        self.failures = tuple(failures)
        first = self.failures[0]
        others = len(self.failures) - 1
        more = f" (and {others} more worker{'s' if others > 1 else ''} failed)" if others else ""
        ctx = f" {context}" if context else ""
        super().__init__(
            f"worker {first.worker} failed{ctx}: {first.exc_type}: {first.message}{more}"
        )

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(f.worker for f in self.failures)

    @property
    def traceback(self) -> str:
        """The remote traceback of the earliest failure."""
        return self.failures[0].traceback


class Stopped(ShardloadError):
    """Raised by a worker function that stops because ``ctx.should_stop()`` said so (another
    worker failed, or the run was interrupted): the session reports the failure that caused it,
    not this."""


class WorkerCrashedError(ShardloadError):
    """A worker process died (exit code or signal) instead of answering."""

    def __init__(
        self,
        worker: int,
        *,
        exitcode: int | None = None,
        signal_name: str | None = None,
        context: str = "",
    ):
        self.worker = worker
        self.exitcode = exitcode
        self.signal_name = signal_name
        how = (
            f"was killed by {signal_name}"
            if signal_name
            else f"exited with code {exitcode}"
            if exitcode is not None
            else "died"
        )
        ctx = f" {context}" if context else ""
        super().__init__(f"worker {worker} {how}{ctx}")
