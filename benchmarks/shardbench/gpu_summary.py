"""The GPU check's two reports (``gpu_check.sh``):

    python -m shardbench.gpu_summary machine        # the machine: Python, torch, CUDA, packages
    python -m shardbench.gpu_summary tables OUTDIR  # the tables of load.json, moe.json, padded.json

``tables`` ends with the rows of ``docs/performance.md``'s GPU table, as markdown, ready to
paste. Nothing here needs CUDA: on a machine without it, it says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import platform
import sys

#: what the check reports on, as (distribution, module); cupy's distribution is whichever
#: provides ``cupy`` (cupy-cuda12x, cupy-cuda13x, ...)
PACKAGES = (
    ("safetensors", "safetensors"),
    ("numpy", "numpy"),
    ("gguf", "gguf"),
    ("orjson", "orjson"),
    (None, "cupy"),
    ("fastsafetensors", "fastsafetensors"),
    ("runai-model-streamer", "runai_model_streamer"),
    ("instanttensor", "instanttensor"),
    ("transformers", "transformers"),
)

#: the benchmark steps, in the order they ran, and what each measured
STEPS = (
    ("load.json", "GPTQ Llama"),
    ("moe.json", "GPTQ Qwen2-MoE"),
    ("padded.json", "GPTQ Llama, padded"),
)


def distribution(module: str) -> str | None:
    """The installed distribution that provides ``module`` (cupy: cupy-cuda12x or -13x)."""
    names = md.packages_distributions().get(module) or []
    return names[0] if names else None


def machine() -> None:
    print("python", sys.version.split()[0], sys.executable, platform.platform())
    import torch

    print(
        f"torch {torch.__version__} at {os.path.dirname(torch.__file__)}; built for CUDA "
        f"{torch.version.cuda}; available {torch.cuda.is_available()}; devices "
        f"{torch.cuda.device_count()}"
    )
    for d in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(d)
        print(
            f"  cuda:{d} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability "
            f"{p.major}.{p.minor}, {p.multi_processor_count} SMs"
        )
    import shardload

    print(f"shardload {shardload.__version__} from {os.path.dirname(shardload.__file__)}")
    for dist, module in PACKAGES:
        dist = dist or distribution(module) or module
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = "not installed"
        try:
            where = "imports from " + os.path.dirname(importlib.import_module(module).__file__)
        except Exception as exc:  # noqa: BLE001 - a broken install raises anything
            where = f"does not import: {type(exc).__name__}: {exc}"
        print(f"{dist} {version}; {where}")


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def tables(out: str) -> None:
    rows_md = []
    for name, what in STEPS:
        path = os.path.join(out, name)
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"{name}: no results ({type(exc).__name__})\n")
            continue
        ckpt = r.get("checkpoint", {})
        cuda = r.get("cuda") or {}
        what = f"{ckpt.get('tensor_bytes', 0) / 1e9:.1f} GB {what}"
        print(
            f"{name}: {what}, {ckpt.get('num_tensors', '?')} tensors; "
            f"{', '.join(cuda.get('devices', []))}; pinned host-to-device "
            f"{_f(cuda.get('pinned_h2d_gb_per_s'), '.1f')} GB/s"
        )
        if r.get("cuda_error"):
            print(f"  CUDA section failed: {r['cuda_error']}")
        for row in r.get("cuda_results", []):
            print(
                f"  {row['method']:<22} N={row['num_shards']}  {_f(row['median_s'], '.3f')} s"
                f"  {_f(row['gb_per_s'], '.1f')} GB/s  {_f(row['fraction_of_pinned'], '.2f')}"
                f" of pinned  {_f(row['ratio_to_shardload_thread'], '.2f')}x shardload  host "
                f"+{row['peak_anon_bytes'] / 2**20:.0f} MiB anon  "
                f"{'equal' if row['verified'] else 'WRONG'}"
            )
            rows_md.append(
                f"| {what} | {row['num_shards']} | {row['method']} | "
                f"{_f(row['median_s'], '.3f')} | {_f(row['gb_per_s'], '.1f')} | "
                f"{_f(row['fraction_of_pinned'], '.2f')} | "
                f"{_f(row['ratio_to_shardload_thread'], '.2f')} | "
                f"{'equal' if row['verified'] else 'WRONG'} |"
            )
        for method, why in cuda.get("skipped", {}).items():
            print(f"  skipped: {method}: {why}")
        for t in r.get("targets", []):
            if t["target"].startswith("cuda"):
                print(f"  {t['result']:<4} {t['target']}")
        print()
    if rows_md:
        print("docs/performance.md, GPU table rows:")
        print("| checkpoint | N | method | median s | GB/s | of pinned | vs shardload | pieces |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows_md))


def main(argv: list[str]) -> int:
    if argv[:1] == ["machine"]:
        machine()
    elif argv[:1] == ["tables"] and len(argv) == 2:
        tables(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
