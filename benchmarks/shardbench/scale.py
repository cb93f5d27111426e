"""``bench_scale.py``'s checkpoints and its one measurement.

The checkpoints are header-only copies of published ones (``scripts/vllm_coverage.py``'s writer:
the names, shapes and dtypes the published files hold, the data a sparse hole), and a series of
DeepSeek-V3's config with fewer or more layers and routed experts, from about a thousand tensors
to 150k. A measurement runs in a fresh interpreter (``python -m shardbench.scale FOLDER N``), so
that its import, its memory and its caches are its own, and prints one JSON line: the seconds of
each phase and the peak RSS above the import.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import sys
import time

from .harness import REPO

if REPO not in sys.path:  # devtools: the checkout's development code
    sys.path.append(REPO)
from devtools.coverage import coverage_script as coverage

#: the published checkpoints measured, as the coverage table names them
PUBLISHED = (
    "deepseek-ai/DeepSeek-V3",
    "Qwen/Qwen3-235B-A22B-FP8",
    "openai/gpt-oss-120b",
    "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic",
)
#: DeepSeek-V3 scaled: (layers, routed experts) -> about 1k, 5k, 20k, 45k, 92k and 150k tensors
SERIES = ((4, 32), (8, 96), (16, 192), (32, 224), (61, 256), (61, 416))
#: the phases one rank pays before its first byte, in the order they run: ``plan`` is the
#: plan a load uses (``resolve_plan``: planned, bound and validated)
PHASES = ("open", "plan", "read_plan")
#: measured beside them, not in the total: ``validate``, a plan bound and validated alone (what
#: a rank that receives the plan, or loads a plan file, pays instead of planning; part of
#: ``plan``), ``read_plans_all`` (every rank's read plan, as a session of one process builds
#: them) and ``vllm_open`` (what vLLM's default loader does before its first byte: every file's
#: header, ``safetensors.safe_open`` and its keys, as ``safetensors_weights_iterator`` opens them)
BESIDE = ("validate", "read_plans_all", "vllm_open")


def models(which: str) -> list[dict]:
    """The checkpoints to measure: ``published``, ``series`` or ``all``, each a coverage-table
    model (``name``, ``config``, ...)."""
    cov = coverage()
    by_name = {m["name"]: m for m in cov.MODELS}
    out = []
    if which in ("published", "all"):
        out += [by_name[n] for n in PUBLISHED]
    if which in ("series", "all"):
        base = by_name["deepseek-ai/DeepSeek-V3"]
        for layers, experts in SERIES:
            model = copy.deepcopy(base)
            model["config"].update(
                num_hidden_layers=layers,
                n_routed_experts=experts,
                first_k_dense_replace=min(3, layers - 1),
            )
            model["name"] = f"DeepSeek-V3 scaled: {layers} layers, {experts} experts"
            out.append(model)
    return out


def ensure(model: dict, root: str) -> tuple[str, int]:
    """The header-only checkpoint of ``model`` under ``root`` (written once: sparse files, a
    few MB of disk), and its tensor count."""
    key = "".join(c if c.isalnum() else "-" for c in model["name"]).strip("-").lower()
    folder = os.path.join(root, key)
    done = os.path.join(folder, "tensors.txt")
    if not os.path.isfile(done):
        os.makedirs(folder, exist_ok=True)
        count = coverage().write_checkpoint(model, folder)
        with open(done, "w") as f:
            f.write(f"{count}\n")
    with open(done) as f:
        return folder, int(f.read())


def warm(folder: str) -> None:
    """Read every file's header once, so that each measurement opens from the page cache (the
    first open after the files were written, or after another benchmark, reads the disk)."""
    for name in sorted(os.listdir(folder)):
        if name.endswith((".safetensors", ".json")):
            with open(os.path.join(folder, name), "rb") as f:
                head = f.read(8)
                if name.endswith(".safetensors") and len(head) == 8:
                    f.read(int.from_bytes(head, "little"))


def measure(folder: str, n: int) -> dict:
    """Each phase's seconds for ``folder`` at ``n`` workers, in this process: ``import`` (shardload
    and what planning imports: not torch), ``open`` (every header), ``plan`` (``resolve_plan``:
    the validated plan a load uses), ``validate`` (that plan bound and validated again, alone),
    ``read_plan`` (rank 0's), ``read_plans_all`` (every rank's), ``vllm_open`` (every file
    opened by ``safetensors`` itself, as vLLM's loader does); and the peak RSS above the
    import's up to rank 0's read plan (what one rank holds)."""
    start = time.perf_counter()
    from shardload import open_checkpoint
    from shardload.frontdoor import resolve_plan
    from shardload.readplan import build_read_plans

    out: dict = {"import": time.perf_counter() - start}
    base = _rss()
    _reset_peak()  # what ran before (the coverage writer's import) may have peaked higher
    t = time.perf_counter()
    with open_checkpoint(folder) as ckpt:
        metadata = ckpt.metadata()
        out["open"], t = time.perf_counter() - t, time.perf_counter()
        resolved = resolve_plan(ckpt, n)
        out["plan"], t = time.perf_counter() - t, time.perf_counter()
        build_read_plans(resolved.validated, ckpt, ranks=[0])
        out["read_plan"] = time.perf_counter() - t
        out["peak_above_import_bytes"] = max(0, _peak() - base)  # one rank's, to here
        info = resolved.decision.info if resolved.decision is not None else None
        t = time.perf_counter()
        if info is not None:
            info.bind(n).validate(metadata)
        out["validate"], t = time.perf_counter() - t, time.perf_counter()
        build_read_plans(resolved.validated, ckpt)
        out["read_plans_all"] = time.perf_counter() - t
    out["vllm_open"] = _safetensors_open(folder)
    return out


def _safetensors_open(folder: str) -> float:
    """Seconds to open every safetensors file of ``folder`` with ``safetensors`` and list its
    tensors, as vLLM's ``safetensors_weights_iterator`` does before its first tensor."""
    import torch  # noqa: F401  (vLLM has it; planning does not import it, so it is not yet)
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    start = time.perf_counter()
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            f.keys()
    return time.perf_counter() - start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the process's peak RSS afresh (Linux 4.0 and later: ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is the process's since it started: an upper bound


def _peak() -> int:
    """The process's peak RSS since ``_reset_peak`` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))
