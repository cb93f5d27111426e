"""TorchDistributedSession under a real two-rank gloo job on loopback, started with torchrun;
and the proof that all three sessions give bit-identical shards."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.paths import EXAMPLE
from helpers.subprocesses import torchrun
from safetensors.torch import load_file

from shardload import (
    ProcessSession,
    ShardloadError,
    ThreadedSession,
    TorchDistributedSession,
    load_sharded,
)

PLAN = os.path.join(EXAMPLE, "shard_info.json")
DIST_JOB = ("-m", "helpers.dist_job")  # tests/helpers/dist_job.py, found on PYTHONPATH


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture(scope="module")
def rank_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    job = torchrun(*DIST_JOB, "example", str(out))
    assert job.returncode == 0, job.stderr[-3000:]
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)], [
        json.loads((out / f"rank{r}.json").read_text()) for r in range(2)
    ]


def test_two_rank_job_gets_each_ranks_own_shards(rank_shards):
    shards, reports = rank_shards
    with ThreadedSession(2) as sess:
        reference = load_sharded(EXAMPLE, PLAN, sess, progress=False)
    for rank in range(2):
        assert set(shards[rank]) == set(reference.names)
        for name in reference.names:
            assert same_bits(shards[rank][name], reference.shard(name, rank)), (rank, name)
    # every rank knows every rank's statistics after the load
    assert reports[0]["stats"]["bytes_per_worker"] == reports[1]["stats"]["bytes_per_worker"]
    assert reports[0]["stats"]["bytes_per_worker"] == reference.stats.bytes_per_worker


@pytest.mark.slow
def test_a_two_rank_job_stages_each_ranks_own_shards_the_same(rank_shards, tmp_path):
    """The ranks of a torchrun job run the staged pipeline too, each its own."""
    job = torchrun(*DIST_JOB, "staged", str(tmp_path))
    assert job.returncode == 0, job.stderr[-3000:]
    direct, _ = rank_shards
    for rank in range(2):
        staged = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert staged.keys() == direct[rank].keys()
        assert all(same_bits(staged[k], direct[rank][k]) for k in staged), rank
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())["stats"]
        ring = stats["staging_per_worker"][rank]
        assert ring["buffers"] == 2 and ring["bytes_staged"] == stats["bytes_read_per_worker"][rank]


def test_three_sessions_are_bit_identical(rank_shards):
    shards, _ = rank_shards
    with ThreadedSession(2) as t, ProcessSession(2) as p:
        threaded = load_sharded(EXAMPLE, PLAN, t, progress=False)
        processes = load_sharded(EXAMPLE, PLAN, p, progress=False)
        for name in threaded.names:
            for rank in range(2):
                a = threaded.shard(name, rank)
                assert same_bits(a, processes.shard(name, rank)), (name, rank)
                assert same_bits(a, shards[rank][name]), (name, rank)


@pytest.mark.slow
def test_a_failure_on_one_rank_is_reported_on_every_rank(tmp_path):
    job = torchrun(*DIST_JOB, "fail", str(tmp_path))
    assert job.returncode == 0, job.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank1["raised"] == "PlanError" and "no.such.tensor" in rank1["message"]
    assert rank0["raised"] == "WorkerError" and rank0["workers"] == [1]
    assert "worker 1 failed" in rank0["message"] and "no.such.tensor" in rank0["message"]


@pytest.mark.slow
def test_cli_under_torchrun(tmp_path):
    job = torchrun(
        "-m", "shardload", "load", "--session", "torch", "--shards", "2", "--json", EXAMPLE
    )
    assert job.returncode == 0, job.stderr[-3000:]
    lines = [line for line in job.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 speaks for both
    report = json.loads(lines[0])
    assert report["num_shards"] == 2 and len(report["workers"]) == 2
    # one plan per job: rank 0 resolved it (the plan beside the example), rank 1 received it
    assert [w["planning"]["from"] for w in report["workers"]] == ["planned", "rank 0"]
    with ThreadedSession(2) as sess:
        reference = load_sharded(EXAMPLE, PLAN, sess, progress=False)
    assert [w["bytes"] for w in report["workers"]] == reference.stats.bytes_per_worker


@pytest.mark.slow
def test_cli_refuses_shards_other_than_the_world_size():
    job = torchrun("-m", "shardload", "load", "--session", "torch", "--shards", "4", EXAMPLE)
    assert job.returncode != 0
    assert (
        "--shards 4 but this torch session has 2 workers (a torchrun job has one per rank)"
        in job.stderr
    )


def test_outside_a_job_says_how_to_start_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ShardloadError, match="torchrun"):
        TorchDistributedSession()


@pytest.mark.slow
def test_tensor_parallel_forward_over_torchrun(tmp_path):
    # two ranks (SmolLM2's 9 heads zero-padded to 10), a real all_reduce between them
    job = torchrun(*DIST_JOB, "tp", str(tmp_path), timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    result = load_file(str(tmp_path / "tp.safetensors"))
    assert result["logits"].shape == result["reference"].shape == (16, 49152)
    assert (result["logits"] - result["reference"]).abs().max() <= 1e-3
