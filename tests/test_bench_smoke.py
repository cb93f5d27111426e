"""Smoke test of benchmarks/bench_load.py: a tiny checkpoint, N = 1 and 2, one run each.

It checks that every method runs and reports, not how fast: timings on shared CI machines mean
nothing at this size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

METHODS = ("floor", "naive", "vllm-style", "disco-style", "shardload-thread",
           "shardload-process")
SHARDS = (1, 2)


def test_bench_load_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "bench_load.py"),
           "--size-gb", "0.02", "--shards", ",".join(map(str, SHARDS)), "--runs", "1",
           "--json", str(out), "--dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"

    report = json.loads(out.read_text())
    assert {"machine", "checkpoint", "results", "session_startup_s"} <= set(report)
    results = {(r["method"], r["num_shards"]): r for r in report["results"]}
    assert set(results) == {(m, n) for m in METHODS for n in SHARDS}
    for (method, n), r in results.items():
        assert r["median_s"] > 0, (method, n)
        assert len(r["runs_s"]) == 1 and all(t > 0 for t in r["runs_s"]), (method, n)
        assert r["ratio_to_floor"] > 0, (method, n)
        assert len(r["bytes_read_per_worker"]) == n, (method, n)
        assert r["peak_rss_bytes"] is not None, (method, n)
    for n in SHARDS:
        # every method leaves each worker with the same bytes, the plan's
        kept = {tuple(results[(m, n)]["kept_bytes_per_worker"]) for m in METHODS}
        assert len(kept) == 1, kept
        assert report["session_startup_s"]["shardload-process"][str(n)] > 0
    assert "floor" in proc.stdout and "targets:" in proc.stdout
