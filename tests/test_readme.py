"""The README's examples run as shown: the "Writing a plan" plan and the ProcessSession script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from shardload import ShardInfo, ThreadedSession, load_sharded
from shardload.planners import valid_num_shards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


def _writing_a_plan() -> dict:
    section = _readme().split("## Writing a plan", 1)[1]
    return json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))


def _checkpoint() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    words = lambda *shape: rng.integers(-2**31, 2**31, shape, dtype=np.int32)  # noqa: E731
    return {"model.layers.0.mlp.down_proj.qweight": words(64, 256),
            "model.layers.0.self_attn.k_proj.qweight": words(32, 64)}


def test_the_plan_fits_the_n_the_readme_says():
    fits = valid_num_shards(ShardInfo.from_dict(_writing_a_plan()), _checkpoint())
    assert fits == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_plan_gives_each_worker_its_rows_and_kv_heads(n):
    params = _checkpoint()
    with ThreadedSession(n) as session:
        sharded = load_sharded(params, _writing_a_plan(), session, progress=False)
    down = params["model.layers.0.mlp.down_proj.qweight"]
    k = params["model.layers.0.self_attn.k_proj.qweight"]
    for r in range(n):
        rows = 64 // n
        assert np.array_equal(sharded.shard("model.layers.0.mlp.down_proj.qweight", r).numpy(),
                              down[r * rows:(r + 1) * rows])
        # 2 KV heads of 32 columns: split while N <= 2, replicated to N / 2 workers each beyond
        head, width = (r, 64 // n) if n <= 2 else (r // (n // 2), 32)
        assert np.array_equal(sharded.shard("model.layers.0.self_attn.k_proj.qweight", r).numpy(),
                              k[:, head * width:(head + 1) * width])


def test_process_session_example_runs_as_shown():
    section = _readme().split("### Sessions", 1)[1]
    shown = re.findall(r"```python\n(.*?)```", section, re.S)
    with open(os.path.join(REPO, "examples", "process_session.py"), encoding="utf-8") as f:
        script = f.read()
    with open(os.path.join(REPO, "examples", "session_funcs.py"), encoding="utf-8") as f:
        funcs = f.read()
    # what the README shows is what the files hold, line for line
    assert all(line in script for line in shown[1].strip().splitlines())
    assert all(line in funcs for line in shown[0].strip().splitlines())
    done = subprocess.run([sys.executable, "examples/process_session.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[313600, 313600, 313600, 313600]"
