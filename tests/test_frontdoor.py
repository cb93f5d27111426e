"""The front door (``shardload.frontdoor``): one plan policy, sessions by kind, atomic plan
writes, for every caller.

The policy, in its documented order: ``REPLICATE``; the plan given; ``shard_info.json`` beside
the checkpoint; a plan made from the config; else a refusal saying what to pass. Each step is
checked on what a worker ends up holding, against numpy slicing or the planner's own plan.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from helpers.loads import load_on_threads
from helpers.paths import EXAMPLE
from safetensors.numpy import save_file

from shardload import (
    REPLICATE,
    PlanError,
    SessionError,
    ShardInfo,
    open_checkpoint,
    open_session,
    resolve_plan,
)
from shardload.frontdoor import plan_beside, write_plan
from shardload.planners import plan_for

SPLIT = {"w": [["shardload.split", [["num_shards", "8 // num_shards"], "float32"], 0]]}


@pytest.fixture
def stored(tmp_path):
    """A one-tensor safetensors file, no config."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.arange(8, dtype=np.float32)}, str(path))
    return path


def test_a_plan_given_is_used(stored, tmp_path):
    plan = tmp_path / "elsewhere.json"
    plan.write_text(json.dumps(SPLIT))
    for given in (str(plan), SPLIT, ShardInfo.from_dict(SPLIT)):
        sharded = load_on_threads(str(stored), given)
        assert torch.equal(sharded.shard("w", 1), torch.arange(4, 8, dtype=torch.float32))


def test_none_takes_the_plan_beside_the_checkpoint(stored, tmp_path):
    (tmp_path / "shard_info.json").write_text(json.dumps(SPLIT))
    with open_checkpoint(str(stored)) as ckpt:
        resolved = resolve_plan(ckpt, 2)
        assert (resolved.origin, resolved.source) == ("beside", str(tmp_path / "shard_info.json"))
    assert torch.equal(load_on_threads(str(stored), None).shard("w", 0), torch.arange(4.0))


def test_replicate_is_an_explicit_choice(stored, tmp_path):
    (tmp_path / "shard_info.json").write_text(json.dumps(SPLIT))  # REPLICATE wins over it
    sharded = load_on_threads(str(stored), REPLICATE)
    for worker in (0, 1):
        assert torch.equal(sharded.shard("w", worker), torch.arange(8.0))


def test_none_without_a_plan_or_a_config_says_what_to_pass(stored):
    with pytest.raises(
        PlanError,
        match=r"no model config next to the checkpoint.*"
        r"shard_info=shardload.REPLICATE",
    ):
        load_on_threads(str(stored), None)
    with pytest.raises(PlanError, match=r"shard_info=shardload.REPLICATE"):
        load_on_threads({"w": np.zeros(4, np.float32)}, None)


def test_none_with_a_config_and_no_plan_is_the_planners_plan(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(EXAMPLE, folder)
    os.remove(folder / "shard_info.json")
    with open_checkpoint(str(folder)) as ckpt:
        resolved = resolve_plan(ckpt, 4)
        assert resolved.origin == "planned" and resolved.decision.kind == "unpadded"
        want = plan_for(ckpt, 4).bind(4).validate(ckpt.metadata())
    assert {p.name: p.steps for p in resolved.validated} == {p.name: p.steps for p in want}
    sharded = load_on_threads(str(folder), None, 4)
    with open_checkpoint(str(folder)) as ckpt:
        q = ckpt.read("model.layers.0.self_attn.q_proj.qweight")
    assert torch.equal(
        sharded.shard("model.layers.0.self_attn.q_proj.qweight", 3),
        torch.as_tensor(q)[:, 3 * 64 : 4 * 64],
    )


def test_the_planners_plan_beside_gives_way_for_an_n_it_does_not_fit_and_says_so():
    with open_checkpoint(EXAMPLE) as ckpt:
        fits = resolve_plan(ckpt, 4)
        assert (fits.origin, fits.note) == ("beside", "")
        padded = resolve_plan(ckpt, 3)
    assert padded.origin == "planned" and padded.decision.kind == "padded"
    beside = os.path.join(EXAMPLE, "shard_info.json")
    assert padded.note == (
        f"{beside} does not fit 3 workers (N that work (up to 64): 1, 2, 4, "
        "8): using the planner's zero-padded plan for 3 instead"
    )


def test_the_planners_options_are_refused_with_a_plan_of_ones_own(stored, tmp_path):
    (tmp_path / "shard_info.json").write_text(json.dumps(SPLIT))
    with open_checkpoint(str(stored)) as ckpt:
        for given in (None, SPLIT):
            with pytest.raises(
                PlanError,
                match=r"experts='ep' chooses how shardload plans, "
                r"but the plan .* is used as it is: write a "
                r"plan with `plan_for\(checkpoint, num_shards, "
                r"experts='ep'\)`",
            ):
                resolve_plan(ckpt, 2, given, experts="ep")
        with pytest.raises(PlanError, match="vocab_parallel and pad choose how"):
            resolve_plan(ckpt, 2, SPLIT, vocab_parallel=True)


def test_a_plan_beside_a_hub_cache_folder_is_the_snapshots(tmp_path):
    repo = tmp_path / "models--org--m"
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    save_file({"w": np.zeros(8, np.float32)}, str(snap / "model.safetensors"))
    (snap / "shard_info.json").write_text(json.dumps(SPLIT))
    with open_checkpoint(str(repo)) as ckpt:
        assert plan_beside(ckpt) == str(snap / "shard_info.json")


def test_write_plan_is_whole_or_nothing(tmp_path):
    info = plan_for(EXAMPLE, 4)
    target = tmp_path / "plan.json"
    text = write_plan(info, str(target))
    assert target.read_text() == text and ShardInfo.load(str(target)).to_dict() == info.to_dict()
    with pytest.raises(OSError):
        write_plan(info, str(tmp_path / "no-such-folder" / "plan.json"))
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]  # no temporary file left


def test_sessions_open_by_kind():
    with open_session("thread", 3) as sess:
        assert sess.num_workers == 3 and sess.local_workers == [0, 1, 2]
    with pytest.raises(
        SessionError,
        match=r"unknown session kind 'fiber'; the kinds are "
        r"process, thread, torch",
    ):
        open_session("fiber", 2)
    with pytest.raises(SessionError, match=r"'gpu' is not a device: use 'cpu', 'cuda'"):
        open_session("thread", 2, device="gpu")
    env = {
        k: os.environ.pop(k)
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if k in os.environ
    }
    try:
        with pytest.raises(
            SessionError,
            match=r"a torch session runs under torchrun, and "
            r"RANK, WORLD_SIZE, .* are not set",
        ):
            open_session("torch", 2)
    finally:
        os.environ.update(env)


def test_a_refusal_sent_to_the_other_ranks_keeps_the_n_that_work():
    # rank 0's refusal, as the other ranks of a shared plan raise it: the same message, and
    # the N that work as data (with how far they were looked for), not only as its text
    from shardload.errors import PlanError
    from shardload.frontdoor import shared_plan
    from shardload.plan import ValidNumShards

    working = ValidNumShards([1, 3], tried=9, limit=64)
    exc = PlanError("9 heads over 2 workers", source="<plan for x>", param="w", working=working)
    sent = {"ok": False, "planning": True, "error": shared_plan._error_json(exc)}
    status = json.loads(json.dumps(sent))
    rebuilt = shared_plan._rebuilt(shared_plan._read_status(status), "planning the load")
    assert isinstance(rebuilt, PlanError) and str(rebuilt) == str(exc)
    assert rebuilt.constraint == exc.constraint and rebuilt.working == [1, 3]
    assert (rebuilt.working.tried, rebuilt.working.limit) == (9, 64)
