"""The GPU check (``benchmarks/gpu_check.sh``), proved here before a GPU machine runs it.

That machine can fetch nothing and holds only its image's packages, so the check carries the
wheels it lacks (``devtools/gpu_machine.py``) and installs from them alone. The dry run runs the
same script without a network (a network namespace of its own, where ``unshare`` may make one)
in a virtual environment holding only the image's packages (``scripts/gpu-sim-env.sh``), with
the CUDA section's code on CPU workers: every step must pass, and its files must be what the
device call can bring back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from helpers.paths import REPO

from devtools import gpu_machine
from devtools.environments import environment

#: what the device call brings back from $OUT: at most 8 files, 16 MiB each, plain names
MAX_FILES, MAX_BYTES, NAME = 8, 16 << 20, re.compile(r"^[A-Za-z0-9._-]+$")


def _wheel(folder: Path, name: str, *requires: str) -> Path:
    path = folder / f"{name}-1.0-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{name}-1.0.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{meta}",
        )
    return path


def test_a_wheel_needing_what_the_image_lacks_is_named(tmp_path):
    _wheel(
        tmp_path,
        "fine",
        "numpy (>=1.17)",
        "PyYAML>=5.1",
        "torch<3,>=2; python_version < '4'",
        'pytest>=9 ; extra == "test"',
        "boto3; (extra == 'aws')",
    )
    _wheel(tmp_path, "needy", "numpy", "obstore>=0.12", "fine")  # fine: carried beside it
    assert gpu_machine.requirements(tmp_path / "fine-1.0-py3-none-any.whl") == [
        "numpy",
        "pyyaml",
        "torch",
    ]  # extras' requirements left out
    assert gpu_machine.unmet(tmp_path) == {"needy-1.0-py3-none-any.whl": ["obstore"]}


def test_the_carried_wheels_are_pinned_and_the_image_holds_what_the_check_imports():
    assert all(re.fullmatch(r"\d+(\.\d+)+", w.version) for w in gpu_machine.WHEELS)
    carried = {gpu_machine.canonical(w.name) for w in gpu_machine.WHEELS}
    image = {gpu_machine.canonical(n) for n in gpu_machine.IMAGE}
    assert not carried & image  # nothing the machine has is replaced
    assert "torch" in image and "torch" not in carried
    # shardload's own requirements are there or carried
    required = re.findall(
        r'^\s+"([A-Za-z0-9_-]+)[<>=]',
        (Path(REPO) / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0],
        re.M,
    )
    assert {gpu_machine.canonical(r) for r in required} <= image | carried, required
    assert ".gpu-wheels" in (Path(REPO) / ".gitignore").read_text()


def _offline(cmd: list[str]) -> tuple[list[str], bool]:
    """``cmd`` in a network namespace of its own (no route anywhere: a machine that fetches
    nothing), where ``unshare`` may make one; else as it is."""
    if (
        shutil.which("unshare")
        and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    ):
        return [
            "unshare",
            "-n",
            "bash",
            "-c",
            'ip link set lo up 2>/dev/null; exec "$@"',
            "_",
            *cmd,
        ], True
    return cmd, False


@pytest.mark.gpu_sim
@pytest.mark.slow
def test_the_dry_run_passes_offline_in_the_gpu_machines_packages(tmp_path):
    python = environment("gpu_sim").find()  # the marker skips (or fails, in CI) without it
    wheels = Path(python).parents[1] / "gpu-wheels"
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp),
        "PYTHON": python,
        "GPU_CHECK_WHEELS": str(wheels),
        "GPU_CHECK_STAND_IN": "cpu",
    }
    cmd, offline = _offline(["bash", "benchmarks/gpu_check.sh", str(out)])
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    said = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, said
    summary = (out / "summary.txt").read_text()

    def outcome(step: str) -> str:
        return next(line for line in summary.splitlines() if line.startswith(step))

    for step in (
        f"install {len(gpu_machine.WHEELS)} wheels",
        "versions",
        "pytest -m 'gpu and not vllm'",
        "load:",
        "moe:",
        "padded:",
    ):
        assert ": ok," in outcome(step), (step, summary)
    assert outcome("torch unchanged").endswith("torch/__init__.py")
    assert outcome("vllm").startswith("vllm: skipped (no vllm")
    files = sorted(out.iterdir())
    assert len(files) <= MAX_FILES, files
    for f in files:
        assert f.is_file() and NAME.match(f.name) and f.stat().st_size < MAX_BYTES, f

    machine = (out / "machine.txt").read_text()
    for dist in ("gguf", "orjson", "fastsafetensors", "runai-model-streamer", "instanttensor"):
        assert re.search(
            rf"^{dist} [\d.]+; imports from {tmp}/shardload-gpu-site", machine, re.M
        ), (dist, machine)  # from the carried wheels, nowhere else
    assert re.search(r"^cupy-cuda13x 14\.2\.0; imports from", machine, re.M), machine
    assert not list(tmp.glob("shardload-gpu-site*"))  # the installed wheels removed after
    tests = (out / "tests.txt").read_text().strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ skipped, \d+ deselected in [\d.]+s", tests), tests

    def rows(name: str) -> dict:
        report = json.loads((out / name).read_text())
        assert report["cuda"]["devices"] == ["cpu (dry run)"], report.get("cuda_error")
        got = {(r["method"], r["num_shards"]): r for r in report["cuda_results"]}
        assert all(r["verified"] for r in got.values()), got
        return report, got

    _, load = rows("load.json")
    for method in (
        "shardload-thread",
        "safetensors-load_file",
        "safetensors-get_slice",
        "fastsafetensors",
        "runai-streamer",
    ):  # the peers, from the wheels
        assert {(method, 1), (method, 2)} <= set(load), (method, sorted(load))
    moe, _ = rows("moe.json")
    assert moe["checkpoint"]["num_tensors"] > 700
    padded, by = rows("padded.json")
    assert padded["checkpoint"]["padded_n"] == [3] and ("shardload-thread", 3) in by
    assert offline or os.geteuid() != 0, "root, yet no network namespace of its own"
