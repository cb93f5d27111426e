"""``load_tp_model`` under a real two-rank torchrun job (gloo on loopback): every rank builds
its share of transformers' own model, the row-parallel sums are torch.distributed all-reduces,
and rank 0's token is broadcast, so the ranks decode the same text, greedy and sampled, though
their own random generators differ. The oracle is transformers' unsharded model of the same
checkpoint (a tiny gpt-oss: attention sinks, biases, MoE) and, for sampling, the same session
on threads."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.gpt_oss_tool import tiny_config
from helpers.hf_dist_job import PROMPT
from helpers.subprocesses import torchrun

from shardload import ThreadedSession
from shardload.hf import load_tp_model

pytestmark = pytest.mark.slow  # a torchrun job: two processes importing transformers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    return folder


def test_two_ranks_match_transformers_and_each_other(checkpoint, tmp_path):
    job = torchrun("-m", "helpers.hf_dist_job", str(checkpoint), str(tmp_path), timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        want = reference(ids).logits
        want_greedy = reference.generate(ids, max_new_tokens=16, do_sample=False)
    for rank in ranks:
        got = torch.tensor(rank["logits"])
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
        assert rank["greedy"] == want_greedy.tolist()
    # rank 0 chose every sampled token and broadcast it: both ranks decoded the same
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    with ThreadedSession(2) as session, load_tp_model(str(checkpoint), session) as model:
        threads = model.generate(
            PROMPT, max_new_tokens=16, do_sample=True, seed=7, temperature=0.8, top_k=20
        )
    assert ranks[0]["sampled"] == threads.tolist()


def test_cli_run_under_torchrun(checkpoint, tmp_path):
    from helpers.tokenizer import char_tokenizer

    char_tokenizer().save_pretrained(checkpoint)
    job = torchrun(
        "-m",
        "shardload",
        "run",
        "--session",
        "torch",
        "--shards",
        "2",
        "--json",
        "--no-chat",
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "8",
        "--check",
        str(checkpoint),
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    lines = [line for line in job.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, job.stdout  # rank 0 reports, once
    record = json.loads(lines[0])
    assert record["num_shards"] == 2 and len(record["tokens"]) == 8
    assert record["max_abs_logit_diff"] < 1e-4
