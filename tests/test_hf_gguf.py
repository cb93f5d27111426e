"""``load_tp_model`` on the published SmolLM2-135M-Instruct Q4_1 GGUF: every worker writes a
GGUF of its own pieces (still Q4_1 blocks) with its head and MLP counts, and transformers reads
it as it reads any GGUF (its name mapping, its dequantization, its reverse of llama.cpp's q/k
permutation within each whole head). The oracle is transformers reading the whole published
file itself: logits within 1e-3 relative and the same 16 greedy tokens at N = 3 (9 query heads,
3 KV heads: one KV head per worker) and N = 4 (zero-padded heads)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from helpers.real_models import smollm2_gguf
from shardload import ThreadedSession
from shardload.hf import load_tp_model

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

#: "The capital of France is" and a few more tokens of SmolLM2's vocabulary (no pad token)
PROMPT = [[504, 3458, 282, 4649, 314, 253, 1345, 30]]


@pytest.fixture(scope="module")
def reference():
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                do_sample=False)
    return path, logits, tokens


@pytest.mark.parametrize("n", [3, 4])
def test_sharded_gguf_matches_transformers(reference, n):
    path, want, want_tokens = reference
    with ThreadedSession(n) as session, load_tp_model(path, session) as model:
        assert model.decision.kind == ("padded" if n == 4 else "unpadded")
        got = model(PROMPT)
        tokens = model.generate(PROMPT, max_new_tokens=16)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
    assert torch.equal(tokens, want_tokens)
