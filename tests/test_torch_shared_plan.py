"""One plan per job (issue 40, goal 2): under torchrun rank 0 plans and the other ranks receive
its plan, each validating it against its own checkpoint; a refusal on rank 0 is every rank's.

The two-rank jobs are ``tests/helpers/plan_job.py``; the rest checks, in this process, what the
ranks send each other."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers.paths import EXAMPLE
from helpers.subprocesses import torchrun
from safetensors.torch import load_file

from shardload import ArrayCheckpoint, ThreadedSession, load_sharded, open_checkpoint
from shardload.errors import (
    EXPERTS_TP,
    FormatError,
    PlanError,
    ShardloadError,
    StorageError,
    WorkerError,
    cli_text,
    mention,
)
from shardload.frontdoor import plan_once, resolve_plan, shared_plan

PLAN_JOB = ("-m", "helpers.plan_job")  # tests/helpers/plan_job.py, found on PYTHONPATH


def digest(validated) -> str:
    return hashlib.sha256(json.dumps(validated.plan.to_dict(), sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def unplanned(tmp_path_factory) -> str:
    """The example checkpoint without its ``shard_info.json``: the planner makes its plan."""
    folder = tmp_path_factory.mktemp("unplanned")
    for name in os.listdir(EXAMPLE):
        if name != "shard_info.json" and not name.endswith(".py"):
            shutil.copy(os.path.join(EXAMPLE, name), folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def plan_job(unplanned, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan_job")
    job = torchrun(*PLAN_JOB, "plan", unplanned, str(out))
    assert job.returncode == 0, job.stderr[-3000:]
    return (
        [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)],
        [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)],
    )


def test_only_rank_0_runs_the_planner(plan_job):
    (rank0, rank1), _ = plan_job
    assert rank0["plan_once"]["planner_calls"] == 1 and rank1["plan_once"]["planner_calls"] == 0
    assert rank0["planner_calls"] == 2 and rank1["planner_calls"] == 0  # and in load_sharded
    assert (rank0["plan_once"]["from"], rank1["plan_once"]["from"]) == ("planned", "rank 0")
    # the load's statistics say, on every rank, where each rank's plan came from
    for report in (rank0, rank1):
        planning = report["stats"]["planning_per_worker"]
        assert [p["from"] for p in planning] == ["planned", "rank 0"]
        assert all(p["seconds"] >= p["work_seconds"] >= 0 for p in planning)
    assert rank0["stats"]["planning_per_worker"] == rank1["stats"]["planning_per_worker"]


def test_every_rank_holds_the_plan_made_here(plan_job, unplanned):
    (rank0, rank1), _ = plan_job
    here = resolve_plan(open_checkpoint(unplanned), 2)
    for report in (rank0, rank1):
        seen = report["plan_once"]
        assert seen["digest"] == report["digest"] == digest(here.validated)
        assert (seen["origin"], seen["source"], seen["note"]) == (
            here.origin,
            here.source,
            here.note,
        )
        assert (seen["kind"], seen["summary"], seen["valid"]) == (
            here.decision.kind,
            str(here.decision.summary),
            list(here.decision.valid),
        )


def test_the_pieces_are_those_of_a_plan_made_here(plan_job, unplanned):
    _, shards = plan_job
    with ThreadedSession(2) as sess:
        reference = load_sharded(unplanned, None, sess, progress=False)
    for rank in range(2):
        assert set(shards[rank]) == set(reference.names)
        for name in reference.names:
            mine, want = shards[rank][name], reference.shard(name, rank)
            assert mine.dtype == want.dtype and torch.equal(mine, want), (rank, name)


@pytest.mark.slow
def test_a_refusal_on_rank_0_is_raised_on_every_rank(unplanned, tmp_path):
    job = torchrun(*PLAN_JOB, "refuse", unplanned, str(tmp_path))
    assert job.returncode == 0, job.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (rank0["planner_calls"], rank1["planner_calls"]) == (1, 0)
    assert rank0["raised"] == rank1["raised"] == "PlanError"
    assert rank0["message"] == rank1["message"] and "no routed experts" in rank0["message"]
    assert rank0["cli"] == rank1["cli"] and "--experts tp" in rank1["cli"]


# ---- what the ranks send each other, in this process -------------------------------------------


def sent_and_rebuilt(exc: BaseException, planning: bool = True) -> BaseException:
    """``exc`` as rank 0 sends it and another rank raises it."""
    status = json.loads(
        json.dumps({"ok": False, "planning": planning, "error": shared_plan._error_json(exc)})
    )
    return shared_plan._rebuilt(shared_plan._read_status(status), "planning the load")


@pytest.mark.parametrize(
    "exc",
    [
        mention(PlanError("cannot be split", source="<plan for x>", param="w", step=0), EXPERTS_TP),
        FormatError("truncated", file="model.safetensors", tensor="w"),
        StorageError("no such key; check the URL", url="s3://b/k", byte_range=(0, 8), usage=True),
        ShardloadError("something else"),
    ],
)
def test_a_shardload_error_is_rebuilt_the_same(exc):
    rebuilt = sent_and_rebuilt(exc)
    assert type(rebuilt) is type(exc) and str(rebuilt) == str(exc)
    assert cli_text(rebuilt) == cli_text(exc)


def test_other_failures_name_rank_0():
    # not a shardload error, or rank 0 failed before planning: as a collective reports them
    for exc, planning in ((OSError("disk gone"), True), (PlanError("bad"), False)):
        rebuilt = sent_and_rebuilt(exc, planning)
        assert isinstance(rebuilt, WorkerError) and rebuilt.workers == (0,)
        assert str(exc) in str(rebuilt) and "planning the load" in str(rebuilt)


@pytest.mark.parametrize(
    "status",
    [
        None,
        [],
        {"ok": 1},
        {"ok": True, "shared": True, "plan_bytes": -1},
        {"ok": True, "shared": True, "plan_bytes": 2**40},
        {"ok": True, "shared": True, "plan_bytes": True},
        {"ok": False, "planning": True, "error": {"type": "X"}},
    ],
)
def test_a_malformed_status_is_refused(status):
    with pytest.raises(ShardloadError, match="rank 0's plan status is malformed"):
        shared_plan._read_status(status)


def test_the_plan_sent_is_the_plan_made():
    # expert parallel: a placement, and two parameters of one list of steps (sent once)
    split = [["shardload.split", [["num_shards", "4 // num_shards", 6], "float32"], 0]]
    plan = {
        "__metadata__": {"by": "hand"},
        "__placement__": {"num_shards": 2, "params": {"e0": [0], "e1": [1]}},
        "a": split,
        "b": split,
    }
    ckpt = ArrayCheckpoint(
        {
            "a": np.zeros((4, 6), np.float32),
            "b": np.ones((4, 6), np.float32),
            "e0": np.zeros((2, 2), np.float32),
            "e1": np.ones(2, np.float32),
        }
    )
    made = resolve_plan(ckpt, 2, plan).validated
    data = shared_plan._plan_bytes(made)
    assert len(json.loads(data)["chains"]) == 1
    info = shared_plan._plan_from_bytes(data, made.plan.source)
    sent = info.bind(2).validate(ckpt.metadata())
    assert sent.plan.to_dict() == made.plan.to_dict() and sent.plan.placement == made.plan.placement


@pytest.mark.parametrize(
    "data, error",
    [
        (b"not json", "not valid JSON"),
        (b'{"plan": {}, "chains": [], "params": {}, "plan": {}}', "not valid JSON"),  # repeated
        (b'{"plan": {}, "chains": [], "params": {}, "more": 1}', "other keys"),
        (b'{"plan": {"w": []}, "chains": [], "params": {}}', "not a plan"),
        (b'{"plan": {}, "chains": [], "params": {"w": 0}}', "parameter 'w'"),
        (b'{"plan": {}, "chains": [[]], "params": {"w": true}}', "parameter 'w'"),
        (
            b'{"plan": {}, "chains": [[]], "params": {"__metadata__": 0}}',
            "parameter '__metadata__'",
        ),
    ],
)
def test_a_malformed_plan_is_refused(data, error):
    with pytest.raises(ShardloadError, match=f"rank 0's plan is malformed.*{error}"):
        shared_plan._plan_from_bytes(data, None)


def test_the_steps_received_are_checked_as_a_plan_files_are():
    with pytest.raises(PlanError, match="parameter 'w'"):
        shared_plan._plan_from_bytes(
            b'{"plan": {}, "chains": [["x"]], "params": {"w": 0}}', "<plan>"
        )


def test_one_process_plans_for_its_workers_as_before():
    with ThreadedSession(2) as sess:
        job = plan_once(sess, EXAMPLE)
        sharded = load_sharded(EXAMPLE, None, sess, progress=False)
    assert job.plan_from == "planned" and job.resolved.origin == "beside"
    assert sharded.stats.planning_per_worker is None
