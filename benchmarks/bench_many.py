#!/usr/bin/env python
"""Benchmark: a load of a checkpoint of ~92,000 tensors onto 8 worker processes, phase by phase.

    python benchmarks/bench_many.py [--model deepseek-v3-small] [--factor 64] [--workers 8]
                                    [--session process|thread] [--runs 3] [--dir DIR]
                                    [--layers L] [--experts E] [--json FILE]

1. Writes (once, cached in DIR) DeepSeek-V3 as the coverage table has it with its widths and
   FP8 blocks divided by ``--factor`` (``shardbench/many.py``): every tensor of the published
   model (91,991, in the 139 files the full-size writer makes), with real bytes, ~0.3 GB at 64.
2. Loads it ``--runs`` times, each onto a new session of ``--workers`` CPU workers (worker
   processes by default), planned from its config, timing each phase: ``session start``,
   ``open`` (every header), ``plan`` (``resolve_plan``), ``read plans`` (every worker's,
   built and sent), ``load`` (the workers' pieces), and the total.
3. Prints each phase's median, the pieces per second of the load, and the CPU seconds of this
   process and of the workers per piece: what a load of a large mixture of experts pays for
   every tensor and every piece, whatever its bytes.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from shardbench import harness  # noqa: E402
from shardbench.harness import default_dir  # noqa: E402

MODELS = ("deepseek-v3-small",)
LABELS = {
    "session_start": "session start",
    "open": "open",
    "plan": "plan (resolve_plan)",
    "read_plans": "read plans",
    "load": "load (pieces)",
    "total": "total",
}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument(
        "--model",
        choices=MODELS,
        default=MODELS[0],
        help="the checkpoint (DeepSeek-V3's tensors, widths divided)",
    )
    ap.add_argument(
        "--factor",
        type=int,
        default=64,
        help="divide every width and FP8 block by this: 64 (0.34 GB), 32 (0.8 GB) "
        "or 16 (2.9 GB); the data is written for real",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers (default: the published 61; fewer for a quick run)",
    )
    ap.add_argument(
        "--experts",
        type=int,
        default=None,
        help="routed experts per layer (default: the published 256)",
    )
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--session", choices=("process", "thread"), default="process")
    harness.add_common(ap, runs=3, dir=True)
    args = ap.parse_args(argv)
    harness.check_runs(ap, args)
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    from shardbench import many

    if args.factor < 16:
        ap.error(
            f"--factor {args.factor} would write {688 / args.factor**2:.0f} GB or more: at least 16"
        )
    if args.layers is not None and args.layers < 2:
        ap.error("--layers must be at least 2")
    if args.experts is not None and (args.experts < 8 or args.experts % 8):
        ap.error("--experts must be a multiple of 8 (the config's expert groups)")
    try:
        name = many.model(args.factor, args.layers, args.experts)["name"]
    except ValueError as exc:
        ap.error(f"--factor {args.factor}: {exc}")
    bench = harness.Bench("bench_many", args)
    folder, tensors = many.ensure(
        os.path.abspath(args.dir or default_dir()), args.factor, args.layers, args.experts
    )
    runs = []
    for r in range(args.runs):
        runs.append(many.measure(folder, args.workers, args.session))
        print(
            f"run {r + 1}: "
            + ", ".join(f"{p} {runs[-1][p]:.2f} s" for p in (*many.PHASES, "total")),
            flush=True,
        )
    med = {
        k: harness.median(run[k] for run in runs)
        for k in (*many.PHASES, "total", "cpu_s", "workers_cpu_s")
    }
    pieces, nbytes = runs[0]["pieces"], runs[0]["bytes"]
    print(
        f"{name}: {tensors} tensors, {pieces} pieces "
        f"({nbytes / 1e9:.2f} GB) on {args.workers} worker "
        f"{'processes' if args.session == 'process' else 'threads'}; medians of {args.runs}"
    )
    print(f"{'phase':22} {'s':>7}")
    for phase in (*many.PHASES, "total"):
        print(f"{LABELS[phase]:22} {med[phase]:7.2f}")
    print(f"pieces/s (load): {pieces / med['load']:,.0f}")
    per = f"cpu per piece: this process {med['cpu_s'] / pieces * 1e6:.1f} us"
    if med["workers_cpu_s"] is not None:
        per += f", workers {med['workers_cpu_s'] / pieces * 1e6:.1f} us"
    print(per + " (open, plan, read plans and load)")
    bench.finish(
        {
            "model": args.model,
            "name": name,
            "factor": args.factor,
            "tensors": tensors,
            "pieces": pieces,
            "bytes": nbytes,
            "workers": args.workers,
            "session": args.session,
            "runs": runs,
            "medians": med,
            "pieces_per_s": pieces / med["load"],
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
