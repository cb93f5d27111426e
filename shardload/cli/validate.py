"""``shardload validate``: whether the plan fits the checkpoint for N workers."""

from __future__ import annotations

import click

from .app import Command, out
from .options import ckpt_argument, plan_options, prepare, shards_option
from .tables import per_worker


@click.command(cls=Command)
@shards_option
@plan_options
@ckpt_argument
def validate(
    num_shards: int,
    shard_info: str | None,
    replicate: bool,
    plugins: tuple[str, ...],
    experts: str,
    ckpt: str,
) -> None:
    """Check that the plan fits CKPT for N workers. Reads no tensor data."""
    checkpoint, validated, plan_file, _ = prepare(
        ckpt, shard_info, plugins, num_shards, experts, replicate
    )
    with checkpoint:
        params = list(validated)
        sharded = sum(1 for p in params if not p.replicated)
        placed = sum(1 for p in params if p.workers is not None)
        kinds = f"{sharded} sharded, " + (f"{placed} placed, " if placed else "")
        out(
            f"ok: {plan_file} fits {ckpt} for {num_shards} worker(s): {len(params)} "
            f"tensors ({kinds}{len(params) - sharded - placed} replicated), "
            f"{per_worker(validated)}"
        )
