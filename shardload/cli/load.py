"""``shardload load``: load a checkpoint over N workers and report what each holds."""

from __future__ import annotations

import json
from typing import TypedDict

import click

from . import interrupts
from .app import Command, json_option, out
from .options import (
    ckpt_argument,
    load_plugins,
    open_session,
    plan_options,
    prepare,
    session_option,
    shards_option,
)
from .tables import human, table


class _WorkerReport(TypedDict):
    """One worker's part of the report (an item of ``workers`` under ``--json``)."""

    index: int
    device: str
    tensors: int
    bytes: int
    bytes_read: int
    staging: dict | None  # its staging pipeline's counters, where it staged
    planning: dict | None  # under torchrun: how this rank came by its plan


@click.command(cls=Command)
@shards_option
@plan_options
@click.option(
    "--device",
    default=None,
    help="'cpu' (the default), 'cuda' (worker i on cuda:i), or a comma-separated "
    "list, one per worker. With --session torch: this rank's device (default "
    "cuda:LOCAL_RANK where CUDA is available).",
)
@session_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Give up on a worker that makes no progress for SECONDS (a shard function "
    "that never returns, a stopped process): exit 1 naming the worker and the "
    "parameter it was on, the other workers stopped. Progress is each "
    "parameter (or 1 MiB of small ones) and every 64 MiB read; a custom shard "
    "function's computation counts as one step. Default: 600 (or "
    "$SHARDLOAD_TIMEOUT); 0: no limit.",
)
@click.option(
    "--staging",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="How pieces travel to the devices: 'auto' stages CUDA workers' pieces "
    "through a small ring of pinned host buffers, copied asynchronously, and "
    "copies CPU workers' straight into place; 'on' stages for every worker "
    "(the CPU too); 'off' never stages.",
)
@click.option(
    "--staging-buffers",
    type=click.IntRange(2, 64),
    default=4,
    show_default=True,
    help="Host buffers in each worker's staging ring.",
)
@click.option(
    "--staging-mib",
    type=click.FloatRange(min=0, min_open=True),
    default=32.0,
    show_default=True,
    help="The size of each staging buffer, in MiB.",
)
@json_option("Print one JSON object, nothing else.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
@ckpt_argument
def load(
    num_shards: int,
    shard_info: str | None,
    replicate: bool,
    plugins: tuple[str, ...],
    experts: str,
    device: str | None,
    session_kind: str,
    timeout: float | None,
    staging: str,
    staging_buffers: int,
    staging_mib: float,
    as_json: bool,
    quiet: bool,
    ckpt: str,
) -> None:
    """Load CKPT sharded over N workers and report what each worker holds.

    The plan: --shard-info FILE, else CKPT/shard_info.json, else one made from the model's
    config (as `shardload plan` makes it); --replicate gives every worker every tensor whole.
    The "read" column is the checkpoint bytes each worker read to make its pieces (about what
    it keeps: a worker reads only its own bytes, plus the replicated tensors). Threads share
    this process: a shard function that crashes it (a segfault, os._exit) ends the command
    with no message from shardload; --session process isolates faulty shard functions (a crash
    becomes an error naming the worker). Under torchrun (--session torch) every rank loads its
    own shards and rank 0 reports.
    """
    # imported first, while Ctrl-C still ends the process at once (see interrupts): the
    # loader brings torch, the front door the planners and the sessions
    from .. import frontdoor, sessions  # noqa: F401
    from ..frontdoor import planning_per_worker
    from ..loader import load_validated
    from ..staging import Staging

    try:
        ring = Staging(staging_buffers, staging_mib)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--staging-mib'") from None
    stage = {"auto": None, "off": False, "on": ring}[staging]
    load_plugins(plugins)  # they may register shard functions and session kinds
    # the session first: one that cannot be opened (torchrun's variables missing) is the
    # first thing to say
    session = open_session(session_kind, num_shards, device, plugins, timeout)
    try:
        # under torchrun rank 0 plans, every rank receives the plan; rank 0 speaks for all
        checkpoint, validated, plan_file, job = prepare(
            ckpt,
            shard_info,
            plugins,
            num_shards,
            experts,
            replicate,
            quiet or as_json or getattr(session, "rank", 0) != 0,
            session=session,
        )
    except BaseException:
        session.close()
        raise
    if stage is None and any(d.type == "cuda" for d in session.devices):
        stage = ring  # auto: the ring as sized, where it applies
    with checkpoint, session:
        result = load_validated(
            checkpoint, validated, session, progress=not (quiet or as_json), staging=stage
        )
        # each rank's planning, for rank 0's report (an exchange every rank takes part in)
        planning = planning_per_worker(session, job) if job is not None else None
        interrupts.check()
    if getattr(session, "rank", 0) != 0:
        return  # under torchrun, rank 0 speaks for all
    stats = result.stats
    workers: list[_WorkerReport] = [
        {
            "index": i,
            "device": str(result.devices[i]),
            "tensors": stats.tensors_per_worker[i],
            "bytes": stats.bytes_per_worker[i],
            "bytes_read": stats.bytes_read_per_worker[i],
            "staging": stats.staging_per_worker[i] if stats.staging_per_worker else None,
            "planning": planning[i] if planning else None,
        }
        for i in range(num_shards)
    ]
    if as_json:
        out(
            json.dumps(
                {
                    "checkpoint": ckpt,
                    "shard_info": plan_file,
                    "num_shards": num_shards,
                    "seconds": stats.seconds,
                    "bytes_total": stats.bytes_total,
                    "gb_per_s": stats.gb_per_s,
                    "workers": workers,
                }
            )
        )
        return
    if quiet:
        return
    out(
        table(
            ["worker", "device", "tensors", "bytes", "read"],
            [
                [w["index"], w["device"], w["tensors"], human(w["bytes"]), human(w["bytes_read"])]
                for w in workers
            ],
            right=(0, 2, 3, 4),
        )
    )
    out(
        f"loaded {human(stats.bytes_total)} onto {num_shards} worker(s) in "
        f"{stats.seconds:.3f} s ({stats.gb_per_s:.2f} GB/s)"
    )
