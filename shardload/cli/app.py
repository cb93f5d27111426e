"""The ``shardload`` group: shardload's exception tree mapped to exit codes (``codes``), output
that fails where it can be reported, ``--json`` errors, Ctrl-C. The commands, one module each,
are registered in ``shardload/cli/__init__.py``.

Every failure is one line on stderr, never a traceback; under a command's ``--json``, one JSON
object. Output is flushed as it is written, so a full disk or a closed pipe is found where it
can be reported. Library modules are imported inside the commands so that ``shardload --help``
never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import click

from ..errors import (
    FormatError,
    PlanError,
    SessionError,
    ShardloadError,
    StorageError,
    cli_text,
    quote,
)
from . import interrupts
from .codes import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_LOAD_FAILED, EXIT_OK

#: ``ctx.meta`` key: the command's ``--json`` was given (errors are then one JSON object)
JSON_KEY = "shardload.json"


class _Failure(click.ClickException):
    """A failure the CLI reports in one line; ``kind`` names what failed (the class of the
    error it stands for), for ``--json``'s error object."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind or type(self).__name__


class LoadFailed(_Failure):
    exit_code = EXIT_LOAD_FAILED


class BadInput(_Failure):
    exit_code = EXIT_BAD_INPUT


class OutputFailed(click.ClickException):
    """The command's output could not be written (a full disk, a closed pipe, no permission).

    ``broken_pipe``: standard output was closed by its reader (``| head -1``): not an error to
    report, the reader has what it wanted."""

    exit_code = EXIT_LOAD_FAILED

    def __init__(self, exc: OSError, target: str):
        self.stdout = target == "standard output"
        self.broken_pipe = self.stdout and exc.errno == errno.EPIPE
        super().__init__(f"cannot write {target}: {exc.strerror or exc}")


def _usage_line(exc: click.UsageError) -> str:
    """A usage error as one line in the voice of the others: what is wrong, where, and where
    the command's options are listed (click would print its usage banner over four lines).

    ``Error: --shards: 0 is not a number of workers; ... (see 'shardload load --help')``
    """
    where = None
    if isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter):
        param = exc.param
        if isinstance(param, click.Option) and param.opts:
            where = param.opts[0]
        elif param is not None:
            where = param.human_readable_name
        elif isinstance(exc.param_hint, str):
            where = exc.param_hint.strip("'\"")
    message = f"{where}: {exc.message}" if where else exc.format_message()
    message = message.strip().rstrip(".")
    if message[:1].isupper() and message[1:2].islower():  # "No such option" -> "no such option"
        message = message[0].lower() + message[1:]
    names: list[str] = []
    ctx = exc.ctx
    while ctx is not None and ctx.parent is not None:  # the command's, under any program name
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return f"{message} (see '{' '.join(['shardload', *reversed(names)])} --help')"


def _show(exc: click.ClickException, as_json: bool) -> None:
    """Print ``exc`` on stderr: one line, or, under ``--json``, one JSON object ``{"error":
    {"type", "message", "exit_code"}}`` (standard output stays for results)."""
    message = _usage_line(exc) if isinstance(exc, click.UsageError) else exc.format_message()
    with contextlib.suppress(OSError, ValueError):
        if not as_json:
            click.echo(f"Error: {message}", err=True)
            return
        kind = getattr(exc, "kind", None) or type(exc).__name__
        click.echo(
            json.dumps({"error": {"type": kind, "message": message, "exit_code": exc.exit_code}}),
            err=True,
        )


def _os_message(exc: OSError) -> str:
    """``"cannot read 'x': Permission denied"``: one line, the path quoted (and cut)."""
    where = f" {quote(os.fsdecode(exc.filename))}" if exc.filename is not None else ""
    return f"cannot read{where}: {exc.strerror or exc}"


#: errors opening an input that are the input's fault (exit 2); any other is a failure (exit 1)
_BAD_INPUT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ELOOP,
    errno.ENAMETOOLONG,
    errno.ENXIO,
}


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """Opening the user's inputs: an ``OSError`` (permission denied, a directory where a file
    belongs, a path that vanished) is bad input, exit 2, naming the path."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _BAD_INPUT_ERRNOS:
            raise BadInput(_os_message(exc)) from None
        raise LoadFailed(_os_message(exc)) from None  # EIO, EMFILE, ENOMEM: not the input's fault


def out(text: str = "", nl: bool = True) -> None:
    """Write a result to standard output, flushed now: a full disk or a closed pipe is found
    here, where it can be reported, rather than at exit, where it would be a traceback."""
    try:
        click.echo(text, nl=nl)
        sys.stdout.flush()
    except OSError as exc:
        raise OutputFailed(exc, "standard output") from None


def out_joined(pieces: Iterable[str], sep: str) -> None:
    """``out(sep.join(pieces), nl=False)``, a few thousand pieces at a time."""
    pieces, first = iter(pieces), True
    while chunk := list(itertools.islice(pieces, 4096)):
        out(("" if first else sep) + sep.join(chunk), nl=False)
        first = False


def note(text: str) -> None:
    """Commentary for the user on stderr (never a result); nothing more can be done if even
    that fails."""
    with contextlib.suppress(OSError, ValueError):
        click.echo(text, err=True)


def _silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so the interpreter's flush at exit does not fail
    again (and print a traceback) on output we already know cannot be written."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


#: True when ``main()`` runs: the process is the CLI's own (not a test calling ``cli.main``)
_OWN_PROCESS = False


def _exit(code: int) -> None:
    """End the CLI with ``code``. When a worker thread is still stuck in a shard function
    (after Ctrl-C or a timeout) and the process is the CLI's own, end it at once: the thread
    cannot be stopped, and finalising the interpreter under a running thread is not safe."""
    threaded = sys.modules.get("shardload.sessions.threaded")
    if _OWN_PROCESS and threaded is not None and threaded.abandoned_threads():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)


# ---- --json -------------------------------------------------------------------------------------


def _remember_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    # ctx.meta is shared by the whole chain of contexts: the group reads it back
    ctx.meta[JSON_KEY] = bool(value)
    return value


def json_option(help: str):
    """``--json``: the command prints JSON, and its errors are one JSON object on stderr.
    Eager, so it is recorded before any other option's check can fail."""
    return click.option(
        "--json", "as_json", is_flag=True, is_eager=True, callback=_remember_json, help=help
    )


class Command(click.Command):
    """A shardload command: under its ``--json``, even a usage error (an unknown option, a bad
    value) is reported as JSON."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.UsageError:
            if not ctx.resilient_parsing:
                ctx.meta[JSON_KEY] = self._asks_json(ctx, given)
            raise

    def _asks_json(self, ctx: click.Context, args: list[str]) -> bool:
        """Whether ``args`` give this command's ``--json``: parsed again as click parses for
        completion (errors passed over, unknown options kept aside)."""
        if not any(p.name == "as_json" for p in self.params):
            return False
        with contextlib.suppress(Exception):
            again = self.make_context(
                ctx.info_name,
                args,
                parent=ctx.parent,
                resilient_parsing=True,
                ignore_unknown_options=True,
            )
            return bool(again.params.get("as_json"))
        return False


# ---- the group ----------------------------------------------------------------------------------


class Group(click.Group):
    """Maps shardload's exception tree to exit codes; Ctrl-C is one line and exit 130.

    A message printed here says each setting it mentions the way the command line does
    (``errors.cli_text``: ``device='cuda'`` becomes ``--device cuda``): the core's messages
    name the Python API, never a flag."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return self._invoke_mapped(ctx)
        except click.ClickException as exc:
            # read by main(), which shows it: the flag travels with the exception, which
            # click's class does not declare
            exc.as_json = bool(ctx.meta.get(JSON_KEY))  # type: ignore[attr-defined]
            raise

    def _invoke_mapped(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (PlanError, FormatError, SessionError) as exc:
            raise BadInput(cli_text(exc), type(exc).__name__) from None
        except StorageError as exc:  # the user's move (a path, credentials) or the network's
            raise (BadInput if exc.usage else LoadFailed)(str(exc), "StorageError") from None
        except ShardloadError as exc:
            raise LoadFailed(cli_text(exc), type(exc).__name__) from None
        except ImportError as exc:  # a --plugin module that does not import
            raise BadInput(str(exc), "ImportError") from None
        except OSError as exc:  # the last net: one line, not a traceback
            where = f"{quote(os.fsdecode(exc.filename))}: " if exc.filename is not None else ""
            raise LoadFailed(f"{where}{exc.strerror or exc}", type(exc).__name__) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if standalone_mode:
                try:
                    sys.stdout.flush()  # buffered output must fail here, not at exit
                except OSError as exc:
                    raise OutputFailed(exc, "standard output") from None
        except click.exceptions.Abort:
            if not standalone_mode:
                raise
            note("Interrupted.")
            _exit(EXIT_INTERRUPTED)
        except OutputFailed as exc:
            if not standalone_mode:
                raise
            if exc.stdout and _OWN_PROCESS:
                _silence_stdout()
            if exc.broken_pipe:
                _exit(EXIT_BROKEN_PIPE)  # the reader has gone: say nothing
            _show(exc, getattr(exc, "as_json", False))
            _exit(exc.exit_code)
        except click.ClickException as exc:
            if not standalone_mode:
                raise
            _show(exc, getattr(exc, "as_json", False))
            _exit(exc.exit_code)
        if standalone_mode:
            _exit(rv if isinstance(rv, int) else EXIT_OK)
        return rv


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardload")
def cli() -> None:
    """Load already-quantized checkpoints onto N tensor-parallel workers, sharded at load time.

    \b
      shardload load --shards 4 examples/tiny_llama_q4
      shardload plan --shards 3 model.gguf -o shard_info.json
      shardload validate --shards 8 CKPT
      shardload inspect --shards 3 CKPT
      shardload run --shards 3 model.gguf --prompt "What is the capital of France?"
      shardload vllm-overrides --shards 4 CKPT
      shardload funcs

    Exit codes: 0 ok, 1 load or output failure, 2 bad usage, plan or checkpoint,
    130 interrupted, 141 standard output closed by its reader (quietly).
    """


def main() -> None:
    """Console-script entry point (also ``python -m shardload``)."""
    import faulthandler

    global _OWN_PROCESS
    _OWN_PROCESS = True
    interrupts.exit_at_once()  # until a command starts work: see interrupts
    # A shard function that segfaults a thread session takes the process with it; this at least
    # prints the Python stack of the crashing thread (the shard function's file, line and name).
    with contextlib.suppress(Exception):
        faulthandler.enable(all_threads=False)
    cli.main(prog_name="shardload")
