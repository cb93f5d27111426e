"""The ``shardload`` command line. The only module that knows about the terminal.

Exit codes: 0 ok, 1 load failure (or output that cannot be written: a full disk), 2 bad usage /
plan / checkpoint (an unreadable input path too), 130 interrupted, 141 standard output closed
early (``shardload funcs | head -1``: quiet, as a tool killed by SIGPIPE would be; the shell
shows 141 for those too). Every failure is one line on stderr, never a traceback.

Output is flushed as it is written, so a full disk or a closed pipe is found where it can be
reported; ``plan -o FILE`` writes a temporary file beside FILE and renames it, so FILE is never
left half-written. Library modules are imported inside the commands so that ``shardload
--help`` never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import click

from .errors import (FormatError, PlanError, SessionError, ShardloadError, StorageError,
                     cli_text, quote)

EXIT_OK, EXIT_LOAD_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
#: standard output closed before all was written (128 + SIGPIPE, as the shell reports a tool
#: that SIGPIPE ended)
EXIT_BROKEN_PIPE = 141


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


def _show(exc: click.ClickException, as_json: bool) -> None:
    """Print ``exc`` on stderr: one line, or, under ``--json``, one JSON object ``{"error":
    {"type", "message", "exit_code"}}`` (standard output stays for results)."""
    with contextlib.suppress(OSError, ValueError):
        if not as_json:
            exc.show()
            return
        kind = getattr(exc, "kind", None) or type(exc).__name__
        click.echo(json.dumps({"error": {"type": kind, "message": exc.format_message(),
                                         "exit_code": exc.exit_code}}), err=True)


class OutputFailed(click.ClickException):
    """The command's output could not be written (a full disk, a closed pipe, no permission).

    ``broken_pipe``: standard output was closed by its reader (``| head -1``): not an error to
    report, the reader has what it wanted."""

    exit_code = EXIT_LOAD_FAILED

    def __init__(self, exc: OSError, target: str):
        self.stdout = target == "standard output"
        self.broken_pipe = self.stdout and exc.errno == errno.EPIPE
        super().__init__(f"cannot write {target}: {exc.strerror or exc}")


def _os_message(exc: OSError) -> str:
    """``"cannot read 'x': Permission denied"``: one line, the path quoted (and cut)."""
    where = f" {quote(os.fsdecode(exc.filename))}" if exc.filename is not None else ""
    return f"cannot read{where}: {exc.strerror or exc}"


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """Opening the user's inputs: an ``OSError`` (permission denied, a directory where a file
    belongs, a path that vanished) is bad input, exit 2, naming the path."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _BAD_INPUT_ERRNOS:
            raise BadInput(_os_message(exc)) from None
        raise LoadFailed(_os_message(exc)) from None  # EIO, EMFILE, ENOMEM: not the input's fault


#: errors opening an input that are the input's fault (exit 2); any other is a failure (exit 1)
_BAD_INPUT_ERRNOS = {errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EISDIR,
                     errno.ELOOP, errno.ENAMETOOLONG, errno.ENXIO}


def _out(text: str = "", nl: bool = True) -> None:
    """Write to standard output, flushed now: a full disk or a closed pipe is found here,
    where it can be reported, rather than at exit, where it would be a traceback."""
    try:
        click.echo(text, nl=nl)
        sys.stdout.flush()
    except OSError as exc:
        raise OutputFailed(exc, "standard output") from None


def _note(text: str) -> None:
    """A line for the user on stderr; nothing more can be done if even that fails."""
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


class _Group(click.Group):
    """Maps shardload's exception tree to exit codes; Ctrl-C is one line and exit 130.

    A message printed here says each setting it mentions the way the command line does
    (``errors.cli_text``: ``device='cuda'`` becomes ``--device cuda``): the core's messages
    name the Python API, never a flag."""

    def invoke(self, ctx: click.Context) -> Any:
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

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        as_json = "--json" in (sys.argv[1:] if args is None else list(args))
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
            _note("Interrupted.")
            _exit(EXIT_INTERRUPTED)
        except OutputFailed as exc:
            if not standalone_mode:
                raise
            if exc.stdout and _OWN_PROCESS:
                _silence_stdout()
            if exc.broken_pipe:
                _exit(EXIT_BROKEN_PIPE)  # the reader has gone: say nothing
            _show(exc, as_json)
            _exit(exc.exit_code)
        except click.ClickException as exc:
            if not standalone_mode:
                raise
            _show(exc, as_json)
            _exit(exc.exit_code)
        if standalone_mode:
            _exit(rv if isinstance(rv, int) else EXIT_OK)
        return rv


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _table(headers: list[str], rows: list[list[Any]], right: tuple[int, ...] = ()) -> str:
    """A plain-text table; columns listed in ``right`` (numbers) are right-aligned."""
    return "\n".join(_table_lines(headers, lambda: rows, right))


def _table_lines(headers: list[str], rows: Callable[[], Iterable[list[Any]]],
                 right: tuple[int, ...] = ()) -> Iterator[str]:
    """``_table``'s lines one at a time, from ``rows()`` made twice (the first time for the
    widths): a table of a million rows is never held whole."""
    widths = [len(h) for h in headers]
    for row in rows():
        widths = [max(w, len(str(c))) for w, c in zip(widths, row)]

    def line(row: list[Any]) -> str:
        padded = [str(c).rjust(w) if k in right else str(c).ljust(w)
                  for k, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(padded).rstrip()

    yield line(headers)
    yield line(["-" * w for w in widths])
    yield from map(line, rows())


def _out_joined(pieces: Iterable[str], sep: str) -> None:
    """``_out(sep.join(pieces), nl=False)``, a few thousand pieces at a time."""
    pieces, first = iter(pieces), True
    while chunk := list(itertools.islice(pieces, 4096)):
        _out(("" if first else sep) + sep.join(chunk), nl=False)
        first = False


# ---- shared options ----------------------------------------------------------------------------

def _check_shards(ctx: click.Context, param: click.Parameter, value: Optional[int]):
    """At most MAX_NUM_SHARDS workers: --shards 100000 is a typo, not 100,000 threads."""
    from .limits import num_shards_problem

    problem = None if value is None else num_shards_problem(value)
    if problem is not None:
        raise click.BadParameter(problem, ctx, param)
    return value


def _shards_option(f):
    return click.option("--shards", "-n", "num_shards", type=click.IntRange(min=1),
                        required=True, callback=_check_shards,
                        help="Number of workers (tensor-parallel ranks), at most 4096.")(f)


_EXPERTS_HELP = ("Routed experts of a mixture-of-experts model: tp splits every expert "
                 "across the workers; ep gives each worker whole experts (expert parallelism: "
                 "a worker reads only its experts' bytes), assigned evenly and recorded in the "
                 "plan. Default: tp.")


def _experts_option(f):
    return click.option("--experts", type=click.Choice(["tp", "ep"]), default="tp",
                        show_default=False, help=_EXPERTS_HELP)(f)


def _session_option(f):
    """``--session KIND``: a kind from the table of session kinds (``sessions.kinds``), checked
    when the session is opened, so that a kind a --plugin module registers is one too."""
    from .sessions.kinds import session_kinds

    described = "; ".join(f"{k.name}: {k.description}" for k in session_kinds())
    return click.option("--session", "session_kind", metavar="KIND", default="thread",
                        show_default=True,
                        help=f"Where workers run ({described}; or a kind a --plugin module "
                             "registers).")(f)


def _plan_options(f):
    f = _experts_option(f)
    f = click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
                     help="Import MODULE first, so the shard functions it registers exist "
                          "(it must be importable: on sys.path or PYTHONPATH). Repeatable.")(f)
    f = click.option("--replicate", is_flag=True,
                     help="Give every worker every tensor whole (no plan).")(f)
    f = click.option("--shard-info", "shard_info", type=click.Path(dir_okay=False),
                     help="The plan file. Default: CKPT/shard_info.json, or, without one, a "
                          "plan made from the model's config (see `shardload plan`).")(f)
    return f


class _CheckpointPath(click.Path):
    """A local path that must exist, or an object storage URL (``s3://``, ``gs://`` or
    ``az://bucket/folder/``),
    checked when it is opened."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from .sources import is_object_url

        if is_object_url(value):
            return value
        return super().convert(value, param, ctx)


_ckpt_argument = click.argument("ckpt", type=_CheckpointPath(exists=True))


def _prepare(ckpt: str, shard_info: Optional[str], plugins: tuple[str, ...], num_shards: int,
             experts: str = "tp", replicate: bool = False):
    """Load plugins, open the checkpoint, resolve its plan by the front door's policy and
    validate it for N (no tensor data read, except the few GPTQ g_idx vectors a planner looks
    at). Returns the checkpoint, the validated plan and what to call the plan."""
    from .frontdoor import REPLICATE, resolve_plan
    from .readers import open_checkpoint

    if replicate and shard_info is not None:
        raise click.UsageError("--replicate and --shard-info both say which plan to use: give "
                               "one")
    _load_plugins(plugins)
    with _reading():
        checkpoint = open_checkpoint(ckpt)
    try:
        with _reading():   # the planners read config files: unreadable ones are input
            resolved = resolve_plan(checkpoint, num_shards,
                                    REPLICATE if replicate else shard_info, experts=experts)
    except BaseException:
        checkpoint.close()
        raise
    return checkpoint, resolved.validated, resolved.source


def _load_plugins(plugins: tuple[str, ...]) -> None:
    from .registry import load_plugins

    load_plugins(plugins)


def _padding_bytes(param) -> int:
    """Bytes of zero units a padded plan adds for this parameter, over all workers."""
    total = 0
    for step in param.steps:
        if step.func in ("shardload.take_units", "shardload.take_units_fill"):
            dim, unit, *indices = step.extra
            if step.func == "shardload.take_units_fill":
                indices = indices[1:]                  # after the fill
            per_unit = param.meta.nbytes // max(param.meta.shape[dim], 1) * unit
            total += indices.count(-1) * per_unit
    return total


def _open_session(kind: str, num_shards: int, device: Optional[str], plugins: tuple[str, ...],
                  timeout: Optional[float] = None):
    """The front door's session of ``kind``; one that cannot be made as asked is bad usage.
    ``timeout`` as ``--timeout`` gives it: None, the default watchdog; 0, none."""
    from .errors import SessionError
    from .frontdoor import open_session
    from .sessions.watchdog import DEFAULT, default_timeout

    try:
        watchdog = DEFAULT if timeout is None else (timeout or None)
        if watchdog is DEFAULT:
            default_timeout()  # a bad $SHARDLOAD_TIMEOUT is bad usage, said before anything
        return open_session(kind, num_shards, device=device, plugins=plugins, timeout=watchdog)
    except SessionError as exc:
        raise BadInput(cli_text(exc)) from None
    except ValueError as exc:  # $SHARDLOAD_TIMEOUT
        raise BadInput(str(exc)) from None


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
      shardload run --shards 3 model.gguf --prompt "What is the capital of France?"
      shardload vllm-overrides --shards 4 CKPT
      shardload funcs

    Exit codes: 0 ok, 1 load or output failure, 2 bad usage, plan or checkpoint,
    130 interrupted, 141 standard output closed by its reader (quietly).
    """


@cli.command()
@_shards_option
@_plan_options
@click.option("--device", default=None,
              help="'cpu' (the default), 'cuda' (worker i on cuda:i), or a comma-separated "
                   "list, one per worker. With --session torch: this rank's device (default "
                   "cuda:LOCAL_RANK where CUDA is available).")
@_session_option
@click.option("--timeout", type=click.FloatRange(min=0), default=None,
              metavar="SECONDS",
              help="Give up on a worker that makes no progress for SECONDS (a shard function "
                   "that never returns, a stopped process): exit 1 naming the worker and the "
                   "parameter it was on, the other workers stopped. Progress is each "
                   "parameter (or 1 MiB of small ones) and every 64 MiB read; a custom shard "
                   "function's computation counts as one step. Default: 600 (or "
                   "$SHARDLOAD_TIMEOUT); 0: no limit.")
@click.option("--staging", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True,
              help="How pieces travel to the devices: 'auto' stages CUDA workers' pieces "
                   "through a small ring of pinned host buffers, copied asynchronously, and "
                   "copies CPU workers' straight into place; 'on' stages for every worker "
                   "(the CPU too); 'off' never stages.")
@click.option("--staging-buffers", type=click.IntRange(2, 64), default=4, show_default=True,
              help="Host buffers in each worker's staging ring.")
@click.option("--staging-mib", type=click.FloatRange(min=0, min_open=True), default=32.0,
              show_default=True, help="The size of each staging buffer, in MiB.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, nothing else.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
@_ckpt_argument
def load(num_shards: int, shard_info: Optional[str], replicate: bool, plugins: tuple[str, ...],
         experts: str, device: Optional[str], session_kind: str, timeout: Optional[float],
         staging: str, staging_buffers: int, staging_mib: float, as_json: bool, quiet: bool,
         ckpt: str) -> None:
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
    from .loader import load_validated
    from .staging import Staging

    try:
        ring = Staging(staging_buffers, staging_mib)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--staging-mib'") from None
    stage = {"auto": None, "off": False, "on": ring}[staging]
    _load_plugins(plugins)   # they may register shard functions and session kinds
    # the session first: one that cannot be opened (torchrun's variables missing) is the
    # first thing to say
    session = _open_session(session_kind, num_shards, device, plugins, timeout)
    try:
        checkpoint, validated, plan_file = _prepare(ckpt, shard_info, plugins, num_shards,
                                                    experts, replicate)
    except BaseException:
        session.close()
        raise
    if stage is None and any(d.type == "cuda" for d in session.devices):
        stage = ring  # auto: the ring as sized, where it applies
    with checkpoint, session:
        result = load_validated(checkpoint, validated, session,
                                progress=not (quiet or as_json), staging=stage)
    if getattr(session, "rank", 0) != 0:
        return  # under torchrun, rank 0 speaks for all
    stats = result.stats
    workers = [{"index": i, "device": str(result.devices[i]),
                "tensors": stats.tensors_per_worker[i], "bytes": stats.bytes_per_worker[i],
                "bytes_read": stats.bytes_read_per_worker[i],
                "staging": (stats.staging_per_worker or [None] * num_shards)[i]}
               for i in range(num_shards)]
    if as_json:
        _out(json.dumps({"checkpoint": ckpt, "shard_info": plan_file,
                         "num_shards": num_shards, "seconds": stats.seconds,
                         "bytes_total": stats.bytes_total, "gb_per_s": stats.gb_per_s,
                         "workers": workers}))
        return
    if quiet:
        return
    _out(_table(["worker", "device", "tensors", "bytes", "read"],
                [[w["index"], w["device"], w["tensors"], _human(w["bytes"]),
                  _human(w["bytes_read"])] for w in workers], right=(0, 2, 3, 4)))
    _out(f"loaded {_human(stats.bytes_total)} onto {num_shards} worker(s) in "
         f"{stats.seconds:.3f} s ({stats.gb_per_s:.2f} GB/s)")


@cli.command()
@_shards_option
@_plan_options
@_ckpt_argument
def validate(num_shards: int, shard_info: Optional[str], replicate: bool,
             plugins: tuple[str, ...], experts: str, ckpt: str) -> None:
    """Check that the plan fits CKPT for N workers. Reads no tensor data."""
    checkpoint, validated, plan_file = _prepare(ckpt, shard_info, plugins, num_shards, experts,
                                                replicate)
    with checkpoint:
        params = list(validated)
        sharded = sum(1 for p in params if not p.replicated)
        placed = sum(1 for p in params if p.workers is not None)
        kinds = f"{sharded} sharded, " + (f"{placed} placed, " if placed else "")
        _out(f"ok: {plan_file} fits {ckpt} for {num_shards} worker(s): {len(params)} "
             f"tensors ({kinds}{len(params) - sharded - placed} replicated), "
             f"{_per_worker(validated)}")


@cli.command("vllm-overrides")
@_shards_option
@click.option("--plan", "shard_info", default=None, type=click.Path(dir_okay=False),
              help="A shard_info.json to use instead of the plan policy's.")
@_experts_option
@_ckpt_argument
def vllm_overrides(num_shards: int, shard_info: Optional[str], experts: str, ckpt: str) -> None:
    """The --hf-overrides JSON that runs CKPT in vLLM at --tensor-parallel-size N with
    --load-format shardload (--experts ep: with --enable-expert-parallel): {} where N divides
    the model, the zero-padded model's sizes where shardload's padding is exact in vLLM's
    model; else exit 2, saying why, with the N that work. Reads no tensor data."""
    from .vllm.padding import vllm_overrides as overrides

    with _reading():
        _out(json.dumps(overrides(ckpt, num_shards, shard_info, experts=experts)))


def _per_worker(validated) -> str:
    """``12 MiB per worker``, or, where the plan places parameters on some workers only, the
    most any worker keeps."""
    most = _human(validated.bytes_per_worker())
    if validated.plan.placement is None:
        return f"{most} per worker"
    placed = sum(1 for p in validated if p.workers is not None)
    if not placed:
        return f"at most {most} per worker"
    return f"at most {most} per worker ({placed} tensors placed on some workers only)"


@cli.command()
@_shards_option
@_plan_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--reads", is_flag=True,
              help="Show what each worker will read: byte ranges of which file, per tensor.")
@_ckpt_argument
def inspect(num_shards: int, shard_info: Optional[str], replicate: bool,
            plugins: tuple[str, ...], experts: str, as_json: bool, reads: bool,
            ckpt: str) -> None:
    """Show each parameter's per-worker shape and bytes for N workers. Reads no tensor data.

    With --reads, show each worker's read plan instead: for every tensor, the byte ranges it
    copies (FILE[begin:end], or strided: FILE[begin:+bytes xCOUNT every STRIDE]) or the chain it
    computes, and the bytes it reads in all.
    """
    checkpoint, validated, _ = _prepare(ckpt, shard_info, plugins, num_shards, experts,
                                        replicate)
    with checkpoint:
        if reads:
            from .readplan import build_read_plans

            plans = build_read_plans(validated, checkpoint)
    if reads:
        _print_reads(plans, validated, as_json)
        return

    # Rows are made as they are printed: a million of them held at once would take about
    # 0.7 KB each, ten times the checkpoint header they come from.
    def rows() -> Iterator[dict]:
        return ({"name": p.name, "shape": list(p.meta.shape), "dtype": p.meta.dtype,
                 "steps": [s.func for s in p.steps], "shard_shape": list(p.piece_shape),
                 "shard_dtype": p.piece_dtype, "bytes_per_worker": p.piece_nbytes,
                 "padding_bytes": _padding_bytes(p),
                 "workers": None if p.workers is None else list(p.workers)}
                for p in validated)

    padding = sum(_padding_bytes(p) for p in validated)
    if as_json:
        meta = validated.plan.metadata
        head, tail = json.dumps({"num_shards": num_shards, "params": [],
                                 "padding_bytes": padding,
                                 "tensor_parallel": meta.get("tensor_parallel"),
                                 "experts": meta.get("experts")}).split("[]", 1)
        _out(head + "[", nl=False)
        _out_joined(map(json.dumps, rows()), ", ")
        _out("]" + tail)
        return
    _out_joined(_table_lines(
        ["parameter", "stored", "steps", "per worker", "bytes"],
        lambda: ([r["name"], f"{r['shape']} {r['dtype']}",
                  " > ".join(r["steps"]) or ("(replicated)" if r["workers"] is None else
                                             f"(whole on {_workers(r['workers'])})"),
                  f"{r['shard_shape']} {r['shard_dtype']}", _human(r["bytes_per_worker"])]
                 for r in rows()), right=(4,)), "\n")
    _out()
    _out(f"{len(validated.params)} tensors, {_per_worker(validated)}")
    if padding:
        total = sum(validated.bytes_per_worker(i) for i in range(num_shards))
        _out(f"zero padding: {_human(padding)} over all workers "
             f"({100 * padding / total:.1f}% of what they hold)")


def _workers(workers: list[int]) -> str:
    return ("worker " if len(workers) == 1 else "workers ") + ", ".join(map(str, workers))


def _print_reads(plans, validated, as_json: bool) -> None:
    """``inspect --reads``: every worker's read plan, and what it reads against what it keeps."""
    stored = sum(p.meta.nbytes for p in validated)
    if as_json:
        _out(json.dumps({"num_shards": validated.num_shards, "stored_bytes": stored,
                         "workers": [{"rank": rp.rank, "bytes_read": rp.bytes_read,
                                      "bytes_kept": rp.nbytes, **rp.to_json()}
                                     for rp in plans]}))
        return
    for rp in plans:
        _out(f"worker {rp.rank}: reads {_human(rp.bytes_read)} of {_human(stored)} stored, "
             f"keeps {_human(rp.nbytes)}")
        for line in rp.describe():
            _out(f"  {line}")


class _TablesHelp(click.Command):
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
    from .frontdoor.tables import planner_help

    return planner_help()


@cli.command(cls=_TablesHelp, tables=_planner_help)
@_shards_option
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True),
              help="Write the plan here (default: standard output).")
@click.option("--vocab-parallel", is_flag=True,
              help="Split embeddings and lm_head by vocabulary rows instead of replicating.")
@click.option("--no-pad", is_flag=True,
              help="Refuse an N the heads or MLP do not divide, instead of zero-padding.")
@_experts_option
@_ckpt_argument
def plan(num_shards: int, output: Optional[str], vocab_parallel: bool, no_pad: bool,
         experts: str, ckpt: str) -> None:
    """Write the plan (shard_info.json) for CKPT, checked for N workers.

    The model and its quantization are read from config.json (+ quantization_config or
    quantize_config.json), GGUF metadata or mlc-chat-config.json. The plan is written in
    expressions of num_shards, so it also serves every other N the model allows. For an N the
    heads or MLP do not divide, the plan zero-pads them (exactly) for that N.

    Mixture-of-experts: --experts tp splits every expert; --experts ep gives each worker
    whole experts, for this N only.
    """
    from .frontdoor import write_plan
    from .planners.decision import plan_decision
    from .readers import open_checkpoint

    with _reading():
        checkpoint = open_checkpoint(ckpt)
    with checkpoint, _reading():  # the planners read config files: unreadable ones are input
        # one pass: the plan that fits N, padded for N, or the refusal naming the constraint
        # N breaks and the N that work (raised here, printed by _Group)
        decision = plan_decision(checkpoint, num_shards, vocab_parallel=vocab_parallel,
                                 pad=not no_pad, experts=experts)
        info, summary, valid = decision.plan(), decision.summary, decision.valid
    try:
        text = write_plan(info, output)
    except OSError as exc:
        raise OutputFailed(exc, quote(output)) from None
    if not output:
        _out(text, nl=False)
    fits = ", ".join(map(str, valid)) or "none"
    if not valid.complete:  # a plan too large to try every N: say how far the list goes
        fits += f" (tried N up to {valid.tried} only)"
    scope = (f"for N={num_shards} only; unpadded plans fit N in {fits}"
             if decision.kind == "padded" else f"valid for N in {fits}")
    if experts == "ep":
        scope = f"for N={num_shards} only (whole experts are placed on its workers)"
    _note(f"{summary}; {scope}{f' (written to {output})' if output else ''}")


@cli.command()
@_shards_option
@_ckpt_argument
@click.option("--prompt", "-p", required=True, help="The text to continue (or, with --chat, "
              "the user's message).")
@click.option("--max-new-tokens", type=click.IntRange(min=1, max=1 << 16), default=32,
              show_default=True)
@click.option("--chat/--no-chat", default=True, show_default=True,
              help="Wrap the prompt in the checkpoint's chat template (where it has one), or "
                   "continue the raw text.")
@_session_option
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              default="float32", show_default=True,
              help="The dtype weights are dequantized to and the model runs in.")
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0)
@click.option("--top-k", type=click.IntRange(min=0), default=0)
@click.option("--seed", type=int, default=0)
@click.option("--check", is_flag=True,
              help="Also run transformers' own unsharded model on the prompt and the "
                   "generated text, and print the largest logit difference.")
@_experts_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def run(num_shards: int, ckpt: str, prompt: str, max_new_tokens: int, chat: bool,
        session_kind: str, dtype: str, sample: bool, temperature: float, top_k: int,
        seed: int, check: bool, experts: str, as_json: bool) -> None:
    """Generate text with CKPT split over N workers: transformers' own model on every worker,
    built from its shards (needs the hf extra: pip install "shardload[hf]").

    Prints the text and tokens per second; --check compares the logits with the unsharded
    model's. One progress bar on stderr (where it is a terminal, and not with --json) covers
    the start: imports, tokenizer, loading, building, the first token.
    """
    from tqdm.auto import tqdm

    # one bar for the whole start, each stage a span of it, sized by where SmolLM2's start at
    # N=3 spends its time (importing transformers is most of "tokenizer" and "loading")
    spans = {"importing": (0, 15), "tokenizer": (15, 40), "load": (40, 55),
             "build": (55, 92), "first token": (92, 100)}
    names = {"load": "loading", "build": "building"}
    bar = tqdm(total=100, leave=False, disable=True if as_json else None,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")

    shown = [""]

    def show(stage: str, done: int = 0, total: int = 1) -> None:
        low, high = spans[stage]
        if shown[0] != stage:
            shown[0] = stage
            bar.set_description_str(names.get(stage, stage))
        # update() draws at most every tenth of a second: the workers report every piece
        bar.update(max(0, low + (high - low) * min(done, total) // max(total, 1) - bar.n))

    from .sources import is_object_url

    if check and is_object_url(ckpt):
        bar.close()
        raise BadInput("--check runs transformers' own model, which reads the whole "
                       f"checkpoint from a local file: copy {ckpt} to a folder first "
                       f"(aws s3 sync {ckpt} DIR), or leave out --check")
    opened = None
    try:
        show("importing")
        import torch

        try:
            from .hf import load_tp_model, text
        except ImportError:
            raise BadInput("shardload run needs transformers: pip install "
                           "\"shardload[hf]\"") from None

        session = _open_session(session_kind, num_shards, None, ())
        if not session.reports:
            bar.close()     # under torchrun, rank 0 shows the bar
        show("tokenizer")
        try:
            source = ckpt
            if is_object_url(ckpt):
                # opened once: headers by ranged GETs, the configs and tokenizer files into its
                # scratch folder, a GGUF's header (its vocabulary) into a sparse file there
                from .readers import open_checkpoint
                from .readers.objects import write_fetched_bytes

                opened = open_checkpoint(ckpt)
                write_fetched_bytes(opened)
                source = opened.path
            tokenizer = text.tokenizer(source)
        except ValueError as exc:
            session.close()
            raise BadInput(str(exc).replace(str(source), ckpt)) from None
        except BaseException:
            session.close()
            raise
        ids = text.prompt_ids(tokenizer, prompt, chat)
        torch_dtype = getattr(torch, dtype)
        with session:
            show("load")
            with _reading():
                model = load_tp_model(opened or ckpt, session, dtype=torch_dtype,
                                      experts=experts, progress=show)
            with model:
                show("first token")
                start = time.perf_counter()
                out = model.generate([ids], max_new_tokens, do_sample=sample,
                                     temperature=temperature, top_k=top_k, seed=seed,
                                     eos_token_id=tokenizer.eos_token_id,
                                     on_token=lambda count: bar.close())
                seconds = time.perf_counter() - start
                new = out[0, len(ids):].tolist()
                diff = (text.unsharded_difference(ckpt, model, out, torch_dtype) if check
                        else None)
    finally:
        bar.close()
        if opened is not None:
            opened.close()
    if not session.reports:
        return          # under torchrun, rank 0 reports
    text = tokenizer.decode(new, skip_special_tokens=True)
    rate = len(new) / seconds if seconds > 0 else float("inf")
    if as_json:
        _out(json.dumps({"text": text, "tokens": new, "seconds": seconds,
                         "tokens_per_s": rate, "num_shards": num_shards,
                         **({"max_abs_logit_diff": diff} if check else {})}))
        return
    _out(text)
    _note(f"{len(new)} tokens in {seconds:.2f} s ({rate:.1f} tokens/s) on {num_shards} "
          f"worker(s)")
    if check:
        _out(f"max_abs_logit_diff={diff:.3g}")


@cli.command()
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
              help="Import MODULE first. Repeatable.")
def funcs(plugins: tuple[str, ...]) -> None:
    """List the registered shard functions."""
    from .registry import list_shard_funcs, load_plugins

    load_plugins(plugins)
    entries = list_shard_funcs()
    _out(_table(["name", "array", "args", "description"],
                [[f.name, f.array, f.arity_text(), f.doc.replace("``", "")] for f in entries]))
    _out("Plans name these functions; add your own with @register_shard_func in a module "
         "passed as --plugin MODULE.")


def main() -> None:
    """Console-script entry point (also ``python -m shardload``)."""
    import faulthandler

    global _OWN_PROCESS
    _OWN_PROCESS = True
    # A shard function that segfaults a thread session takes the process with it; this at least
    # prints the Python stack of the crashing thread (the shard function's file, line and name).
    with contextlib.suppress(Exception):
        faulthandler.enable(all_threads=False)
    cli.main(prog_name="shardload")


if __name__ == "__main__":  # pragma: no cover
    main()
