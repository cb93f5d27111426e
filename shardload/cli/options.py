"""What several commands take (``--shards``, the plan options, ``--session``, CKPT) and the
two things they start from: the validated plan of a checkpoint, and a session.

Both call ``interrupts.work_starts()`` first: from there on something may need closing, so
Ctrl-C takes the orderly path.
"""

from __future__ import annotations

from typing import Any

import click

from ..errors import SessionError, cli_text
from ..limits import MAX_NUM_SHARDS, num_shards_problem
from . import interrupts
from .app import BadInput, note, reading


class NumShards(click.ParamType):
    """A number of workers, 1 to ``MAX_NUM_SHARDS`` (``--shards 100000`` is a typo, not 100,000
    threads); anything else is answered with what ``--shards`` takes."""

    name = "integer"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            number = int(value)
        except (TypeError, ValueError):  # not a whole number (or too many digits to read)
            number = None
        if number is None or num_shards_problem(number) is not None:
            self.fail(
                f"{value!r} is not a number of workers; give a whole number from 1 to "
                f"{MAX_NUM_SHARDS} (e.g. --shards 4)",
                param,
                ctx,
            )
        return number


def shards_option(f):
    return click.option(
        "--shards",
        "-n",
        "num_shards",
        type=NumShards(),
        required=True,
        help=f"Number of workers (tensor-parallel ranks), at most {MAX_NUM_SHARDS}.",
    )(f)


_EXPERTS_HELP = (
    "Routed experts of a mixture-of-experts model: tp splits every expert "
    "across the workers; ep gives each worker whole experts (expert parallelism: "
    "a worker reads only its experts' bytes), assigned evenly and recorded in the "
    "plan. Default: tp."
)


def experts_option(f):
    return click.option(
        "--experts",
        type=click.Choice(["tp", "ep"]),
        default="tp",
        show_default=False,
        help=_EXPERTS_HELP,
    )(f)


def session_option(f):
    """``--session KIND``: a kind from the table of session kinds (``sessions.kinds``), checked
    when the session is opened, so that a kind a --plugin module registers is one too."""
    from ..sessions.kinds import session_kinds

    described = "; ".join(f"{k.name}: {k.description}" for k in session_kinds())
    return click.option(
        "--session",
        "session_kind",
        metavar="KIND",
        default="thread",
        show_default=True,
        help=f"Where workers run ({described}; or a kind a --plugin module registers).",
    )(f)


def plan_options(f):
    f = experts_option(f)
    f = click.option(
        "--plugin",
        "plugins",
        multiple=True,
        metavar="MODULE",
        help="Import MODULE first, so the shard functions it registers exist "
        "(it must be importable: on sys.path or PYTHONPATH). Repeatable.",
    )(f)
    f = click.option(
        "--replicate", is_flag=True, help="Give every worker every tensor whole (no plan)."
    )(f)
    f = click.option(
        "--shard-info",
        "shard_info",
        type=click.Path(dir_okay=False),
        help="The plan file. Default: CKPT/shard_info.json, or, without one, a "
        "plan made from the model's config (see `shardload plan`).",
    )(f)
    return f


class _CheckpointPath(click.Path):
    """A local path that must exist, or an object storage URL (``s3://``, ``gs://`` or
    ``az://bucket/folder/``), checked when it is opened."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from ..sources import is_object_url

        if is_object_url(value):
            return value
        return super().convert(value, param, ctx)


ckpt_argument = click.argument("ckpt", type=_CheckpointPath(exists=True))


def load_plugins(plugins: tuple[str, ...]) -> None:
    from ..registry import load_plugins

    load_plugins(plugins)


def prepare(
    ckpt: str,
    shard_info: str | None,
    plugins: tuple[str, ...],
    num_shards: int,
    experts: str = "tp",
    replicate: bool = False,
    quiet: bool = False,
    session: Any = None,
):
    """Load plugins, open the checkpoint, resolve its plan by the front door's policy and
    validate it for N (no tensor data read, except the few GPTQ g_idx vectors a planner looks
    at). Returns the checkpoint, the validated plan and what to call the plan. Where the plan
    is not the one beside the checkpoint, because that one does not fit N, one line on stderr
    says so (unless ``quiet``). Under torchrun (``session``'s ranks each run this) rank 0
    resolves the plan and the other ranks receive it (``frontdoor.plan_once``: the fourth
    value, None otherwise)."""
    from ..frontdoor import REPLICATE, resolve_plan
    from ..readers import open_checkpoint

    if replicate and shard_info is not None:
        raise click.UsageError("--replicate and --shard-info both say which plan to use: give one")
    load_plugins(plugins)
    interrupts.work_starts()  # an object checkpoint makes a scratch folder
    given = REPLICATE if replicate else shard_info
    if session is not None and session.spmd:
        from ..frontdoor import plan_job  # (torch: a session has it already)

        with reading():  # the planners read config files: unreadable ones are input
            job = plan_job(session, ckpt, given, experts=experts, what="preparing the load")
        checkpoint, resolved = job.checkpoint, job.resolved
    else:
        job = None
        with reading():
            checkpoint = open_checkpoint(ckpt)
        try:
            with reading():
                resolved = resolve_plan(checkpoint, num_shards, given, experts=experts)
        except BaseException:
            checkpoint.close()
            raise
    try:
        interrupts.check()
    except BaseException:
        checkpoint.close()
        raise
    if resolved.note and not quiet:
        note(resolved.note)
    return checkpoint, resolved.validated, resolved.source, job


def open_session(
    kind: str,
    num_shards: int,
    device: str | None,
    plugins: tuple[str, ...],
    timeout: float | None = None,
):
    """The front door's session of ``kind``; one that cannot be made as asked is bad usage.
    ``timeout`` as ``--timeout`` gives it: None, the default watchdog; 0, none."""
    from ..frontdoor import open_session
    from ..sessions.watchdog import DEFAULT, default_timeout

    interrupts.work_starts()  # a session has threads or processes to stop
    try:
        watchdog = DEFAULT if timeout is None else (timeout or None)
        if watchdog is DEFAULT:
            default_timeout()  # a bad $SHARDLOAD_TIMEOUT is bad usage, said before anything
        session = open_session(kind, num_shards, device=device, plugins=plugins, timeout=watchdog)
    except SessionError as exc:
        raise BadInput(cli_text(exc)) from None
    except ValueError as exc:  # $SHARDLOAD_TIMEOUT
        raise BadInput(str(exc)) from None
    try:
        interrupts.check()
    except BaseException:
        session.close()
        raise
    return session
