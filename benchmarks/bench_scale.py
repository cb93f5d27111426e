#!/usr/bin/env python
"""Benchmark: what a load costs before a byte moves, against the tensor count and N.

    python benchmarks/bench_scale.py [--models all|published|series] [--shards 8,16,32]
                                     [--runs 1] [--max-tensors K] [--json FILE]
                                     [--figures DIR] [--dir DIR]

The largest mixture-of-experts checkpoints hold 70k to 150k tensors, and every rank pays the
fixed costs (headers, planning, validating, read plans) before its first byte. For each
checkpoint (header-only copies of published ones, and DeepSeek-V3's config scaled from about a
thousand tensors to 150k: ``shardbench/scale.py``; written once into DIR, sparse) and each N,
a fresh interpreter measures each phase (``python -m shardbench.scale``): ``import`` (shardload
and what planning imports: not torch), ``open``,
``plan`` (the plan a load uses: planned, bound and validated), ``read_plan`` (one rank's: what
each rank of a job pays); beside them ``validate`` (the plan bound and validated alone: what a
rank receiving the plan pays instead of planning), every rank's read plans as one process
builds them, vLLM's own cost before its first tensor (every file's header opened by
``safetensors``, as its default loader does), and the peak RSS above the import; then
``shardload validate --shards N`` is timed whole, as a user runs it. Medians of ``--runs``,
the headers in the page cache (read once before).

Prints a table per checkpoint; ``--figures DIR`` draws the phases against the tensor count
(``scale_time.png``, the series at the first N) and the total against N (``scale_n.png``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from shardbench import harness, scale  # noqa: E402


def _child(args: list[str]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (harness.REPO, HERE, os.environ.get("PYTHONPATH")) if p
        ),
    }
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)


def one(folder: str, n: int) -> dict:
    """The phases of one fresh interpreter, and ``shardload validate`` whole."""
    done = _child([sys.executable, "-m", "shardbench.scale", folder, str(n)])
    if done.returncode != 0:
        raise SystemExit(f"measuring {folder} at N={n} failed:\n{done.stderr[-3000:]}")
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    start = time.perf_counter()
    cli = _child([sys.executable, "-m", "shardload", "validate", "--shards", str(n), folder])
    phases["validate_cli"] = time.perf_counter() - start
    if cli.returncode != 0:
        raise SystemExit(f"shardload validate --shards {n} {folder} failed:\n{cli.stderr}")
    return phases


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, 1)
    ap.add_argument("--models", choices=("all", "published", "series"), default="all")
    ap.add_argument("--shards", default="8,16,32", help="comma-separated worker counts")
    ap.add_argument(
        "--max-tensors",
        type=int,
        default=None,
        help="only the checkpoints of at most this many tensors (a smoke run)",
    )
    harness.add_common(
        ap, runs=1, dir=True, json_help="write the results as JSON here", figures=True
    )
    args = ap.parse_args(argv)
    harness.check_runs(ap, args)
    shards = harness.int_list(ap, args.shards)
    bench = harness.Bench("bench_scale", args)
    root = os.path.join(os.path.abspath(args.dir or harness.default_dir()), "scale")
    rows = []
    for model in scale.models(args.models):
        folder, count = scale.ensure(model, root)
        if args.max_tensors is not None and count > args.max_tensors:
            continue
        scale.warm(folder)
        files = sum(1 for f in os.listdir(folder) if f.endswith(".safetensors"))
        print(f"\n{model['name']}: {count:,} tensors, {files} files")
        print(
            f"{'N':>4} "
            + " ".join(f"{p:>10}" for p in ("import", *scale.PHASES))
            + f" {'open+plan':>9} {'total':>8} {'validate':>9} {'all ranks':>9} "
            f"{'vLLM open':>9} {'CLI':>9} {'peak MiB':>9}"
        )
        for n in shards:
            runs = [one(folder, n) for _ in range(args.runs)]
            med = {k: harness.median(r[k] for r in runs) for k in runs[0]}
            total = sum(med[p] for p in scale.PHASES)
            opened_planned = med["open"] + med["plan"]
            rows.append(
                {
                    "model": model["name"],
                    "tensors": count,
                    "num_shards": n,
                    "open_plan_s": opened_planned,
                    "total_s": total,
                    "runs": runs,
                    **{
                        f"{k}_s" if k != "peak_above_import_bytes" else k: v for k, v in med.items()
                    },
                }
            )
            print(
                f"{n:>4} "
                + " ".join(f"{med[p]:10.3f}" for p in ("import", *scale.PHASES))
                + f" {opened_planned:9.3f} {total:8.3f} {med['validate']:9.3f} "
                f"{med['read_plans_all']:9.3f} "
                f"{med['vllm_open']:9.3f} {med['validate_cli']:9.3f} "
                f"{med['peak_above_import_bytes'] / 2**20:9.0f}",
                flush=True,
            )
    print(
        "\nimport: shardload and what planning imports (not torch); open+plan: the headers "
        "opened, the plan planned, bound and validated (issue 40's goal 1); total: that and "
        "rank 0's read plan, after the import: what each rank pays; validate: the plan bound "
        "and validated alone (what a rank receiving it pays instead of planning); all ranks: "
        "every rank's read plans, as one process builds them; vLLM open: every file opened "
        "by safetensors, as vLLM's default loader does before its first tensor; CLI: "
        "`shardload validate --shards N` whole, its import included"
    )
    bench.finish(
        {"results": rows, "phases": list(scale.PHASES), "beside": ["validate", "vllm_open"]}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
