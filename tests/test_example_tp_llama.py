"""Tensor-parallel inference on a real model: SmolLM2-135M-Instruct (GGUF, Q4_1), sharded by
shardload's planner over N workers and run by the reference forward in ``examples/tp_llama.py``.

* N workers give the same logits as one (float32, <= 1e-3) and the same greedy tokens, on
  threads and on processes;
* the KV-cache decoding path agrees with a teacher-forced forward;
* one worker's forward agrees with an independent computation of the embedding and layer 0
  straight from the GGUF file (gguf-py, plain torch), <= 1e-4;
* ``examples/generate.py`` runs end to end.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

# tp_llama is examples/tp_llama.py: examples/ is on sys.path (pytest's ``pythonpath``), and
# worker processes inherit it and import tp_llama from it
import tp_llama  # noqa: F401  (registers the tp_llama.* session functions)
from helpers.paths import EXAMPLES
from helpers.real_models import cache_dir
from tp_llama import TensorParallelLlama

from shardload import ProcessSession, ThreadedSession, open_checkpoint
from shardload.planners import plan_decision, plan_for

#: N that the planner splits SmolLM2 into without padding (9 query heads, 3 KV heads)
NS = [1, 3]
#: N that the planner zero-pads: 2 and 4 pad the query and KV heads (at 4 one worker holds
#: only zero heads), 9 the MLP blocks alone (one query head each), 5 both (two workers of zero
#: heads)
PADDED_NS = [
    2,
    9,
    pytest.param(4, marks=pytest.mark.extended),
    pytest.param(5, marks=pytest.mark.extended),
]

#: "What is the capital of France?" as a user turn of SmolLM2's chat format (ChatML, no system
#: turn), tokenized: <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
NEW_TOKENS = 16
LOGIT_TOL = 1e-3  # N workers vs one: float32 sums in a different order over 30 layers
LAYER0_TOL = 1e-4  # the reference forward vs an independent layer 0


class Reference:
    """The one-worker model and its outputs for PROMPT, computed once for the module."""

    def __init__(self, model: TensorParallelLlama):
        self.model = model
        self.prompt_logits = model.logits(PROMPT)
        self.new_ids, self.step_logits = model.generate(PROMPT, NEW_TOKENS)
        # teacher-forced over prompt + generated: the logits each generated token came from
        self.forced = model.logits(PROMPT + self.new_ids)[len(PROMPT) - 1 : -1]


@pytest.fixture(scope="module")
def one_worker_reference(smollm2):
    with ThreadedSession(1) as session, TensorParallelLlama(smollm2, session) as model:
        yield Reference(model)


def check_matches_reference(model: TensorParallelLlama, ref: Reference) -> dict:
    """Logits of PROMPT and 16 greedy tokens under N workers, against one worker."""
    logits = model.logits(PROMPT)
    assert logits.shape == (len(PROMPT), model.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    prompt_diff = (logits - ref.prompt_logits).abs().max().item()
    assert prompt_diff <= LOGIT_TOL

    new_ids, step_logits = model.generate(PROMPT, NEW_TOKENS)
    assert new_ids == ref.new_ids
    assert step_logits.shape == (NEW_TOKENS, model.vocab_size)
    step_diff = (step_logits - ref.forced).abs().max().item()
    assert step_diff <= LOGIT_TOL  # decoding through the KV cache = a teacher-forced forward
    return {"prompt": prompt_diff, "steps": step_diff}


def report(label: str, diffs: dict, seconds: float) -> None:
    print(
        f"\n{label}: max |logit diff| prompt {diffs['prompt']:.3g}, generation "
        f"{diffs['steps']:.3g}; {seconds:.1f} s"
    )


# ---- N workers against one ----------------------------------------------------------------------


@pytest.mark.slow
def test_reference_generates_sensible_text(smollm2, one_worker_reference):
    """The RoPE convention and the weights are right: the model answers the question."""
    ids = one_worker_reference.new_ids
    # " Paris" (one token) among the first words of the answer
    with open_checkpoint(smollm2) as ckpt:
        tokens = ckpt.field("tokenizer.ggml.tokens")
    text = "".join(tokens[i] for i in ids[:8]).replace("\u0120", " ")
    assert "Paris" in text, text
    # the greedy choice is clear at every step: float32 noise cannot flip it
    top2 = one_worker_reference.forced.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 10 * LOGIT_TOL


@pytest.mark.slow
@pytest.mark.parametrize("n", NS)
def test_threads_match_one_worker(n, smollm2, one_worker_reference):
    start = time.perf_counter()
    if n == 1:  # the reference itself: still checks the cache path against teacher forcing
        diffs = check_matches_reference(one_worker_reference.model, one_worker_reference)
    else:
        with ThreadedSession(n) as session, TensorParallelLlama(smollm2, session) as model:
            assert [w["q_heads"] for w in model.workers] == [9 // n] * n
            diffs = check_matches_reference(model, one_worker_reference)
    report(f"threads, N={n}", diffs, time.perf_counter() - start)


@pytest.mark.slow
@pytest.mark.parametrize("n", [n for n in NS if n > 1])
def test_processes_match_one_worker(n, smollm2, one_worker_reference):
    start = time.perf_counter()
    with ProcessSession(n) as session, TensorParallelLlama(smollm2, session) as model:
        diffs = check_matches_reference(model, one_worker_reference)
    report(f"processes, N={n}", diffs, time.perf_counter() - start)


@pytest.mark.slow
@pytest.mark.parametrize("n", PADDED_NS)
def test_padded_threads_match_one_worker(n, smollm2, one_worker_reference):
    # SmolLM2 (9 query heads, 3 KV heads, MLP 1536 = 48 blocks of 32) over N the heads or the
    # MLP blocks do not divide: the planner zero-pads, and its plan records the padded layout
    assert plan_decision(smollm2, n).kind == "padded"
    plan = plan_for(smollm2, num_shards=n)
    recorded = plan.metadata["tensor_parallel"]
    assert recorded["num_shards"] == n
    start = time.perf_counter()
    with ThreadedSession(n) as session, TensorParallelLlama(smollm2, session, plan=plan) as model:
        # the forward follows the layout the planner padded the shards to
        assert model.spec["layout"] == {
            key: recorded[key] for key in ("q_heads", "kv_heads", "q_to_kv")
        }
        diffs = check_matches_reference(model, one_worker_reference)
    report(f"threads, N={n} (padded)", diffs, time.perf_counter() - start)


# ---- layer 0, computed independently ------------------------------------------------------------


def _gguf_layer0(path: str) -> tuple[dict, dict]:
    """Layer 0's tensors and the model's hyperparameters, read with gguf-py alone."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    wanted = {"token_embd.weight"} | {
        f"blk.0.{n}.weight"
        for n in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    }
    weights = {}
    for t in reader.tensors:
        if t.name in wanted:
            values = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (innermost) first
            weights[t.name.removeprefix("blk.0.").removesuffix(".weight")] = torch.from_numpy(
                values.reshape(shape)
            )

    def field(key):
        return reader.fields[f"llama.{key}"].contents()

    hp = {
        "heads": field("attention.head_count"),
        "kv_heads": field("attention.head_count_kv"),
        "base": field("rope.freq_base"),
        "eps": field("attention.layer_norm_rms_epsilon"),
    }
    return weights, hp


def _rope_complex(x: torch.Tensor, base: float) -> torch.Tensor:
    """GGML's normal RoPE as a complex rotation: (x[2i] + j x[2i+1]) * exp(j pos theta_i)."""
    T, _, D = x.shape
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rotation = torch.polar(
        torch.ones(T, D // 2, dtype=torch.float64),
        torch.arange(T, dtype=torch.float64)[:, None] * theta,
    )
    pairs = torch.view_as_complex(x.double().reshape(T, -1, D // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation[:, None, :]).reshape(x.shape).float()


@pytest.mark.slow
def test_layer0_matches_independent_computation(smollm2, one_worker_reference):
    w, hp = _gguf_layer0(smollm2)
    T, heads, kv_heads = len(PROMPT), hp["heads"], hp["kv_heads"]

    def norm(x, weight):
        return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + hp["eps"]) * weight

    x = w["token_embd"][torch.tensor(PROMPT)]
    h = norm(x, w["attn_norm"])
    q = torch.nn.functional.linear(h, w["attn_q"]).view(T, heads, -1)
    k = torch.nn.functional.linear(h, w["attn_k"]).view(T, kv_heads, -1)
    v = torch.nn.functional.linear(h, w["attn_v"]).view(T, kv_heads, -1)
    q, k = _rope_complex(q, hp["base"]), _rope_complex(k, hp["base"])
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # GQA: query head h reads KV head h // g
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, D]
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    causal = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
    x = x + torch.nn.functional.linear(attn.transpose(0, 1).reshape(T, -1), w["attn_output"])
    h = norm(x, w["ffn_norm"])
    mlp = torch.nn.functional.silu(
        torch.nn.functional.linear(h, w["ffn_gate"])
    ) * torch.nn.functional.linear(h, w["ffn_up"])
    expected = x + torch.nn.functional.linear(mlp, w["ffn_down"])

    got = one_worker_reference.model.hidden(PROMPT, 1)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    print(f"\nlayer 0: max |diff| {diff:.3g} (hidden state max {expected.abs().max():.3g})")
    assert diff <= LAYER0_TOL


# ---- the example script ------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_script(smollm2):
    env = {**os.environ, "SHARDLOAD_MODEL_CACHE": str(cache_dir())}  # where smollm2 lies
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(EXAMPLES, "generate.py"),
            "--shards",
            "3",
            "--max-new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    last = lines[-1]
    assert last.startswith("max_abs_logit_diff="), done.stdout
    diff = float(last.split("=", 1)[1])
    assert 0 <= diff <= LOGIT_TOL
    text = "\n".join(lines[:-1]).strip()
    assert text, done.stdout
    print(f"\ngenerate.py --shards 3: {text!r}, {last}")
