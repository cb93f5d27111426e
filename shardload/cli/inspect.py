"""``shardload inspect``: each parameter's per-worker shape and bytes, or each worker's reads."""

from __future__ import annotations

import json
from collections.abc import Iterator

import click

from .app import Command, json_option, out, out_joined
from .options import ckpt_argument, plan_options, prepare, shards_option
from .tables import human, per_worker, table_lines, workers


@click.command(cls=Command)
@shards_option
@plan_options
@json_option("Print JSON instead of a table.")
@click.option(
    "--reads",
    is_flag=True,
    help="Show what each worker will read: byte ranges of which file, per tensor.",
)
@ckpt_argument
def inspect(
    num_shards: int,
    shard_info: str | None,
    replicate: bool,
    plugins: tuple[str, ...],
    experts: str,
    as_json: bool,
    reads: bool,
    ckpt: str,
) -> None:
    """Show each parameter's per-worker shape and bytes for N workers. Reads no tensor data.

    With --reads, show each worker's read plan instead: for every tensor, the byte ranges it
    copies (FILE[begin:end], or strided: FILE[begin:+bytes xCOUNT every STRIDE]) or the chain it
    computes, and the bytes it reads in all.
    """
    checkpoint, validated, _, _ = prepare(
        ckpt, shard_info, plugins, num_shards, experts, replicate, as_json
    )
    with checkpoint:
        if reads:
            from ..readplan import build_read_plans

            plans = build_read_plans(validated, checkpoint)
    if reads:
        _print_reads(plans, validated, as_json)
        return

    # Rows are made as they are printed: a million of them held at once would take about
    # 0.7 KB each, ten times the checkpoint header they come from.
    def rows() -> Iterator[dict]:
        return (
            {
                "name": p.name,
                "shape": list(p.meta.shape),
                "dtype": p.meta.dtype,
                "steps": [s.func for s in p.steps],
                "shard_shape": list(p.piece_shape),
                "shard_dtype": p.piece_dtype,
                "bytes_per_worker": p.piece_nbytes,
                "padding_bytes": p.padding_bytes,
                "workers": None if p.workers is None else list(p.workers),
            }
            for p in validated
        )

    padding = validated.padding_bytes
    if as_json:
        meta = validated.plan.metadata
        head, tail = json.dumps(
            {
                "num_shards": num_shards,
                "params": [],
                "padding_bytes": padding,
                "tensor_parallel": meta.get("tensor_parallel"),
                "experts": meta.get("experts"),
            }
        ).split("[]", 1)
        out(head + "[", nl=False)
        out_joined(map(json.dumps, rows()), ", ")
        out("]" + tail)
        return
    out_joined(
        table_lines(
            ["parameter", "stored", "steps", "per worker", "bytes"],
            lambda: (
                [
                    r["name"],
                    f"{r['shape']} {r['dtype']}",
                    " > ".join(r["steps"])
                    or (
                        "(replicated)"
                        if r["workers"] is None
                        else f"(whole on {workers(r['workers'])})"
                    ),
                    f"{r['shard_shape']} {r['shard_dtype']}",
                    human(r["bytes_per_worker"]),
                ]
                for r in rows()
            ),
            right=(4,),
        ),
        "\n",
    )
    out()
    out(f"{len(validated.params)} tensors, {per_worker(validated)}")
    if padding:
        total = sum(validated.bytes_per_worker(i) for i in range(num_shards))
        out(
            f"zero padding: {human(padding)} over all workers "
            f"({100 * padding / total:.1f}% of what they hold)"
        )


def _print_reads(plans, validated, as_json: bool) -> None:
    """``inspect --reads``: every worker's read plan, and what it reads against what it keeps."""
    stored = sum(p.meta.nbytes for p in validated)
    if as_json:
        out(
            json.dumps(
                {
                    "num_shards": validated.num_shards,
                    "stored_bytes": stored,
                    "workers": [
                        {
                            "rank": rp.rank,
                            "bytes_read": rp.bytes_read,
                            "bytes_kept": rp.nbytes,
                            **rp.to_json(),
                        }
                        for rp in plans
                    ],
                }
            )
        )
        return
    for rp in plans:
        out(
            f"worker {rp.rank}: reads {human(rp.bytes_read)} of {human(stored)} stored, "
            f"keeps {human(rp.nbytes)}"
        )
        for line in rp.describe():
            out(f"  {line}")
