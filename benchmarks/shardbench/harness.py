"""What every entry script shares: the common flags (``--runs``, ``--json``, ``--dir``,
``--figures``), the repetitions' order, medians, the environment line, and the JSON file.

A script builds its parser with ``parser(__doc__)``, adds the common flags it has with
``add_common`` (each with the default and help it always had), its own flags itself, and then::

    bench = Bench("bench_x", args)      # prints the environment line
    ...                                 # its runs: rotated(methods, r), median(values)
    bench.finish(report)                # --json (with the header), --figures

The JSON a script writes is the object it always wrote, with one more key first, ``header``:
the benchmark's name, its command line, when it started, and the environment (``environment``:
CPUs, memory, kernel, Python, torch, shardload's version and commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

#: the repository (benchmarks/..)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ==== flags =====================================================================================


def parser(doc: str | None, paragraph: int = 0) -> argparse.ArgumentParser:
    """The script's parser, described by paragraph ``paragraph`` of its docstring."""
    return argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[paragraph],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def default_dir() -> str:
    """Where the synthetic checkpoints are cached: ``$XDG_CACHE_HOME/shardload-bench``
    (default ``~/.cache/shardload-bench``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardload-bench")


def add_common(
    ap: argparse.ArgumentParser,
    *,
    runs: int | None = None,
    runs_help: str = "repetitions; medians reported",
    json_help: str = "write the results as JSON here",
    dir: bool = False,
    dir_help: str | None = None,
    figures: bool = False,
) -> argparse.ArgumentParser:
    """The common flags: ``--runs`` (where ``runs`` gives its default), ``--json FILE``,
    ``--dir DIR`` (with ``dir``: where checkpoints are cached; None is ``default_dir()``) and
    ``--figures DIR`` (with ``figures``: the script draws PNGs there)."""
    if runs is not None:
        ap.add_argument("--runs", type=int, default=runs, help=runs_help)
    ap.add_argument("--json", metavar="FILE", default=None, help=json_help)
    if dir:
        ap.add_argument(
            "--dir",
            metavar="DIR",
            default=None,
            help=dir_help or f"where the checkpoint is cached (default {default_dir()})",
        )
    if figures:
        ap.add_argument(
            "--figures",
            metavar="DIR",
            default=None,
            help="also draw the results as PNG files in DIR (matplotlib)",
        )
    return ap


def check_runs(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if getattr(args, "runs", 1) < 1:
        ap.error("--runs must be at least 1")


def int_list(ap: argparse.ArgumentParser, text: str, flag: str = "--shards") -> list[int]:
    """``"1,2,4"`` as ``[1, 2, 4]``, positive; a parser error otherwise."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        ap.error(f"{flag} takes integers like 1,2,4,8, got {text!r}")
    if not values or any(n < 1 for n in values):
        ap.error(f"{flag} needs positive counts")
    return values


# ==== repetitions, medians ======================================================================


def rotated(methods: Sequence[str], r: int) -> list[str]:
    """``methods`` rotated by ``r``: repetition ``r``'s order, so that no method always runs
    first or right after the same neighbour."""
    methods = list(methods)
    if not methods:
        return methods
    k = r % len(methods)
    return methods[k:] + methods[:k]


def rounds(methods: Sequence[str], runs: int) -> Iterable[tuple[int, str]]:
    """(repetition, method) for ``runs`` repetitions of ``methods``, each rotated."""
    for r in range(runs):
        for method in rotated(methods, r):
            yield r, method


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ==== the environment ===========================================================================


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", REPO, *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment() -> dict:
    """The machine and the software: CPUs, memory, kernel, Python, torch, shardload (its
    version, where it was imported from, the checkout's commit and whether it has changes)."""
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        pass
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    try:
        import shardload

        shardload_version, shardload_path = (
            shardload.__version__,
            os.path.dirname(os.path.abspath(shardload.__file__)),
        )
    except ImportError:
        shardload_version = shardload_path = None
    commit = _git("rev-parse", "--short=12", "HEAD")
    dirty = None if commit is None else bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "shardload": shardload_version,
        "shardload_path": shardload_path,
        "commit": commit,
        "dirty": dirty,
    }


def environment_line(env: dict) -> str:
    """``env`` in one line."""
    mem = "?" if env["memory_bytes"] is None else f"{env['memory_bytes'] / 2**30:.1f} GiB"
    commit = (
        "no commit"
        if env["commit"] is None
        else env["commit"] + ("+changes" if env["dirty"] else "")
    )
    return (
        f"environment: {env['cpus']} CPUs, {mem} memory, {env['machine']}, Linux "
        f"{env['kernel']}, python {env['python']}, torch {env['torch']}, shardload "
        f"{env['shardload']} ({commit})"
    )


# ==== the JSON ==================================================================================


def write_json(path: str | None, report: dict, header: dict | None = None) -> None:
    """``report`` to ``path`` (nothing without one), whole or not at all; ``header`` first."""
    if not path:
        return
    data = report if header is None else {"header": header, **report}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


class Bench:
    """One run of an entry script: its name, its parsed flags, its environment (printed as one
    line at the start: ``file``, default stdout), and its end (``finish``)."""

    def __init__(self, name: str, args: argparse.Namespace, file: Any = None, quiet: bool = False):
        self.name, self.args = name, args
        self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.environment = environment()
        if not quiet:
            print(environment_line(self.environment), file=file or sys.stdout, flush=True)

    def header(self) -> dict:
        return {
            "benchmark": self.name,
            "command": [os.path.basename(sys.argv[0]), *sys.argv[1:]],
            "started": self.started,
            "environment": self.environment,
        }

    def write(self, report: dict) -> None:
        """``report`` to ``--json``, if given, with the header."""
        write_json(getattr(self.args, "json", None), report, self.header())

    def draw(self, report: dict, draw: Callable[[dict, str], list[str]] | None = None) -> list[str]:
        """The figures of ``report`` in ``--figures``, if given: the PNGs' paths."""
        out = getattr(self.args, "figures", None)
        if not out:
            return []
        from . import figures

        paths = (draw or figures.draw)({"header": self.header(), **report}, out)
        for p in paths:
            print(f"drew {p}", file=sys.stderr, flush=True)
        return paths

    def finish(self, report: dict, draw: Callable[[dict, str], list[str]] | None = None) -> None:
        """The end of a run: the JSON (``--json``), then the figures (``--figures``)."""
        self.write(report)
        self.draw(report, draw)
