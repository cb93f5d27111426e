"""``examples/rl_refit.py`` runs as a user runs it: vLLM's CPU build, a trainer writing
two steps, each taken by the running engine through vLLM's weight-transfer API with shardload's
backend (``tests/test_vllm_refit.py`` proves a refit bitwise equal to a fresh engine)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers.paths import EXAMPLES, REPO
from helpers.subprocesses import subprocess_env
from helpers.vllm_engine import vllm_python


@pytest.mark.slow
@pytest.mark.vllm
def test_the_rl_example_generates_then_refits_in_a_loop(tmp_path):
    out = tmp_path / "rounds.json"
    run = subprocess.run(
        [
            vllm_python(),
            os.path.join(EXAMPLES, "rl_refit.py"),
            "--tp",
            "1",  # (the refit tests run TP=2: tests/test_vllm_refit.py)
            "--steps",
            "2",
            "--dir",
            str(tmp_path / "run"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        # the engine core in this process (~10 s of a process start saved on 2 cores)
        env=subprocess_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"),
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    rounds = json.loads(out.read_text())
    assert [r["step"] for r in rounds] == [0, 1, 2]
    assert [r["version"] for r in rounds[1:]] == ["1", "2"]
    # each step's weights are new, so are its rollouts
    tokens = [r["tokens"] for r in rounds]
    assert tokens[0] != tokens[1] != tokens[2]
    assert "step 2: refit from" in run.stdout
    assert (tmp_path / "run" / "step-2" / "model.safetensors").exists()
    assert not list((tmp_path / "run").glob("*.writing"))
