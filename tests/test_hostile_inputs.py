"""Every hostile input gets the documented answer: the mutation corpus
``helpers/hostile_corpus.py``.

Each case is run through ``shardload validate``, ``inspect`` and ``load`` (click's CliRunner, in
this process) and through the Python API, and must answer as documented:

* ``refused``: exit 2 with one ``Error:`` line (click's usage errors add their usage lines, which
  is fine) that names what the case says it must (the file, the key), never a traceback; the API
  raises ``FormatError`` or ``PlanError``;
* ``ok``: exit 0, and the API loads.

Every command must also answer within the case's bound of CPU time (this process's, all threads:
a busy machine stretches wall time, not work), must not hang (a wall-clock watchdog,
``HANG_FACTOR`` times the CPU bound, cuts it with SIGALRM and fails), and must grow this
process's peak resident memory by less than the case's bound (measured by resetting the
kernel's high-water mark, ``/proc/self/clear_refs``, before each command).
"""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.hostile_corpus import CASES, Case, Target

from shardload import (
    FormatError,
    PlanError,
    ShardInfo,
    ThreadedSession,
    load_sharded,
    open_checkpoint,
)
from shardload.cli import cli
from shardload.planners import plan_for

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    return int(match.group(1)) if match else 0


#: the hang watchdog's wall-clock limit, in multiples of a case's CPU bound: wide, so that two
#: busy cores (wall time two to three times the CPU time) never trip it on a case that works
HANG_FACTOR = 5


@contextmanager
def _bounded(case: Case, command: str):
    """Fail the command if it uses over ``case.time_s`` of CPU, hangs (``HANG_FACTOR`` times that
    in wall time), or grows peak RSS by ``case.mem_mb``."""
    hang_s = HANG_FACTOR * case.time_s

    def hung(signum, frame):
        raise TimeoutError(f"{case.id}: {command} did not answer within {hang_s} s")

    measure_mem = _CLEAR_REFS.exists()
    if measure_mem:
        try:
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
        except OSError:
            measure_mem = False
    before = _kib("VmRSS")
    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    start = time.process_time()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    cpu = time.process_time() - start
    assert cpu < case.time_s, (
        f"{case.id}: {command} took {cpu:.1f} s of CPU (bound {case.time_s} s)"
    )
    if measure_mem:
        grown_mb = (_kib("VmHWM") - before) / 1024
        assert grown_mb < case.mem_mb, (
            f"{case.id}: {command} grew peak memory by {grown_mb:.0f} MB (bound {case.mem_mb} MB)"
        )


def _cli_args(command: str, target: Target) -> list[str]:
    args = [command, "--shards", str(target.shards)]
    if target.plan:
        args += ["--shard-info", target.plan]
    if command == "load":
        args += ["--quiet"]
    return args + [target.ckpt]


def _check_cli(case: Case, command: str, target: Target) -> None:
    with _bounded(case, command):
        result = CliRunner().invoke(cli, _cli_args(command, target))
    stderr = result.stderr
    where = f"{case.id}: shardload {command}: exit {result.exit_code}\n{result.output}"
    assert "Traceback" not in result.output, where
    if case.expect == "ok":
        assert result.exit_code == 0, where
        return
    assert result.exit_code == 2, where
    assert isinstance(result.exception, SystemExit), where  # not an escaped exception
    errors = [line for line in stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], where
    # every line a person reads fits a terminal's scrollback: nothing echoed whole
    assert len(errors[0]) < 2000, f"{case.id}: {len(errors[0])}-character error line"
    for fragment in case.mentions:
        assert fragment in errors[0], f"{where}\nexpected {fragment!r} in the error"


def _check_api(case: Case, target: Target) -> None:
    def load() -> None:
        with open_checkpoint(target.ckpt) as ckpt:
            if target.plan:
                info = ShardInfo.load(target.plan)
            else:
                beside = (
                    Path(ckpt.path if os.path.isdir(ckpt.path) else os.path.dirname(ckpt.path))
                    / "shard_info.json"
                )
                info = ShardInfo.load(beside) if beside.exists() else plan_for(ckpt, target.shards)
            validated = info.bind(target.shards).validate(ckpt.metadata())
            with ThreadedSession(target.shards) as session:
                sharded = load_sharded(ckpt, validated.plan, session, progress=False)
            assert len(sharded.names) == len(ckpt.metadata())

    with _bounded(case, "api"):
        if case.expect == "ok":
            load()
            return
        with pytest.raises((FormatError, PlanError)) as info:
            load()
    message = str(info.value)
    for fragment in case.mentions:
        assert fragment in message, f"{case.id}: api: expected {fragment!r} in {message!r}"


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * c.slow) for c in CASES]
)
def test_hostile_input_gets_the_documented_answer(case: Case, tmp_path: Path) -> None:
    folder = tmp_path / "case"
    folder.mkdir()
    target = case.build(folder)
    for command in case.commands:
        if command == "api":
            _check_api(case, target)
        else:
            _check_cli(case, command, target)


def test_corpus_covers_every_class_and_both_answers() -> None:
    """The corpus is not one-sided: legitimate inputs must load, or a harness that refuses
    everything would pass."""
    kinds = {c.klass for c in CASES}
    assert {
        "legitimate",
        "file-system layout",
        "config fields",
        "metadata vs tensors",
        "resource bombs",
        "plan contents",
        "GGUF header",
        "MLC index",
    } <= kinds
    assert sum(c.expect == "ok" for c in CASES) >= 10
    assert len(CASES) >= 200
