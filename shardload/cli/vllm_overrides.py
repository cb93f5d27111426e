"""``shardload vllm-overrides``: the ``--hf-overrides`` JSON that runs a checkpoint in vLLM."""

from __future__ import annotations

import json

import click

from . import interrupts
from .app import Command, out, reading
from .options import ckpt_argument, experts_option, shards_option


@click.command("vllm-overrides", cls=Command)
@shards_option
@click.option(
    "--plan",
    "shard_info",
    default=None,
    type=click.Path(dir_okay=False),
    help="A shard_info.json to use instead of the plan policy's.",
)
@experts_option
@ckpt_argument
def vllm_overrides(num_shards: int, shard_info: str | None, experts: str, ckpt: str) -> None:
    """The --hf-overrides JSON that runs CKPT in vLLM at --tensor-parallel-size N with
    --load-format shardload (--experts ep: with --enable-expert-parallel): {} where N divides
    the model, the zero-padded model's sizes where shardload's padding is exact in vLLM's
    model; else exit 2, saying why, with the N that work. Reads no tensor data."""
    from ..vllm.padding import vllm_overrides as overrides

    interrupts.work_starts()  # it opens the checkpoint
    with reading():
        out(json.dumps(overrides(ckpt, num_shards, shard_info, experts=experts)))
