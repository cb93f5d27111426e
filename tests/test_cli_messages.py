"""Core messages name the Python API, never a command-line flag; the CLI says the flags.

A core message that tells the user to change a setting writes it as the Python API spells it
and records it (``errors.mention``); the CLI prints every ``ShardloadError`` through
``errors.cli_text``, which says the flag instead. Each message here is checked both ways: as
``str(exc)`` from the API and as the CLI's one ``Error:`` line.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shardload import PlanError, ShardInfo, UnknownShardFunctionError, open_checkpoint
from shardload.cli import cli
from shardload.errors import SHARD_INFO, cli_text
from shardload.planners import plan_for


def error_line(args) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def write_plan(tmp_path, plan: dict):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_replan_for_another_n(small_ckpt, tmp_path):
    path = write_plan(tmp_path, {"a": [["shardload.split", [[4, 2, 4], "float32"], 0]]})
    with pytest.raises(PlanError) as err:
        ShardInfo.load(path).bind(2)
    python = str(err.value)
    assert "Re-plan with `plan_for(checkpoint, num_shards=2)`" in python
    assert "shardload plan" not in python and "--shards" not in python
    line = error_line(["load", "-n", 2, "--shard-info", path, small_ckpt])
    assert "Re-plan with `shardload plan --shards 2`" in line and "plan_for(" not in line
    assert line == f"Error: {cli_text(err.value)}"


def test_no_plan_and_no_config(small_ckpt):
    with pytest.raises(PlanError) as err:
        plan_for(str(small_ckpt))
    python = str(err.value)
    assert f"pass a plan ({SHARD_INFO.python}, or a shard_info.json beside" in python
    assert "--shard-info" not in python
    line = error_line(["load", "-n", 2, small_ckpt])
    assert "pass a plan (--shard-info FILE, or a shard_info.json beside" in line
    assert SHARD_INFO.python not in line
    assert line == f"Error: {cli_text(err.value)}"


def test_unknown_shard_function(small_ckpt, tmp_path):
    plan = {"a": [["shardload.splt", [["num_shards", "8 // num_shards", 4], "float32"], 0]]}
    path = write_plan(tmp_path, plan)
    with pytest.raises(UnknownShardFunctionError) as err:
        ShardInfo.load(path).bind(2).validate(open_checkpoint(small_ckpt).metadata())
    python = str(err.value)
    assert "plugins=[MODULE, ...]" in python and "list_shard_funcs() lists" in python
    assert "--plugin" not in python and "shardload funcs" not in python
    line = error_line(["validate", "-n", 2, "--shard-info", path, small_ckpt])
    assert "(--plugin MODULE)" in line and "`shardload funcs` lists" in line
    assert "plugins=[" not in line and "list_shard_funcs()" not in line
    # no N would fit this plan: it is not re-worded as a problem of the number of workers
    assert "unknown shard function 'shardload.splt'" in line
    assert "cannot be split over" not in line and "N that work" not in line


def test_a_problem_of_n_lists_the_n_that_work_and_keeps_the_settings(small_ckpt, tmp_path):
    plan = {"a": [["shardload.split", [["num_shards", "8 // num_shards", 4], "float32"], 0]]}
    path = write_plan(tmp_path, plan)
    line = error_line(["validate", "-n", 3, "--shard-info", path, small_ckpt])
    assert "cannot be split over 3 workers" in line and "N that work (up to 64): 1, 2, 4, 8" in line
