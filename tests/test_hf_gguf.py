"""``load_tp_model`` and ``shardload run`` on the published SmolLM2-135M-Instruct Q4_1 GGUF.

Every worker dequantizes its own pieces (``shardload.formats``: gguf-py's dequantization, as
transformers' GGUF loader runs it) and builds transformers' model from them as that loader
would (``shardload.hf.from_gguf``: transformers' config from the file's key-values, its
tensor names, its tensor processors: llama.cpp's q/k permutation reversed within each of the
worker's whole heads); no file is written or parsed again. The oracle is transformers reading
the whole published file itself: logits within 1e-3 relative and the same 16 greedy tokens at
N = 2 (zero-padded heads, a query head paired with a KV head out of transformers' regular
pattern: each gets its own copy of its KV head), N = 3 (9 query heads, 3 KV heads: one KV head
per worker) and N = 4 (zero-padded heads).

The command: ``shardload run`` shows one progress bar on a terminal (its stages, none of
transformers' bars) and none under ``--json``; the config and the tokenizer it builds are
transformers' own.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
import transformers
from helpers.paths import REPO
from helpers.real_models import smollm2_gguf
from helpers.subprocesses import subprocess_env

from shardload import ThreadedSession, open_checkpoint
from shardload.hf import load_tp_model

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

#: "The capital of France is" and a few more tokens of SmolLM2's vocabulary (no pad token)
PROMPT = [[504, 3458, 282, 4649, 314, 253, 1345, 30]]


@pytest.fixture(scope="module")
def transformers_answers():
    """SmolLM2's GGUF read whole by transformers itself: (path, logits of PROMPT, its 16 greedy
    tokens)."""
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
        )
    return path, logits, tokens


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_gguf_matches_transformers(transformers_answers, n):
    path, want, want_tokens = transformers_answers
    with ThreadedSession(n) as session, load_tp_model(path, session) as model:
        assert model.decision.kind == ("unpadded" if n == 3 else "padded")
        got = model(PROMPT)
        tokens = model.generate(PROMPT, max_new_tokens=16)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
    assert torch.equal(tokens, want_tokens)


def test_replicated_pieces_are_dequantized_once_per_process(transformers_answers, monkeypatch):
    """The embeddings and norms every worker holds whole are dequantized by one thread worker
    and shared (``shared_outputs.SharedOutputs``); each split piece by its own worker."""
    import shardload.formats

    path, _, _ = transformers_answers
    calls = []
    dequantize = shardload.formats.dequantize_module

    def counting(*args, **kwargs):
        calls.append(1)
        return dequantize(*args, **kwargs)

    monkeypatch.setattr(shardload.formats, "dequantize_module", counting)
    n = 3
    with ThreadedSession(n) as session, load_tp_model(path, session) as model:
        split = model.decision.shard_info().steps
    with open_checkpoint(path) as ckpt:
        names = list(ckpt.metadata())
    replicated = [name for name in names if name not in split]
    assert replicated and len(replicated) < len(names)
    assert len(calls) == n * (len(names) - len(replicated)) + len(replicated)


def test_config_is_transformers_own():
    """``from_gguf.config_dict`` (from shardload's reader) is what transformers' GGUF loader
    makes of the file (``load_gguf_checkpoint``, which parses every key-value again)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from shardload.hf.from_gguf import config_dict

    path = smollm2_gguf()
    with open_checkpoint(path) as ckpt:
        assert config_dict(ckpt) == load_gguf_checkpoint(path, return_tensors=False)["config"]


def test_tokenizer_is_transformers_own():
    """``shardload run``'s tokenizer is the one ``AutoTokenizer`` builds from the file (its
    class, its tokenizer, its chat template), without its parse of the whole vocabulary."""
    from shardload.hf.text import prompt_ids, tokenizer

    path = smollm2_gguf()
    ours = tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.chat_template == theirs.chat_template
    assert ours.eos_token_id == theirs.eos_token_id == 2
    for chat in (True, False):
        assert prompt_ids(ours, "What is the capital of France?", chat) == prompt_ids(
            theirs, "What is the capital of France?", chat
        )


def _run_on_terminal(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """``shardload run ARGS`` with its standard error on a terminal (a pty, 100 columns), as a
    user sees it; its exit code, standard output and everything written to the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardload", "run", *args],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    screen, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # the terminal closed: the command has ended
                    break
                if not chunk:
                    break
                screen += chunk
            elif proc.poll() is not None:
                break
        out = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out.decode(), screen.decode(errors="replace")


def test_cli_run_shows_one_bar_and_none_with_json():
    """The start is one bar through its stages (``loading``, ``building``, ``first token``),
    with none of transformers' own; ``--json`` prints its object and nothing on the terminal.
    N = 2: a zero-padded N, whose model the workers build as at N = 3."""
    path = smollm2_gguf()
    code, out, screen = _run_on_terminal(
        "--shards", "2", path, "--prompt", "What is the capital of France?"
    )
    assert code == 0, screen[-2000:]
    assert out == "The capital of France is Paris.\n"
    for stage in ("importing:", "tokenizer:", "loading:", "building:", "first token:"):
        assert stage in screen, screen[-2000:]
    assert "Loading weights" not in screen and "de-quantizing" not in screen, screen[-2000:]
    lines = [line for line in screen.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1].startswith("8 tokens in "), lines[-3:]  # the bar was cleared

    code, out, screen = _run_on_terminal(
        "--shards",
        "2",
        path,
        "--prompt",
        "What is the capital of France?",
        "--json",
        "--max-new-tokens",
        "1",
    )
    assert code == 0, screen[-2000:]
    assert json.loads(out)["text"] == "The"
    assert screen.strip() == "", screen[-2000:]
