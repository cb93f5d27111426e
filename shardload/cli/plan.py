"""``shardload plan``: write the plan (shard_info.json) for a checkpoint, checked for N.

The result goes to standard output: the plan itself, or, with ``-o FILE``, the summary of the
plan written there. Without ``-o`` the summary is commentary, on stderr, so that the plan can
be piped.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from ..errors import quote
from . import interrupts
from .app import Command, OutputFailed, note, out, reading
from .options import ckpt_argument, experts_option, shards_option


class _TablesHelp(Command):
    """A command whose help ends with text made from the tables it describes
    (``frontdoor.tables``), made only when the help is shown: reading the tables imports the
    planners, which ``--help`` of other commands must not."""

    def __init__(self, *args, tables: Callable[[], str], **kwargs):
        super().__init__(*args, **kwargs)
        self.tables = tables

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help_text(ctx, formatter)
        for paragraph in self.tables().split("\n\n"):
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text(paragraph)


def _planner_help() -> str:
    from ..frontdoor.tables import planner_help

    return planner_help()


@click.command(cls=_TablesHelp, tables=_planner_help)
@shards_option
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, writable=True),
    help="Write the plan here (default: standard output).",
)
@click.option(
    "--vocab-parallel",
    is_flag=True,
    help="Split embeddings and lm_head by vocabulary rows instead of replicating.",
)
@click.option(
    "--no-pad",
    is_flag=True,
    help="Refuse an N the heads or MLP do not divide, instead of zero-padding.",
)
@experts_option
@ckpt_argument
def plan(
    num_shards: int, output: str | None, vocab_parallel: bool, no_pad: bool, experts: str, ckpt: str
) -> None:
    """Write the plan (shard_info.json) for CKPT, checked for N workers.

    The model and its quantization are read from config.json (+ quantization_config or
    quantize_config.json), GGUF metadata or mlc-chat-config.json. The plan is written in
    expressions of num_shards, so it also serves every other N the model allows. For an N the
    heads or MLP do not divide, the plan zero-pads them (exactly) for that N.

    With -o FILE the plan goes to FILE and its summary (the model, and the N it serves) to
    standard output; without, the plan to standard output and the summary to stderr.

    Mixture-of-experts: --experts tp splits every expert; --experts ep gives each worker
    whole experts, for this N only.
    """
    from ..frontdoor import write_plan
    from ..planners import decision as planner_decision
    from ..readers import open_checkpoint

    interrupts.work_starts()  # an object checkpoint makes a scratch folder
    with reading():
        checkpoint = open_checkpoint(ckpt)
    with checkpoint, reading():  # the planners read config files: unreadable ones are input
        # one pass: the plan that fits N, padded for N, or the refusal naming the constraint
        # N breaks and the N that work (raised here, printed by the group)
        decision = planner_decision.plan_decision(
            checkpoint, num_shards, vocab_parallel=vocab_parallel, pad=not no_pad, experts=experts
        )
        info, summary, valid = decision.shard_info(), decision.summary, decision.valid
    interrupts.check()
    try:
        text = write_plan(info, output)
    except OSError as exc:
        raise OutputFailed(exc, quote(output)) from None
    if not output:
        out(text, nl=False)
    fits = ", ".join(map(str, valid)) or "none"
    if not valid.complete:  # a plan too large to try every N: say how far the list goes
        fits += f" (tried N up to {valid.tried} only)"
    scope = (
        f"for N={num_shards} only; unpadded plans fit N in {fits}"
        if decision.kind is planner_decision.PlanKind.PADDED
        else f"valid for N in {fits}"
    )
    if experts == "ep":
        scope = f"for N={num_shards} only (whole experts are placed on its workers)"
    if output:
        out(f"{summary}; {scope} (written to {output})")  # the result shown
    else:
        note(f"{summary}; {scope}")  # the plan is the result: stdout stays pipeable
