"""Smoke test of benchmarks/bench_many.py: DeepSeek-V3's shape with its widths divided, cut to
4 layers of 8 experts, loaded onto 2 worker processes once. It checks that the checkpoint is
written with real bytes in the files the full-size writer makes, that the planner plans it, that
every worker keeps a piece of every tensor, and that every phase is reported - not how fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO

# a fresh interpreter and 2 worker processes: about 4 s on 2 shared cores
pytestmark = pytest.mark.slow

PHASES = ("session_start", "open", "plan", "read_plans", "load")


def test_bench_many_smoke(tmp_path):
    out = tmp_path / "many.json"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmarks", "bench_many.py"),
        "--layers",
        "4",
        "--experts",
        "8",
        "--workers",
        "2",
        "--runs",
        "1",
        "--dir",
        str(tmp_path / "ckpt"),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["tensors"] > 200 and report["pieces"] == 2 * report["tensors"]
    (run,) = report["runs"]
    assert all(run[p] > 0 for p in PHASES) and run["total"] == pytest.approx(
        sum(run[p] for p in PHASES)
    )
    assert "pieces/s (load)" in proc.stdout and "read plans" in proc.stdout
    (folder,) = [f for f in (tmp_path / "ckpt").iterdir() if f.is_dir()]
    files = sorted(f.name for f in folder.iterdir() if f.name.endswith(".safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    # real bytes: the files hold every tensor's data, not a sparse hole
    assert (
        sum((folder / f).stat().st_blocks * 512 for f in files) >= index["metadata"]["total_size"]
    )


def test_the_factor_must_divide_every_width(tmp_path):
    def run(factor: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            os.path.join(REPO, "benchmarks", "bench_many.py"),
            "--factor",
            factor,
            "--dir",
            str(tmp_path),
        ]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)

    proc = run("48")
    assert proc.returncode == 2 and "is not a multiple of 48" in proc.stderr
    proc = run("4")  # real bytes: 43 GB
    assert proc.returncode == 2 and "at least 16" in proc.stderr
