"""``docs/`` says what the code does: its generated tables are the tables' own, the plan it shows
fits the N it says, and the examples it points to run.

After adding a format, an architecture, a session kind or a shard function, regenerate the
tables with ``python -m shardload.frontdoor.tables docs``; this test fails until then.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers.paths import REPO
from helpers.subprocesses import subprocess_env

from shardload import ShardInfo, ThreadedSession, load_sharded
from shardload.frontdoor.tables import TABLES, render
from shardload.planners import valid_num_shards

DOCS = os.path.join(REPO, "docs")


def _doc(name: str) -> str:
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_generated_tables_are_current(name):
    document, _ = TABLES[name]
    text = _doc(document)
    assert f"<!-- table: {name} -->" in text, f"docs/{document} has no table {name!r}"
    assert render(text) == text, (
        f"docs/{document}'s table {name!r} is out of date: run "
        "python -m shardload.frontdoor.tables docs"
    )


def test_render_rewrites_a_stale_table():
    stale = "a\n<!-- table: sessions -->\n| old |\n<!-- end of table -->\nb\n"
    fresh = render(stale)
    assert "| old |" not in fresh and "| `thread` |" in fresh and fresh.endswith("b\n")


def test_every_link_between_the_docs_resolves():
    for name in ("../README.md", *sorted(os.listdir(DOCS))):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _doc(name)):
            assert os.path.exists(os.path.join(DOCS, os.path.dirname(name), target)), (name, target)


def _plan() -> dict:
    return json.loads(re.search(r"```json\n(.*?)```", _doc("plans.md"), re.S).group(1))


def _checkpoint() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    words = lambda *shape: rng.integers(-(2**31), 2**31, shape, dtype=np.int32)  # noqa: E731
    return {
        "model.layers.0.mlp.down_proj.qweight": words(64, 256),
        "model.layers.0.self_attn.k_proj.qweight": words(32, 64),
    }


def test_the_plan_fits_the_n_plans_md_says():
    assert valid_num_shards(ShardInfo.from_dict(_plan()), _checkpoint()) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_plan_gives_each_worker_its_rows_and_kv_heads(n):
    params = _checkpoint()
    with ThreadedSession(n) as session:
        sharded = load_sharded(params, _plan(), session, progress=False)
    down = params["model.layers.0.mlp.down_proj.qweight"]
    k = params["model.layers.0.self_attn.k_proj.qweight"]
    for r in range(n):
        rows = 64 // n
        assert np.array_equal(
            sharded.shard("model.layers.0.mlp.down_proj.qweight", r).numpy(),
            down[r * rows : (r + 1) * rows],
        )
        # 2 KV heads of 32 columns: split while N <= 2, replicated to N / 2 workers each beyond
        head, width = (r, 64 // n) if n <= 2 else (r // (n // 2), 32)
        assert np.array_equal(
            sharded.shard("model.layers.0.self_attn.k_proj.qweight", r).numpy(),
            k[:, head * width : (head + 1) * width],
        )


@pytest.mark.slow
def test_the_process_session_example_runs():
    done = subprocess.run(
        [sys.executable, "examples/process_session.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[313600, 313600, 313600, 313600]"
