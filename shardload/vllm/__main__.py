"""``python -m shardload.vllm overrides CKPT --tp N``: the ``--hf-overrides`` vLLM needs for N.

Prints the JSON (``{}`` where N divides the model) and exits 0, or prints one line saying why
vLLM cannot run that N, with the N that work, and exits 2.
"""

from __future__ import annotations

import json
import sys

import click

from ..errors import ShardloadError


@click.group()
def main() -> None:
    """shardload's helpers for vLLM."""


@main.command()
@click.argument("checkpoint")
@click.option("--tp", "tensor_parallel_size", type=click.IntRange(1, 4096), required=True,
              help="vLLM's --tensor-parallel-size")
@click.option("--plan", default=None, help="a shard_info.json to use instead of the policy's")
def overrides(checkpoint: str, tensor_parallel_size: int, plan) -> None:
    """The --hf-overrides JSON that runs CHECKPOINT at --tp in vLLM with shardload."""
    from .padding import vllm_overrides

    try:
        click.echo(json.dumps(vllm_overrides(checkpoint, tensor_parallel_size, plan)))
    except ShardloadError as exc:
        click.echo(f"shardload: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
