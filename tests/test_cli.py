"""The ``shardload`` command line: output, exit codes and error messages.

Exit codes (``shardload/cli.py``): 0 ok, 1 load failure, 2 bad usage / plan / checkpoint,
130 Ctrl-C. Most tests drive ``shardload.cli.cli`` in-process with click's ``CliRunner``; the
few that need a fresh interpreter (``--help`` must not import torch, SIGINT) run a subprocess.

Expected byte counts and shapes are computed here from the safetensors header (parsed by hand)
and the plan, not with shardload's own reader or planner.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers.cli_runs import run_cli
from helpers.subprocesses import interrupt_once_started, subprocess_env
from safetensors.numpy import save_file

from shardload.cli import cli

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny_llama_q4"
PLUGIN = "helpers.cli_plugin_for_tests"  # tests/helpers: tests/ is on sys.path (pyproject.toml)
PLUGIN_FUNCS = ("tests.cli.boom", "tests.cli.slow")
BUILTINS = (
    "shardload.split",
    "shardload.split_segments",
    "shardload.replicate",
    "shardload.split_rebase",
)


# ----------------------------------------------------------------------------------------------
# helpers


def assert_ok(result) -> None:
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.exception is None, result.exception


def error_line(result, exit_code: int) -> str:
    """The one ``Error:`` line of a failed run, after checking the exit code and that no
    exception escaped (an escaped exception is what prints a traceback outside CliRunner)."""
    assert result.exit_code == exit_code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), (
        f"an exception escaped the CLI: {result.exception!r}"
    )
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    assert "Error:" not in result.stdout
    return lines[0]


def bad_input(result) -> str:
    return error_line(result, 2)


ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header of ``path`` (without ``__metadata__``) and where data starts."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def piece_shape(shape: tuple, steps: list, n: int) -> tuple:
    """What one worker keeps of a tensor of ``shape`` under the built-in functions."""
    if not steps:
        return tuple(shape)
    assert len(steps) == 1, "only one-step plans are modelled here"
    func, _out, *extra = steps[0]
    assert all(type(a) is int for a in extra), extra
    shape = list(shape)
    if func == "shardload.replicate":
        return tuple(shape)
    dim = extra[0] % len(shape)
    if func in ("shardload.split", "shardload.split_rebase"):
        assert shape[dim] % n == 0
        shape[dim] //= n
    elif func == "shardload.split_segments":
        segments = extra[1:]
        # each segment: size/N, or one unit when replicable units (< 0) are fewer than N (GQA)
        shape[dim] = sum(
            size // n if n <= abs(units) or units > 0 else size // -units
            for size, units in zip(segments[::2], segments[1::2])
        )
    else:
        raise AssertionError(f"not modelled: {func}")
    return tuple(shape)


def expected_pieces(ckpt_file: Path, plan_file: Path, n: int) -> dict[str, tuple[tuple, int]]:
    """``{name: (per-worker shape, per-worker bytes)}`` from the header and the plan."""
    header, _ = read_header(ckpt_file)
    plan = json.loads(plan_file.read_text())
    out = {}
    for name, entry in header.items():
        shape = piece_shape(tuple(entry["shape"]), plan.get(name, []), n)
        out[name] = (shape, math.prod(shape) * ITEMSIZE[entry["dtype"]])
    return out


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


# a small checkpoint: "a" split on dim 0, "b" replicated (not in the plan), "c" split on dim 1
SMALL_PLAN = {
    "a": [["shardload.split", [["num_shards", "8 // num_shards", 4], "float32"], 0]],
    "c": [["shardload.split", [["num_shards", 4, "6 // num_shards"], "float16"], 1]],
}


@pytest.fixture
def small(tmp_path) -> Path:
    """A folder with model.safetensors (3 tensors) and a symbolic shard_info.json."""
    folder = tmp_path / "small"
    folder.mkdir()
    save_file(
        {
            "a": np.arange(32, dtype=np.float32).reshape(8, 4),
            "b": np.arange(6, dtype=np.int32),
            "c": np.ones((4, 6), dtype=np.float16),
        },
        str(folder / "model.safetensors"),
    )
    write_json(folder / "shard_info.json", SMALL_PLAN)
    return folder


def plan_for(tmp_path: Path, plan: dict, name: str = "plan.json") -> Path:
    return write_json(tmp_path / name, plan)


@pytest.fixture
def plugin():
    """Make ``--plugin helpers.cli_plugin_for_tests`` register its functions in this test.

    The shared conftest restores the registry after every test while the module stays in
    sys.modules, so a second import would be a no-op: drop the module and its names before and
    after, so each test imports it afresh (and works with or without that conftest).
    """
    from shardload import registry

    package_name, _, module_name = PLUGIN.rpartition(".")

    def clean():
        sys.modules.pop(PLUGIN, None)
        package = sys.modules.get(package_name)
        if package is not None and hasattr(package, module_name):
            delattr(package, module_name)
        for name in PLUGIN_FUNCS:
            registry.unregister_shard_func(name)

    clean()
    yield PLUGIN
    clean()


# ----------------------------------------------------------------------------------------------
# load


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_load_example_prints_one_row_per_worker_and_a_total(n):
    result = run_cli("load", "--shards", n, EXAMPLE)
    assert_ok(result)
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if re.match(r"^\s*\d+\s", line)]
    assert [int(r[0]) for r in rows] == list(range(n)), result.stdout
    assert all(r[1:3] == ["cpu", "63"] for r in rows), rows
    assert re.match(rf"^loaded .+ onto {n} worker\(s\) in [0-9.]+ s ", lines[-1]), lines[-1]
    assert "loading" not in result.stdout  # the progress bar goes to stderr


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_load_json_bytes_match_the_checkpoint_and_plan(n):
    result = run_cli("load", "--shards", n, "--json", EXAMPLE)
    assert_ok(result)
    assert len(result.stdout.strip().splitlines()) == 1
    report = json.loads(result.stdout)
    assert isinstance(report, dict)
    assert report["num_shards"] == n
    assert report["seconds"] > 0
    pieces = expected_pieces(EXAMPLE / "model.safetensors", EXAMPLE / "shard_info.json", n)
    per_worker = sum(nbytes for _, nbytes in pieces.values())
    workers = report["workers"]
    assert [w["index"] for w in workers] == list(range(n))
    for w in workers:
        assert {"index", "device", "tensors", "bytes"} <= set(w)
        assert w["device"] == "cpu"
        assert w["tensors"] == len(pieces) == 63
        assert w["bytes"] == per_worker
    assert report["bytes_total"] == sum(w["bytes"] for w in workers) == n * per_worker


def test_load_json_small_checkpoint_split_and_replicated_bytes(small):
    result = run_cli("load", "-n", 2, "--json", small)
    assert_ok(result)
    report = json.loads(result.stdout)
    # a: 8x4 float32 = 128 B split -> 64; b: 6 int32 = 24 B replicated; c: 4x6 f16 = 48 -> 24
    assert [w["bytes"] for w in report["workers"]] == [64 + 24 + 24] * 2
    assert [w["tensors"] for w in report["workers"]] == [3, 3]
    assert report["bytes_total"] == 2 * 112


def test_load_explicit_replicate_counts_whole_tensor_per_worker(small, tmp_path):
    plan = plan_for(tmp_path, {"b": [["shardload.replicate", [["num_shards", 6], "int32"]]]})
    result = run_cli("load", "-n", 4, "--json", "--shard-info", plan, small)
    assert_ok(result)
    # nothing split: every worker holds all 128 + 24 + 48 bytes
    assert [w["bytes"] for w in json.loads(result.stdout)["workers"]] == [200] * 4


def test_load_quiet_prints_nothing(small):
    result = run_cli("load", "-n", 2, "--quiet", small)
    assert_ok(result)
    assert result.stdout == ""


def test_load_shard_info_elsewhere(tmp_path, small):
    ckpt = tmp_path / "bare"
    ckpt.mkdir()
    shutil.copy(small / "model.safetensors", ckpt / "model.safetensors")
    plan = tmp_path / "plans" / "mine.json"
    plan.parent.mkdir()
    shutil.copy(small / "shard_info.json", plan)
    for target in (ckpt, ckpt / "model.safetensors"):  # a folder or the file itself
        result = run_cli("load", "-n", 2, "--json", "--shard-info", plan, target)
        assert_ok(result)
        report = json.loads(result.stdout)
        assert report["shard_info"] == str(plan)
        assert [w["bytes"] for w in report["workers"]] == [112, 112]


def test_load_device_list_one_per_worker(small):
    result = run_cli("load", "-n", 2, "--device", "cpu,cpu", "--json", small)
    assert_ok(result)
    assert [w["device"] for w in json.loads(result.stdout)["workers"]] == ["cpu", "cpu"]


@pytest.mark.parametrize("n, devices", [(2, "cpu,cpu,cpu"), (4, "cpu,cpu")])
def test_load_device_list_of_wrong_length(n, devices):
    line = bad_input(run_cli("load", "-n", n, "--device", devices, EXAMPLE))
    assert f"{len(devices.split(','))} devices given for {n} workers" in line


@pytest.mark.parametrize("devices", ["gpu", "cpu,"])
def test_load_unparsable_device_is_bad_input(small, devices):
    bad_input(run_cli("load", "-n", 2, "--device", devices, small))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_is_said_in_the_callers_terms(small):
    # the session says it in Python's terms; the CLI, in its own flags
    from shardload import ThreadedSession

    with pytest.raises(ValueError) as info:
        ThreadedSession(2, device="cuda")
    assert "use device='cpu'" in str(info.value) and "--device" not in str(info.value)
    line = bad_input(run_cli("load", "-n", 2, "--device", "cuda", small))
    assert "use --device cpu" in line


# ----------------------------------------------------------------------------------------------
# bad input: exit 2, one Error: line, no traceback


def test_unknown_function_names_parameter_and_suggests(small, tmp_path):
    plan = plan_for(
        tmp_path, {"a": [["shardload.splt", [["num_shards", "8 // num_shards", 4], "float32"], 0]]}
    )
    for command in ("load", "validate", "inspect"):
        line = bad_input(run_cli(command, "-n", 2, "--shard-info", plan, small))
        assert "parameter 'a'" in line
        assert "unknown shard function 'shardload.splt'" in line
        assert "Did you mean 'shardload.split'" in line


def test_wrong_declared_shape(small, tmp_path):
    plan = plan_for(tmp_path, {"a": [["shardload.split", [[2, 4, 5], "float32"], 0]]})
    line = bad_input(run_cli("load", "-n", 2, "--shard-info", plan, small))
    assert "parameter 'a'" in line
    assert "declared output [2, 4, 5]" in line and "[2, 4, 4]" in line


def test_plan_not_json(small, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{"a": [')
    line = bad_input(run_cli("load", "-n", 2, "--shard-info", plan, small))
    assert str(plan) in line and "not valid JSON" in line


def test_plan_with_duplicate_keys(small, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(
        '{"a": [["shardload.split", [["num_shards", "8 // num_shards", 4], '
        '"float32"], 0]], "a": []}'
    )
    line = bad_input(run_cli("load", "-n", 2, "--shard-info", plan, small))
    assert "duplicate key 'a'" in line


def test_concrete_plan_for_another_n(small, tmp_path):
    plan = plan_for(tmp_path, {"a": [["shardload.split", [[4, 2, 4], "float32"], 0]]})
    line = bad_input(run_cli("load", "-n", 2, "--shard-info", plan, small))
    assert "num_shards=4" in line and "num_shards=2" in line
    assert "expressions of num_shards" in line
    # ... and for the N it was written for, it loads
    assert_ok(run_cli("load", "-n", 4, "--quiet", "--shard-info", plan, small))


def test_plan_key_not_in_checkpoint(small, tmp_path):
    plan = plan_for(tmp_path, {"zz": [["shardload.split", [["num_shards", 4], "float32"], 0]]})
    line = bad_input(run_cli("load", "-n", 2, "--shard-info", plan, small))
    assert "'zz'" in line and "no tensor named" in line


def _truncate_data(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _cut_inside_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _garbage_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\xff" * (len(data) - 8))


def _too_short(path: Path) -> None:
    path.write_bytes(b"\x01\x02\x03")


@pytest.mark.parametrize(
    "corrupt", [_truncate_data, _cut_inside_header, _garbage_header, _too_short]
)
def test_corrupt_safetensors_names_the_file(small, corrupt):
    target = small / "model.safetensors"
    corrupt(target)
    for command in ("load", "validate"):
        line = bad_input(run_cli(command, "-n", 2, small))
        assert str(target) in line


def test_missing_shard_info_and_config_says_what_to_pass(tmp_path, small):
    # without a plan the CLI plans from config.json; without that either, it says what to do
    (small / "shard_info.json").unlink()
    for target in (small, small / "model.safetensors"):
        line = bad_input(run_cli("load", "-n", 2, target))
        assert "--shard-info" in line and "config.json" in line
        assert str(target) in line


def test_shard_info_file_that_does_not_exist(small, tmp_path):
    missing = tmp_path / "nope.json"
    line = bad_input(run_cli("load", "-n", 2, "--shard-info", missing, small))
    assert str(missing) in line


@pytest.mark.parametrize("shards", ["0", "-1", "two"])
def test_bad_shards_value(small, shards):
    line = bad_input(run_cli("load", "--shards", shards, small))
    assert "--shards" in line


def test_missing_shards_option(small):
    line = bad_input(run_cli("load", small))
    assert "--shards" in line


def test_nonexistent_checkpoint(tmp_path):
    missing = tmp_path / "no_such_ckpt"
    for command in ("load", "validate", "inspect"):
        line = bad_input(run_cli(command, "-n", 2, missing))
        assert str(missing) in line


def test_plugin_that_does_not_exist(small):
    for args in (("load", "-n", 2, small), ("validate", "-n", 2, small), ("funcs",)):
        line = bad_input(run_cli(args[0], "--plugin", "no_such_module", *args[1:]))
        assert "no_such_module" in line


def _plugin_module(tmp_path: Path, monkeypatch, name: str, body: str) -> str:
    folder = tmp_path / "plugins"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


@pytest.mark.parametrize(
    "body",
    [
        "raise RuntimeError('plugin exploded')\n",
        "def f(:\n",
        """
    from shardload.registry import register_shard_func

    @register_shard_func("shardload.split")
    def split(input, dim, output):
        '''A second shardload.split.'''
    """,
    ],
    ids=["raises", "syntax-error", "duplicate-name"],
)
def test_plugin_that_fails_to_import(small, tmp_path, monkeypatch, body):
    name = _plugin_module(tmp_path, monkeypatch, "shardload_cli_broken_plugin", body)
    line = bad_input(run_cli("validate", "-n", 2, "--plugin", name, small))
    assert name in line


def test_example_with_three_shards(tmp_path):
    plan = str(EXAMPLE / "shard_info.json")  # the plan given is used as it is: 1, 2, 4, 8
    for command in ("load", "validate", "inspect"):
        line = bad_input(run_cli(command, "-n", 3, "--shard-info", plan, EXAMPLE))
        assert "3" in line and "does not divide" in line
        # the plan beside is the planner's: for 3 it gives way to the padded plan
        assert run_cli(command, "-n", 3, EXAMPLE).exit_code == 0


PLAN_INSTEAD = (
    f"{EXAMPLE / 'shard_info.json'} does not fit 3 workers (N that work (up to 64): "
    "1, 2, 4, 8): using the planner's zero-padded plan for 3 instead"
)


@pytest.mark.parametrize("command", ["load", "validate", "inspect"])
def test_the_plan_used_instead_of_the_one_beside_is_said_in_one_line(command):
    said = run_cli(command, "-n", 3, EXAMPLE)
    assert_ok(said)
    assert said.stderr.splitlines() == [PLAN_INSTEAD]
    assert PLAN_INSTEAD not in said.stdout
    fits = run_cli(command, "-n", 4, EXAMPLE)  # the plan beside fits 4: nothing to say
    assert_ok(fits)
    assert fits.stderr == ""


@pytest.mark.parametrize("args", [("load", "--quiet"), ("load", "--json"), ("inspect", "--json")])
def test_quiet_and_json_say_nothing_of_the_plan_on_stderr(args):
    result = run_cli(*args, "-n", 3, EXAMPLE)
    assert_ok(result)
    assert result.stderr == ""
    assert result.stdout == "" if "--quiet" in args else json.loads(result.stdout)


# ----------------------------------------------------------------------------------------------
# load failures: exit 1


def _boom_plan(tmp_path: Path) -> Path:
    return plan_for(
        tmp_path, {"a": [["tests.cli.boom", [["num_shards", "8 // num_shards", 4], "float32"], 0]]}
    )


@pytest.mark.parametrize("n", [1, 2])
def test_shard_function_that_raises_is_a_load_failure(small, tmp_path, plugin, n):
    result = run_cli(
        "load", "-n", n, "--plugin", plugin, "--shard-info", _boom_plan(tmp_path), small
    )
    line = error_line(result, 1)
    assert re.search(r"worker \d+ failed", line), line
    assert "parameter 'a'" in line
    assert "boom at load" in line
    assert "RuntimeError" in line


def test_load_failure_with_json_keeps_stdout_empty(small, tmp_path, plugin):
    result = run_cli(
        "load", "-n", 2, "--json", "--plugin", plugin, "--shard-info", _boom_plan(tmp_path), small
    )
    assert result.exit_code == 1 and result.stdout == ""
    error = json.loads(result.stderr)["error"]  # under --json, the error is JSON too
    assert error["type"] == "WorkerError" and "boom at load" in error["message"]


def test_plugin_function_loads_correctly(small, tmp_path, plugin, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module(plugin), "SLOW_SECONDS", 0.0)
    plan = plan_for(
        tmp_path, {"a": [["tests.cli.slow", [["num_shards", "8 // num_shards", 4], "float32"], 0]]}
    )
    result = run_cli("load", "-n", 4, "--json", "--plugin", plugin, "--shard-info", plan, small)
    assert_ok(result)
    # a: 128 B / 4, b and c replicated: 24 + 48
    assert [w["bytes"] for w in json.loads(result.stdout)["workers"]] == [32 + 24 + 48] * 4


# ----------------------------------------------------------------------------------------------
# validate


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_validate_example(n):
    result = run_cli("validate", "-n", n, EXAMPLE)
    assert_ok(result)
    assert result.stdout.startswith("ok: ")
    assert f"for {n} worker(s): 63 tensors" in result.stdout


def test_validate_bad_plan(small, tmp_path):
    plan = plan_for(tmp_path, {"a": [["shardload.split", [[2, 4, 5], "float32"], 0]]})
    line = bad_input(run_cli("validate", "-n", 2, "--shard-info", plan, small))
    assert "parameter 'a'" in line


def test_validate_reads_no_tensor_data(small, monkeypatch):
    target = small / "model.safetensors"
    _, data_start = read_header(target)
    raw = target.read_bytes()
    target.write_bytes(raw[:data_start] + os.urandom(len(raw) - data_start))  # header intact
    result = run_cli("validate", "-n", 2, small)
    assert_ok(result)
    assert result.stdout.startswith("ok: ")
    assert "3 tensors (2 sharded, 1 replicated), 112 B per worker" in result.stdout

    # and stronger: any attempt to read tensor data fails the run
    from shardload.readers.base import Checkpoint
    from shardload.readers.safetensors import SafetensorsCheckpoint

    def no_reads(*args, **kwargs):
        raise AssertionError("validate read tensor data")

    for cls in (Checkpoint, SafetensorsCheckpoint):
        monkeypatch.setattr(cls, "read", no_reads)
        monkeypatch.setattr(cls, "read_narrow", no_reads)
        monkeypatch.setattr(cls, "source_bytes", no_reads)  # what read plans copy from
    assert_ok(run_cli("validate", "-n", 2, small))
    assert_ok(run_cli("inspect", "-n", 2, small))
    assert run_cli("load", "-n", 2, "--quiet", small).exit_code == 1  # the patch does bite


def test_validate_does_not_run_shard_functions(small, tmp_path, plugin):
    result = run_cli(
        "validate", "-n", 2, "--plugin", plugin, "--shard-info", _boom_plan(tmp_path), small
    )
    assert_ok(result)
    assert result.stdout.startswith("ok: ")


# ----------------------------------------------------------------------------------------------
# inspect


def test_inspect_table_shows_per_worker_shapes():
    result = run_cli("inspect", "-n", 2, EXAMPLE)
    assert_ok(result)
    names = set(read_header(EXAMPLE / "model.safetensors")[0])
    rows = {
        line.split()[0]: line
        for line in result.stdout.splitlines()
        if line.split() and line.split()[0] in names
    }
    assert len(rows) == 63
    o_proj = rows["model.layers.0.self_attn.o_proj.qweight"]
    assert "[32, 256] int32" in o_proj and "[16, 256] int32" in o_proj  # split on dim 0
    assert "shardload.split" in o_proj
    assert "(replicated)" in rows["model.embed_tokens.weight"]
    assert re.search(r"^63 tensors, ", result.stdout, re.M)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_inspect_json_shard_shapes(n):
    result = run_cli("inspect", "-n", n, "--json", EXAMPLE)
    assert_ok(result)
    report = json.loads(result.stdout)
    assert report["num_shards"] == n
    pieces = expected_pieces(EXAMPLE / "model.safetensors", EXAMPLE / "shard_info.json", n)
    got = {p["name"]: (tuple(p["shard_shape"]), p["bytes_per_worker"]) for p in report["params"]}
    assert got == pieces


@pytest.mark.parametrize("n", [1, 2, 4])
def test_inspect_reads_shows_what_each_worker_reads(n):
    # per worker: the byte runs it copies, and in all exactly the bytes of its pieces (the
    # example's plan reads every piece straight from the file: no chain to compute)
    report = json.loads(run_cli("inspect", "-n", n, "--reads", "--json", EXAMPLE).stdout)
    pieces = expected_pieces(EXAMPLE / "model.safetensors", EXAMPLE / "shard_info.json", n)
    kept = sum(nbytes for _, nbytes in pieces.values())
    assert [w["rank"] for w in report["workers"]] == list(range(n))
    stored = report["stored_bytes"]
    for worker in report["workers"]:
        assert worker["bytes_read"] == worker["bytes_kept"] == kept
        assert {p["name"] for p in worker["pieces"]} == set(pieces)
        runs = [r for p in worker["pieces"] for r in p["runs"]]
        assert sum(r[2] * r[3] for r in runs) == kept  # nbytes x count
        assert all(src["file"].endswith("model.safetensors") for src in worker["sources"])
    if n > 1:
        assert kept < stored
    text = run_cli("inspect", "-n", n, "--reads", EXAMPLE)
    assert_ok(text)
    heads = [line for line in text.stdout.splitlines() if line.startswith("worker ")]
    assert len(heads) == n and all(" reads " in h and " keeps " in h for h in heads)
    assert re.search(r"o_proj\.qweight: read \d+ B: model\.safetensors\[\d+:\d+\]", text.stdout)


def test_inspect_json_small(small):
    result = run_cli("inspect", "-n", 2, "--json", small)
    assert_ok(result)
    params = {p["name"]: p for p in json.loads(result.stdout)["params"]}
    assert params["a"]["shard_shape"] == [4, 4] and params["a"]["steps"] == ["shardload.split"]
    assert params["b"]["shard_shape"] == [6] and params["b"]["steps"] == []
    assert params["c"]["shard_shape"] == [4, 3]


# ----------------------------------------------------------------------------------------------
# funcs


def _doc_line(func) -> str:
    """The docstring's first line, without reST ``literal`` markup (which funcs may drop)."""
    import inspect

    return inspect.getdoc(func).strip().splitlines()[0].replace("``", "")


def _func_rows(stdout: str) -> dict[str, str]:
    """funcs' table rows by function name, markup dropped."""
    return {
        line.split()[0]: line.replace("``", "").rstrip()
        for line in stdout.splitlines()
        if line.split() and "." in line.split()[0]
    }


def test_funcs_lists_builtins_with_their_docs():
    from shardload.shard_functions import builtin

    result = run_cli("funcs")
    assert_ok(result)
    rows = _func_rows(result.stdout)
    for name in BUILTINS:
        assert name in rows, result.stdout
        func = getattr(builtin, name.split(".", 1)[1])
        assert rows[name].endswith(_doc_line(func)), rows[name]


def test_funcs_lists_plugin_functions(plugin):
    result = run_cli("funcs", "--plugin", plugin)
    assert_ok(result)
    rows = _func_rows(result.stdout)
    module = sys.modules[PLUGIN]
    for name, func in (("tests.cli.boom", module.boom), ("tests.cli.slow", module.slow)):
        assert name in rows, result.stdout
        assert "numpy" in rows[name]
        assert rows[name].endswith(_doc_line(func)), rows[name]
    for name in BUILTINS:
        assert name in rows


# ----------------------------------------------------------------------------------------------
# subprocesses: a fresh interpreter


HELP_SCRIPT = """
import sys
from shardload.cli import cli
codes = []
for args in (["--help"], ["-h"], ["--version"], ["load", "--help"], ["validate", "--help"],
             ["inspect", "--help"], ["funcs", "--help"]):
    try:
        cli.main(args, prog_name="shardload")
    except SystemExit as exc:
        codes.append(exc.code)
print("CODES", codes)
print("TORCH", "torch" in sys.modules)
"""


def test_help_does_not_import_torch():
    proc = subprocess.run(
        [sys.executable, "-c", HELP_SCRIPT],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "CODES [0, 0, 0, 0, 0, 0, 0]" in proc.stdout
    assert "TORCH False" in proc.stdout
    assert "Usage: shardload [OPTIONS] COMMAND" in proc.stdout


PLANNING_SCRIPT = """
import sys
from shardload.cli import cli
codes = []
for args in sys.argv[1:]:
    try:
        cli.main(args.split("|"), prog_name="shardload")
    except SystemExit as exc:
        codes.append(exc.code)
print("CODES", codes)
print("TORCH", "torch" in sys.modules)
"""


def test_planning_commands_do_not_import_torch(tmp_path):
    """``validate``, ``plan`` and ``inspect`` (``--reads`` too) plan, bind and validate
    without torch (about 1.2 s of every such command): a GPTQ act-order checkpoint (the
    planner reads its ``g_idx``), compressed-tensors (its ``weight_shape``), padded for an N
    that does not divide the heads, one compressed-tensors itself wrote, and the example."""
    import transformers
    from helpers.compressed_tensors_tool import compress_w4a16
    from helpers.quantized_models import GQA, gptq, pack_quantized, write_model

    gptq_dir = write_model(str(tmp_path / "gptq"), GQA, gptq(4, 32, act_order=True)).folder
    ct_dir = write_model(str(tmp_path / "ct"), GQA, pack_quantized(4, 32, True)).folder
    # and one compressed-tensors wrote itself (its weight_shape tensors, its config)
    tool_dir = tmp_path / "ct-tool"
    compress_w4a16(
        tool_dir,
        transformers.LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
        ),
        symmetric=False,
    )
    runs = []
    for ckpt, n in (
        (gptq_dir, 2),
        (ct_dir, 3),
        (str(tool_dir), 2),
        (str(REPO / "examples" / "tiny_llama_q4"), 4),
    ):
        runs += [
            f"validate|-n|{n}|{ckpt}",
            f"inspect|-n|{n}|--reads|{ckpt}",
            f"plan|-n|{n}|{ckpt}|-o|{tmp_path / 'plan.json'}",
        ]
    proc = subprocess.run(
        [sys.executable, "-c", PLANNING_SCRIPT, *runs],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"CODES {[0] * len(runs)}" in proc.stdout, proc.stdout[-3000:] + proc.stderr
    assert "TORCH False" in proc.stdout


def test_console_script_help():
    exe = shutil.which("shardload")
    if exe is None:
        pytest.skip("the shardload console script is not on PATH")
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for command in ("load", "validate", "inspect", "funcs"):
        assert command in proc.stdout


def _slow_checkpoint(tmp_path: Path, count: int = 50) -> tuple[Path, Path]:
    ckpt = tmp_path / "slow"
    ckpt.mkdir()
    save_file(
        {f"t{k:02d}": np.full((4, 4), k, dtype=np.float32) for k in range(count)},
        str(ckpt / "model.safetensors"),
    )
    plan = write_json(
        tmp_path / "slow_plan.json",
        {
            f"t{k:02d}": [["tests.cli.slow", [["num_shards", "4 // num_shards", 4], "float32"], 0]]
            for k in range(count)
        },
    )
    return ckpt, plan


@pytest.mark.skipif(os.name != "posix", reason="SIGINT to a child process needs POSIX")
def test_ctrl_c_exits_130_with_one_line(tmp_path):
    ckpt, plan = _slow_checkpoint(tmp_path)  # 50 x 0.2 s: about 10 s if left alone
    started = tmp_path / "started"
    code, stdout, stderr, elapsed = interrupt_once_started(
        [
            sys.executable,
            "-m",
            "shardload",
            "load",
            "--shards",
            "2",
            "--plugin",
            PLUGIN,
            "--shard-info",
            str(plan),
            str(ckpt),
        ],
        started,
        subprocess_env(SHARDLOAD_TEST_STARTED=str(started)),
    )
    assert code == 130, (stdout, stderr)
    # wall time from the signal to the exit: measured 0.01 s here (0.05 s with both cores
    # busy). The bound was 10 s, the subprocess's own hang timeout and about the whole load's
    # time, so no slow exit could fail it; 2.5 s is 50 times the need and a quarter of that
    assert elapsed < 2.5
    assert "Interrupted" in stderr
    assert "Traceback" not in stderr + stdout
    assert "worker" not in stdout  # no table: the load did not finish


def test_under_json_an_error_is_one_json_object_on_stderr(tmp_path):
    for args, kind in (
        (
            [
                "load",
                "--shards",
                "3",
                "--json",
                "--shard-info",
                str(EXAMPLE / "shard_info.json"),
                str(EXAMPLE),
            ],
            "PlanError",
        ),
        (["inspect", "--shards", "2", "--json", "--bogus", str(EXAMPLE)], "NoSuchOption"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "shardload", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=subprocess_env(),
            timeout=120,
        )
        assert proc.returncode == 2 and proc.stdout == ""
        error = json.loads(proc.stderr)["error"]
        assert error["type"] == kind and error["exit_code"] == 2 and error["message"]


def test_help_is_made_from_the_tables():
    from shardload.formats import list_formats
    from shardload.planners.architectures import GGUF_ARCHITECTURES

    top = CliRunner().invoke(cli, ["--help"]).output
    assert "shardload run" in top and "  run " in top
    plan = " ".join(CliRunner().invoke(cli, ["plan", "--help"]).output.split())
    for arch in GGUF_ARCHITECTURES:  # gpt-oss too, which the hand-written list lacked
        assert arch in plan
    for fmt in list_formats():
        assert fmt.name in plan
    load = " ".join(CliRunner().invoke(cli, ["load", "--help"]).output.split())
    assert 'The "read" column is the checkpoint bytes each worker read' in load
    assert "thread: threads of this process" in load


def test_run_without_a_tokenizer_says_so_in_one_line():
    result = run_cli("run", "--shards", 2, EXAMPLE, "--prompt", "hi")
    line = error_line(result, 2)
    assert "has no tokenizer transformers can read" in line and "\n" not in line
    assert line.endswith("or a GGUF file's vocabulary)")


@pytest.mark.parametrize("given", ["abc", "0", "-3", "1.5", "99999"])
def test_shards_that_is_not_a_number_of_workers_says_what_shards_takes(given):
    line = error_line(run_cli("load", "--shards", given, EXAMPLE), 2)
    assert line == (
        f"Error: --shards: '{given}' is not a number of workers; give a whole "
        "number from 1 to 4096 (e.g. --shards 4) (see 'shardload load --help')"
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["load", "--bogus", EXAMPLE],
            "Error: no such option '--bogus' (see 'shardload load --help')",
        ),
        (["load", "--shards", 2], "Error: missing argument 'CKPT' (see 'shardload load --help')"),
        (
            ["load", EXAMPLE],
            "Error: missing option '--shards' / '-n' (see 'shardload load --help')",
        ),
        (["nosuch"], "Error: no such command 'nosuch' (see 'shardload --help')"),
        (
            ["load", "--shards", 2, "no/such/folder"],
            "Error: CKPT: Path 'no/such/folder' does not exist (see 'shardload load --help')",
        ),
        (
            ["plan", "--shards", 2, "--experts", "xx", EXAMPLE],
            "Error: --experts: 'xx' is not one of 'tp', 'ep' (see 'shardload plan --help')",
        ),
        (
            ["load", "--shards", 2, "--staging-buffers", 1, EXAMPLE],
            "Error: --staging-buffers: 1 is not in the range 2<=x<=64 "
            "(see 'shardload load --help')",
        ),
    ],
)
def test_a_usage_error_is_one_line_in_the_voice_of_the_others(args, says):
    """click's usage banner (``Usage: ...``, ``Try ...``, a blank line) is not printed: the
    error is one line, naming the option and where every option is listed."""
    result = run_cli(*args)
    assert error_line(result, 2) == says
    assert result.stderr.strip() == says and result.stdout == ""
    as_json = run_cli(*args[:1], "--json", *args[1:]) if args[0] != "nosuch" else None
    if as_json is not None and args[0] == "load":
        error = json.loads(as_json.stderr)["error"]
        assert error["message"] == says[len("Error: ") :] and error["exit_code"] == 2


def test_plan_result_on_stdout_commentary_on_stderr(tmp_path):
    out = tmp_path / "plan.json"
    written = run_cli("plan", "--shards", 2, EXAMPLE, "-o", out)
    assert_ok(written)
    # with -o the summary is the result; without, the plan is, and the summary is commentary
    assert "valid for N in" in written.stdout and f"(written to {out})" in written.stdout
    assert written.stderr == ""
    piped = run_cli("plan", "--shards", 2, EXAMPLE)
    assert_ok(piped)
    assert json.loads(piped.stdout) == json.loads(out.read_text())
    assert "valid for N in" in piped.stderr and "written to" not in piped.stderr


def test_json_anywhere_among_the_options_makes_a_usage_error_json():
    result = run_cli("inspect", "--shards", 2, "--bogus", "--json", EXAMPLE)
    assert result.exit_code == 2 and result.stdout == ""
    assert json.loads(result.stderr)["error"]["type"] == "NoSuchOption"
    # a prompt that reads "--json" is a value, not the flag
    result = run_cli("run", "--shards", "x", EXAMPLE, "--prompt", "--json")
    assert result.exit_code == 2 and result.stderr.startswith("Error: --shards: 'x' is not")


@pytest.mark.skipif(os.name != "posix", reason="SIGINT to a child process needs POSIX")
def test_ctrl_c_while_importing_ends_at_once_with_130():
    # 0.3 s in, the command is importing torch and the loader: nothing to clean up yet
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardload", "load", "--shards", "2", "--quiet", str(EXAMPLE)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert stderr.strip() == "Interrupted." and stdout == ""


def test_an_interrupt_swallowed_after_work_started_is_raised_at_the_next_phase(monkeypatch):
    from shardload.cli import interrupts

    interrupts.check()  # nothing recorded: nothing raised
    monkeypatch.setattr(interrupts, "_interrupted", True)  # as CPython's "Exception ignored"
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()
