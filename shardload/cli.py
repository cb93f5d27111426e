"""The ``shardload`` command line. The only module that knows about the terminal.

Exit codes: 0 ok, 1 load failure, 2 bad usage / plan / checkpoint, 130 interrupted.
Library modules are imported inside the commands so that ``shardload --help`` never imports
torch.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

import click

from .errors import FormatError, PlanError, ShardloadError

EXIT_OK, EXIT_LOAD_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


class LoadFailed(click.ClickException):
    exit_code = EXIT_LOAD_FAILED


class BadInput(click.ClickException):
    exit_code = EXIT_BAD_INPUT


class _Group(click.Group):
    """Maps shardload's exception tree to exit codes; Ctrl-C is one line and exit 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (PlanError, FormatError) as exc:
            raise BadInput(str(exc)) from None
        except ShardloadError as exc:
            raise LoadFailed(str(exc)) from None
        except ImportError as exc:  # a --plugin module that does not import
            raise BadInput(str(exc)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:
            if not standalone_mode:
                raise
            click.echo("Interrupted.", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except click.ClickException as exc:
            if not standalone_mode:
                raise
            exc.show()
            sys.exit(exc.exit_code)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else EXIT_OK)
        return rv


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _table(headers: list[str], rows: list[list[Any]], right: tuple[int, ...] = ()) -> str:
    """A plain-text table; columns listed in ``right`` (numbers) are right-aligned."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]

    def line(row: list[str]) -> str:
        padded = [c.rjust(w) if k in right else c.ljust(w)
                  for k, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(padded).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]),
                      *(line(r) for r in cells[1:])])


# ---- shared options ----------------------------------------------------------------------------

def _shards_option(f):
    return click.option("--shards", "-n", "num_shards", type=click.IntRange(min=1),
                        required=True, help="Number of workers (tensor-parallel ranks).")(f)


def _plan_options(f):
    f = click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
                     help="Import MODULE first, so the shard functions it registers exist "
                          "(it must be importable: on sys.path or PYTHONPATH). Repeatable.")(f)
    f = click.option("--shard-info", "shard_info", type=click.Path(dir_okay=False),
                     help="The plan file. Default: CKPT/shard_info.json, or, without one, a "
                          "plan made from the model's config (see `shardload plan`).")(f)
    return f


_ckpt_argument = click.argument("ckpt", type=click.Path(exists=True))


def _prepare(ckpt: str, shard_info: Optional[str], plugins: tuple[str, ...], num_shards: int):
    """Load plugins, open the checkpoint, find or write the plan, validate it for N (no tensor
    data read, except the few GPTQ g_idx vectors a planner looks at)."""
    from .plan import ShardInfo
    from .planners import check_num_shards, plan_for
    from .readers import open_checkpoint
    from .registry import load_plugins

    load_plugins(plugins)
    checkpoint = open_checkpoint(ckpt)
    if shard_info is None:
        folder = ckpt if os.path.isdir(ckpt) else os.path.dirname(ckpt)
        candidate = os.path.join(folder, "shard_info.json")
        if os.path.exists(candidate):
            shard_info = candidate
    if shard_info is None:
        info = plan_for(checkpoint, num_shards)  # no plan file: plan from the model's config
        source = info.source
    else:
        info, source = ShardInfo.load(shard_info), shard_info
        if info.is_symbolic:
            check_num_shards(info, checkpoint, num_shards)
    validated = info.bind(num_shards).validate(checkpoint.metadata())
    return checkpoint, validated, source


def _padding_bytes(param) -> int:
    """Bytes of zero units a padded plan adds for this parameter, over all workers."""
    total = 0
    for step in param.steps:
        if step.func == "shardload.take_units":
            dim, unit, *indices = step.extra
            per_unit = param.meta.nbytes // max(param.meta.shape[dim], 1) * unit
            total += indices.count(-1) * per_unit
    return total


def _open_session(kind: str, num_shards: int, device: Optional[str], plugins: tuple[str, ...]):
    from .sessions import ProcessSession, ThreadedSession, TorchDistributedSession

    devices = device.split(",") if device and "," in device else device
    try:
        if kind == "thread":
            return ThreadedSession(num_shards, device=devices or "cpu")
        if kind == "process":
            return ProcessSession(num_shards, device=devices or "cpu", plugins=plugins)
        session = TorchDistributedSession(device=devices)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if session.num_workers != num_shards:
        session.close()
        raise BadInput(f"--shards {num_shards} but this torch.distributed job has "
                       f"{session.num_workers} ranks; they must be equal")
    return session


# ---- commands ----------------------------------------------------------------------------------

@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardload")
def cli() -> None:
    """Load already-quantized checkpoints onto N tensor-parallel workers, sharded at load time.

    \b
      shardload load --shards 4 examples/tiny_llama_q4
      shardload plan --shards 3 model.gguf -o shard_info.json
      shardload validate --shards 8 CKPT
      shardload inspect --shards 3 CKPT
      shardload funcs
    """


@cli.command()
@_shards_option
@_plan_options
@click.option("--device", default=None,
              help="'cpu' (the default), 'cuda' (worker i on cuda:i), or a comma-separated "
                   "list, one per worker. With --session torch: this rank's device (default "
                   "cuda:LOCAL_RANK where CUDA is available).")
@click.option("--session", "session_kind", type=click.Choice(["thread", "process", "torch"]),
              default="thread", show_default=True,
              help="Where workers run: threads of this process, worker processes, or the "
                   "ranks of a torchrun job (one per process).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
@_ckpt_argument
def load(num_shards: int, shard_info: Optional[str], plugins: tuple[str, ...],
         device: Optional[str], session_kind: str, as_json: bool, quiet: bool,
         ckpt: str) -> None:
    """Load CKPT sharded over N workers and report what each worker holds.

    Under torchrun (--session torch) every rank loads its own shards and rank 0 reports.
    """
    from .loader import load_sharded

    checkpoint, validated, plan_file = _prepare(ckpt, shard_info, plugins, num_shards)
    session = _open_session(session_kind, num_shards, device, plugins)
    with checkpoint, session:
        result = load_sharded(checkpoint, validated.plan, session,
                              progress=not (quiet or as_json))
    if getattr(session, "rank", 0) != 0:
        return  # under torchrun, rank 0 speaks for all
    stats = result.stats
    workers = [{"index": i, "device": str(result.devices[i]),
                "tensors": stats.tensors_per_worker[i], "bytes": stats.bytes_per_worker[i],
                "bytes_read": stats.bytes_read_per_worker[i]} for i in range(num_shards)]
    if as_json:
        click.echo(json.dumps({"checkpoint": ckpt, "shard_info": plan_file,
                               "num_shards": num_shards, "seconds": stats.seconds,
                               "bytes_total": stats.bytes_total, "gb_per_s": stats.gb_per_s,
                               "workers": workers}))
        return
    if quiet:
        return
    click.echo(_table(["worker", "device", "tensors", "bytes", "read"],
                      [[w["index"], w["device"], w["tensors"], _human(w["bytes"]),
                        _human(w["bytes_read"])] for w in workers], right=(0, 2, 3, 4)))
    click.echo(f"loaded {_human(stats.bytes_total)} onto {num_shards} worker(s) in "
               f"{stats.seconds:.3f} s ({stats.gb_per_s:.2f} GB/s)")


@cli.command()
@_shards_option
@_plan_options
@_ckpt_argument
def validate(num_shards: int, shard_info: Optional[str], plugins: tuple[str, ...],
             ckpt: str) -> None:
    """Check that the plan fits CKPT for N workers. Reads no tensor data."""
    checkpoint, validated, plan_file = _prepare(ckpt, shard_info, plugins, num_shards)
    with checkpoint:
        params = list(validated)
        sharded = sum(1 for p in params if not p.replicated)
        click.echo(f"ok: {plan_file} fits {ckpt} for {num_shards} worker(s): {len(params)} "
                   f"tensors ({sharded} sharded, {len(params) - sharded} replicated), "
                   f"{_human(validated.bytes_per_worker())} per worker")


@cli.command()
@_shards_option
@_plan_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_ckpt_argument
def inspect(num_shards: int, shard_info: Optional[str], plugins: tuple[str, ...],
            as_json: bool, ckpt: str) -> None:
    """Show each parameter's per-worker shape and bytes for N workers. Reads no tensor data."""
    checkpoint, validated, _ = _prepare(ckpt, shard_info, plugins, num_shards)
    with checkpoint:
        rows = [{"name": p.name, "shape": list(p.meta.shape), "dtype": p.meta.dtype,
                 "steps": [s.func for s in p.steps], "shard_shape": list(p.piece_shape),
                 "shard_dtype": p.piece_dtype, "bytes_per_worker": p.piece_nbytes,
                 "padding_bytes": _padding_bytes(p)}
                for p in validated]
    padding = sum(r["padding_bytes"] for r in rows)
    if as_json:
        click.echo(json.dumps({"num_shards": num_shards, "params": rows,
                               "padding_bytes": padding,
                               "tensor_parallel": validated.plan.metadata.get("tensor_parallel")}))
        return
    click.echo(_table(["parameter", "stored", "steps", "per worker", "bytes"],
                      [[r["name"], f"{r['shape']} {r['dtype']}",
                        " > ".join(r["steps"]) or "(replicated)",
                        f"{r['shard_shape']} {r['shard_dtype']}", _human(r["bytes_per_worker"])]
                       for r in rows], right=(4,)))
    click.echo(f"{len(rows)} tensors, {_human(validated.bytes_per_worker())} per worker")
    if padding:
        total = validated.bytes_per_worker() * num_shards
        click.echo(f"zero padding: {_human(padding)} over all workers "
                   f"({100 * padding / total:.1f}% of what they hold)")


@cli.command()
@_shards_option
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True),
              help="Write the plan here (default: standard output).")
@click.option("--vocab-parallel", is_flag=True,
              help="Split embeddings and lm_head by vocabulary rows instead of replicating.")
@click.option("--no-pad", is_flag=True,
              help="Refuse an N the heads or MLP do not divide, instead of zero-padding.")
@_ckpt_argument
def plan(num_shards: int, output: Optional[str], vocab_parallel: bool, no_pad: bool,
         ckpt: str) -> None:
    """Write the plan (shard_info.json) for CKPT, checked for N workers.

    The model and its quantization are read from config.json (+ quantization_config or
    quantize_config.json), GGUF metadata or mlc-chat-config.json. The plan is written in
    expressions of num_shards, so it also serves every other N the model allows. For an N the
    heads or MLP do not divide, the plan zero-pads them (exactly) for that N.
    """
    from .planners import check_num_shards, describe_plan, plan_for, valid_num_shards
    from .readers import open_checkpoint

    with open_checkpoint(ckpt) as checkpoint:
        try:
            info, summary = describe_plan(checkpoint, num_shards, vocab_parallel=vocab_parallel,
                                          pad=not no_pad)
            check_num_shards(info, checkpoint, num_shards)
        except PlanError:
            plan_for(checkpoint, num_shards, vocab_parallel=vocab_parallel, pad=not no_pad)
            raise  # plan_for raises the refusal that lists the N that work
        symbolic = info if info.is_symbolic else describe_plan(
            checkpoint, vocab_parallel=vocab_parallel, pad=False)[0]
        valid = valid_num_shards(symbolic, checkpoint)
    if output:
        info.dump(output)
    else:
        click.echo(info.dumps(), nl=False)
    scope = (f"for N={num_shards} only; unpadded plans fit N in {', '.join(map(str, valid))}"
             if not info.is_symbolic and summary.padded
             else f"valid for N in {', '.join(map(str, valid))}")
    click.echo(f"{summary}; {scope}{f' (written to {output})' if output else ''}", err=True)


@cli.command()
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
              help="Import MODULE first. Repeatable.")
def funcs(plugins: tuple[str, ...]) -> None:
    """List the registered shard functions."""
    from .registry import list_shard_funcs, load_plugins

    load_plugins(plugins)
    entries = list_shard_funcs()
    click.echo(_table(["name", "array", "args", "description"],
                      [[f.name, f.array, f.arity_text(), f.doc.replace("``", "")] for f in entries]))
    click.echo("Plans name these functions; add your own with @register_shard_func in a module "
               "passed as --plugin MODULE.")


def main() -> None:
    """Console-script entry point."""
    cli.main(prog_name="shardload")


if __name__ == "__main__":  # pragma: no cover
    main()
