"""Smoke test of benchmarks/bench_load.py: a tiny checkpoint, N = 1 and 2, one run each.

It checks that every method runs and reports, and that every method's pieces were checked
equal to shardload's (torch.equal, piece by piece) - not how fast: timings on shared CI machines
mean nothing at this size. The peers (fastsafetensors, Run:ai's streamer, InstantTensor) are not
in the test extra: where one is not installed, the benchmark must report it as skipped, with a
reason, and run the rest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.paths import REPO

# each runs the benchmark script in a fresh interpreter: 12-14 s and 2.2-2.5 s on 2 shared cores
pytestmark = pytest.mark.slow

METHODS = (
    "floor",
    "read-file",
    "safetensors-load_file",
    "safetensors-get_slice",
    "fastsafetensors",
    "runai-streamer",
    "instanttensor",
    "disco-emulated",
    "shardload-thread",
    "shardload-process",
)
#: peer -> the module it needs
PEERS = {
    "fastsafetensors": "fastsafetensors",
    "runai-streamer": "runai_model_streamer",
    "instanttensor": "instanttensor",
}
SHARDS = (1, 2)


def _bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "bench_load.py"),
        "--size-gb",
        "0.02",
        "--runs",
        "1",
        "--no-cuda",
        "--json",
        str(out),
        "--dir",
        str(tmp_path / "ckpt"),
        *args,
    ]
    # a hang guard: the runs take 14 s at most (measured on 2 shared cores)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out.read_text())


def test_bench_load_smoke(tmp_path):
    proc, report = _bench(tmp_path, "--shards", ",".join(map(str, SHARDS)))
    assert {
        "machine",
        "checkpoint",
        "results",
        "session_startup_s",
        "skipped",
        "cold",
        "targets",
    } <= set(report)
    results = {(r["method"], r["num_shards"]): r for r in report["results"]}
    assert {r["cache"] for r in report["results"]} == {"warm"}
    ran = {m for m, _ in results}
    for method in METHODS:
        module = PEERS.get(method)
        if module is not None and importlib.util.find_spec(module) is None:
            assert method not in ran, method
            assert "does not import" in report["skipped"][method], report["skipped"]
        elif method == "instanttensor":  # CUDA only: on the CPU it refuses, and says why
            assert method in ran or report["skipped"][method], report["skipped"]
        else:
            assert {(method, n) for n in SHARDS} <= set(results), (method, report["skipped"])
    for (method, n), r in results.items():
        assert r["median_s"] > 0, (method, n)
        assert len(r["runs_s"]) == 1 and all(t > 0 for t in r["runs_s"]), (method, n)
        assert r["ratio_to_floor"] > 0, (method, n)
        assert len(r["bytes_read_per_worker"]) == n, (method, n)
        assert r["peak_rss_bytes"] is not None, (method, n)
        if method == "read-file":  # a floor: keeps nothing, so nothing to compare
            assert r["verified"] is None and r["gb_per_s"] > 0
        else:
            # every piece torch.equal to shardload's, in memory of its own
            assert r["verified"] is True, (method, n, r["verify_detail"])
            assert r["owns_memory"] is not False, (method, n)
    for n in SHARDS:
        # every method leaves each worker with the same bytes, the plan's
        kept = {
            tuple(r["kept_bytes_per_worker"])
            for (m, k), r in results.items()
            if k == n and m != "read-file"
        }
        assert len(kept) == 1, kept
        assert report["session_startup_s"]["shardload-process"][str(n)] > 0
    assert "floor" in proc.stdout and "targets:" in proc.stdout
    assert "faster than every real peer at N=2 (warm" in proc.stdout


def test_bench_load_cold(tmp_path):
    """--cold: a second pass with the file dropped from the page cache before every method
    (posix_fadvise only here: no machine-wide drop_caches from a test), or the reason why not."""
    proc, report = _bench(
        tmp_path,
        "--shards",
        "1",
        "--methods",
        "read-file,shardload-thread",
        "--cold",
        "--cold-drop",
        "fadvise",
    )
    cold = report["cold"]
    assert cold["requested"] is True
    rows = {(r["cache"], r["method"]): r for r in report["results"]}
    if not cold["ran"]:  # e.g. a tmpfs, where the file is its page cache
        assert cold["skipped"] and "cold mode skipped:" in proc.stdout
        assert {c for c, _ in rows} == {"warm"}
        return
    assert set(rows) == {
        (c, m) for c in ("warm", "cold") for m in ("read-file", "shardload-thread")
    }
    for method in ("read-file", "shardload-thread"):
        row = rows[("cold", method)]
        assert len(row["cold_drops"]) == 1 and row["cold_drops"][0]["how"] == "fadvise"
        assert row["cold_dropped"] in (True, None), row["cold_drops"]
    assert rows[("cold", "shardload-thread")]["verified"] is True
    assert "cold page cache" in proc.stdout
    assert "(cold) within 1.1x of read-file" in proc.stdout


def _synthetic_rows() -> tuple[list[dict], list[dict]]:
    """Rows shaped as bench_load.py's and bench_objects.py's reports hold them."""
    load = [
        {
            "method": m,
            "num_shards": n,
            "cache": "warm",
            "median_s": 0.1 * n + k,
            "peak_rss_bytes": (20 + 10 * n + k) << 20,
            "kept_bytes_per_worker": [10 << 20] * n,
        }
        for k, m in enumerate(("floor", "shardload-thread", "shardload-process"))
        for n in (1, 2, 4)
    ]
    objects = [
        {
            "scheme": "gs",
            "method": m,
            "n": n,
            "seconds": 0.2 * n + k,
            "base_pss_bytes": 100 << 20,
            "peak_pss_bytes": (150 + 20 * n) << 20,
            "kept_bytes": 50 << 20,
            "runs": [],
        }
        for k, m in enumerate(("shardload-thread", "shardload-process"))
        for n in (1, 2)
    ]
    return load, objects


def test_figures_from_a_report(tmp_path):
    """``python -m shardbench.figures REPORT OUT_DIR`` draws load time and peak memory against N
    from a saved report (one with the harness's header, one from before it)."""
    pytest.importorskip("matplotlib")
    load, objects = _synthetic_rows()
    reports = {
        "load": (
            {
                "header": {"benchmark": "bench_load", "environment": {"cpus": 2}},
                "runs": 1,
                "results": load,
            },
            ("load_time.png", "load_memory.png"),
        ),
        "objects": (
            {"runs": 1, "file_bytes": 50_000_000, "results": objects},
            ("objects_time.png", "objects_memory.png"),
        ),
    }
    for name, (report, pngs) in reports.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(report))
        out = tmp_path / f"{name}-figures"
        proc = subprocess.run(
            [sys.executable, "-m", "shardbench.figures", str(path), str(out)],
            cwd=os.path.join(REPO, "benchmarks"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        for png in pngs:
            data = (out / png).read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and 5_000 < len(data) < 150_000, png
            assert str(out / png) in proc.stdout


def test_the_cuda_section_alone_with_cpu_stand_ins_and_a_padded_n(tmp_path):
    """``--cuda-only --cuda-stand-in`` (the GPU check's steps, in its dry run): no CPU methods,
    the CUDA section's code at every N, N = 3 through the planner's padded plan (the saved one
    does not divide 8 KV heads by 3), every piece checked against shardload's."""
    out = tmp_path / "cuda.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "bench_load.py"),
        "--size-gb",
        "0.02",
        "--runs",
        "1",
        "--shards",
        "1,3",
        "--cuda-only",
        "--cuda-stand-in",
        "--json",
        str(out),
        "--dir",
        str(tmp_path / "ckpt"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["results"] == [] and report["checkpoint"]["padded_n"] == [3]
    assert "padded for N=3" in proc.stderr
    rows = {(r["method"], r["num_shards"]): r for r in report["cuda_results"]}
    for method in ("shardload-thread", "safetensors-load_file", "safetensors-get_slice"):
        assert {(method, 1), (method, 3)} <= set(rows), sorted(rows)
    assert all(r["verified"] for r in rows.values()), rows
    assert all(v["verified"] for v in report["cuda"]["shardload_vs_cpu"].values())
    if not torch.cuda.is_available():  # without the stand-in, it says what it needs
        no_cuda = subprocess.run(
            [a for a in cmd if a != "--cuda-stand-in"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert no_cuda.returncode == 4 and "--cuda-only needs a CUDA device" in no_cuda.stderr


def test_bench_scale_smoke(tmp_path):
    """bench_scale.py on its smallest checkpoint at one N: every phase measured in its own
    interpreter, `shardload validate` whole, the JSON and both figures."""
    out = tmp_path / "scale.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "bench_scale.py"),
        "--models",
        "series",
        "--max-tensors",
        "1000",
        "--shards",
        "2",
        "--json",
        str(out),
        "--figures",
        str(tmp_path / "fig"),
        "--dir",
        str(tmp_path / "ckpt"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    rows = json.loads(out.read_text())["results"]
    assert [(r["tensors"], r["num_shards"]) for r in rows] == [(497, 2)]
    for r in rows:
        phases = [r[f"{p}_s"] for p in ("open", "plan", "read_plan")]
        assert all(t > 0 for t in phases) and r["total_s"] == pytest.approx(sum(phases))
        assert r["open_plan_s"] == pytest.approx(phases[0] + phases[1])  # issue 40's goal
        assert 0 <= r["peak_above_import_bytes"] < 50 << 20  # a small checkpoint's, since import
        assert 0 < r["validate_s"] < r["plan_s"]  # the planned plan validated is in plan
        assert r["vllm_open_s"] > 0 and r["read_plans_all_s"] > 0
        assert r["validate_cli_s"] > r["import_s"] > 0
    assert sorted(p.name for p in (tmp_path / "fig").iterdir()) == ["scale_n.png", "scale_time.png"]
