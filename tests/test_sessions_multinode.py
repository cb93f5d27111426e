"""One load whose ranks come from two torchrun launchers, as on two machines
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1): world size 4, two ranks a
node. Each rank gets exactly its own pieces and reads only its own bytes, from a folder and from
object storage; a rank that dies or freezes mid-load fails the other ranks, naming it, and both
launchers exit; the CLI reports once. The rank program is tests/helpers/multinode_job.py; the
ranks' heartbeats that name a rank gone are ``shardload/sessions/peers.py``."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers.paths import EXAMPLE
from helpers.subprocesses import torchrun_nodes
from safetensors.torch import load_file

from shardload import ThreadedSession, load_sharded, open_checkpoint
from shardload.frontdoor import resolve_plan
from shardload.readplan import read_plan_for

JOB = ("-m", "helpers.multinode_job")  # tests/helpers/multinode_job.py, found on PYTHONPATH
WORLD = 4
BUCKET = "multinode"
#: a job answers, failed or not, well within this; past it, it hangs (a bound that tells an
#: answer from a hang, not a measure of speed)
ANSWER_S = 90


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.fixture(scope="module")
def reference():
    """The single-process load of the example at N = 4: every worker's pieces."""
    with ThreadedSession(WORLD) as sess:
        return load_sharded(EXAMPLE, None, sess, progress=False)


@pytest.fixture(scope="module")
def planned() -> list[int]:
    """The bytes each rank's read plan reads (``shardload inspect --reads``)."""
    with open_checkpoint(EXAMPLE) as ckpt:
        validated = resolve_plan(ckpt, WORLD).validated
        return [read_plan_for(validated, ckpt, rank).bytes_read for rank in range(WORLD)]


def reports(out) -> dict[int, dict]:
    """What each rank wrote to ``out``, by rank."""
    found = {}
    for name in os.listdir(out):
        if re.fullmatch(r"rank\d+\.json", name):
            report = json.loads((out / name).read_text())
            found[report["rank"]] = report
    return found


def check_job(jobs, out, reference, planned) -> None:
    """Both launchers exited 0; their four ranks, two on each, hold each its own pieces, bit
    for bit the reference's, and read each what its read plan says, not the checkpoint."""
    for job in jobs:
        assert job.returncode == 0, job.stderr[-3000:]
    ranks = reports(out)
    assert sorted(ranks) == list(range(WORLD))
    # two launchers, two ranks each: ranks of one job from two nodes
    assert sorted((r["launcher"], r["local_rank"]) for r in ranks.values()) == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]
    assert {r["group_rank"] for r in ranks.values()} == {"0", "1"}
    whole = os.path.getsize(os.path.join(EXAMPLE, "model.safetensors"))
    for rank, report in ranks.items():
        assert report["world_size"] == WORLD and report["device"] == "cpu"
        mine = load_file(str(out / f"rank{rank}.safetensors"))
        assert set(mine) == set(reference.names), rank
        for name in reference.names:
            assert same_bits(mine[name], reference.shard(name, rank)), (rank, name)
        read = report["stats"]["bytes_read_per_worker"][rank]
        assert read == planned[rank] < whole, (rank, read, planned[rank])


@pytest.mark.slow  # a job of two launchers
def test_two_launchers_load_each_ranks_own_pieces_from_a_folder(tmp_path, reference, planned):
    jobs = torchrun_nodes(*JOB, "load", str(tmp_path), EXAMPLE, timeout=ANSWER_S)
    check_job(jobs, tmp_path, reference, planned)


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("obstore")
    from helpers import objectservers

    yield from objectservers.object_server("s3")


@pytest.mark.slow  # a job of two launchers
def test_two_launchers_load_each_ranks_own_pieces_from_object_storage(
    tmp_path, s3, reference, planned
):
    s3.make_bucket(BUCKET)
    for name in ("model.safetensors", "shard_info.json", "config.json"):
        with open(os.path.join(EXAMPLE, name), "rb") as f:
            s3.put(BUCKET, f"tiny/{name}", f.read())
    s3.reset_counts()
    # the launchers, and so every rank, find the store in their environment, as on a cluster;
    # with no over-read (the tiny checkpoint's gaps are all under the 1 MiB a rank reads
    # through by default), a rank fetches exactly its spans
    env = {**s3.subprocess_env(), "SHARDLOAD_OBJECT_MAX_GAP_KB": "0"}
    jobs = torchrun_nodes(
        *JOB, "load", str(tmp_path), s3.url(BUCKET, "tiny/"), env=env, timeout=ANSWER_S
    )
    check_job(jobs, tmp_path, reference, planned)
    # the store's own count: each rank's header and its planned spans, nothing else
    with open(os.path.join(EXAMPLE, "model.safetensors"), "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    assert s3.bytes_sent("tiny/model.safetensors") == sum(planned) + WORLD * header


def failing_rank(out) -> int:
    """The global rank that failed on purpose (it said so before it did)."""
    return json.loads((out / "failing.json").read_text())["rank"]


def died(job, rank: int) -> bool:
    """torchrun's summary on ``job``'s launcher names ``rank`` as exiting with 1."""
    summary = rf"rank\s*: {rank} \(local_rank: 1\)\s*exitcode\s*: 1 "
    return re.search(summary, job.stderr) is not None


@pytest.mark.slow  # a job of two launchers
def test_a_rank_that_dies_fails_the_other_node_naming_it(tmp_path):
    # the second rank of the second launcher ends its process (exit 1) mid-load, once the
    # others have finished their pieces and wait for its outcome. Its launcher stops its other
    # rank and says which rank died; the first launcher's ranks raise, naming it
    jobs = torchrun_nodes(*JOB, "die", str(tmp_path), "1", timeout=ANSWER_S)
    failing = failing_rank(tmp_path)
    assert died(jobs[1], failing), jobs[1].stderr[-3000:]
    ranks = reports(tmp_path)
    first_node = {r for r, report in ranks.items() if report["launcher"] == "0"}
    # torchrun stops a launcher's other rank once one fails: the first to answer may be alone
    assert first_node and failing not in ranks, [job.stderr[-3000:] for job in jobs]
    for report in ranks.values():
        assert report["raised"] == "WorkerCrashedError", report
        assert report["worker"] == failing, report
        assert report["message"].startswith(
            f"worker {failing} died while loading <memory>: its process ended"
        ), report
    # and both launchers exit, failed (within ANSWER_S: not a hang)
    assert [job.returncode != 0 for job in jobs] == [True, True]


@pytest.mark.slow  # a job of two launchers
def test_a_rank_that_dies_on_the_rendezvous_node_ends_both_launchers(tmp_path):
    # the same on the launcher serving the rendezvous: when it exits, the store goes with it,
    # and torchrun's other launcher stops its ranks (RendezvousConnectionError); a rank that
    # answers first says the store is gone, or names the rank, never the backend's bare error
    jobs = torchrun_nodes(*JOB, "die", str(tmp_path), "0", timeout=ANSWER_S)
    failing = failing_rank(tmp_path)
    assert died(jobs[0], failing), jobs[0].stderr[-3000:]
    for report in reports(tmp_path).values():
        assert report["raised"] in ("WorkerCrashedError", "ShardloadError"), report
        assert report["worker"] in (failing, None), report
    assert [job.returncode != 0 for job in jobs] == [True, True]


@pytest.mark.slow  # a job of two launchers
def test_a_rank_that_freezes_ends_the_other_ranks_naming_it(tmp_path):
    # the second launcher's second rank stops its process mid-load (SIGSTOP): its connections
    # stay open, as a lost machine's, so no exchange breaks; the others wait for it the peer
    # timeout (5 s here, a minute by default) and end, each saying which rank stopped answering
    jobs = torchrun_nodes(*JOB, "freeze", str(tmp_path), "1", timeout=ANSWER_S)
    failing = failing_rank(tmp_path)
    assert reports(tmp_path) == {}  # nobody finished the load
    for job in jobs:
        said = re.findall(
            r"shardload: rank (\d) failed while loading <memory>: (.*); ending "
            r"this rank \(exit 1\)",
            job.stderr,
        )
        assert said, job.stderr[-3000:]
        for rank, why in said:
            assert int(rank) != failing and why.startswith(
                f"rank {failing} stopped answering: no heartbeat for 5 s"
            ), why
        assert job.returncode != 0


@pytest.mark.slow  # a job of two launchers
def test_cli_under_two_launchers_reports_once(reference):
    jobs = torchrun_nodes(
        "-m",
        "shardload",
        "load",
        "--session",
        "torch",
        "--shards",
        str(WORLD),
        "--json",
        EXAMPLE,
        timeout=ANSWER_S,
    )
    for job in jobs:
        assert job.returncode == 0, job.stderr[-3000:]
    lines = [line for job in jobs for line in job.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # global rank 0 speaks for the four, on whichever node it is
    report = json.loads(lines[0])
    assert report["num_shards"] == WORLD
    assert [w["bytes"] for w in report["workers"]] == reference.stats.bytes_per_worker


def test_the_rank_gone_first_is_named_not_the_one_stopped_after(monkeypatch):
    # three ranks' beats in one store: rank 1 reached the exchange and then went (as torchrun
    # stops a node's other ranks), rank 2 went before reaching it: rank 2 broke the exchange
    import torch.distributed as dist

    from shardload.sessions import peers

    monkeypatch.setattr(peers, "ROLL_CALL_S", 1.0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    ranks = [peers.Peers(store, "test", r, 3, peer_timeout=60.0) for r in range(3)]
    try:
        with ranks[1].exchanging("loading"):
            pass
        ranks[1].stop()
        ranks[2].stop()
        with ranks[0].exchanging("loading"):
            pass
        assert ranks[0].gone() == peers.Missing(first=[2], after=[1], store_lost=False)
        assert peers.name_ranks([2]) == "rank 2" and peers.name_ranks([1, 2]) == "ranks 1, 2"
    finally:
        for rank in ranks:
            rank.stop()


def test_a_rank_takes_the_gpu_of_its_local_rank_not_of_its_rank(monkeypatch):
    # the second rank of the second machine is rank 3, LOCAL_RANK 1: cuda:1 (a machine of two
    # GPUs has no cuda:3). Here one rank of one, RANK 0 and LOCAL_RANK 1, as if CUDA were there
    from devtools.objectservers import free_port
    from shardload import TorchDistributedSession

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    with TorchDistributedSession(backend="gloo") as sess:
        assert sess.device == torch.device("cuda", 1) and chosen == [sess.device]
        assert sess.devices == [torch.device("cuda", 1)]
