#!/usr/bin/env python
"""Benchmark: shardload's cost per piece, from a file of many tiny tensors.

    python benchmarks/bench_per_piece.py [--tensors 100000] [--shards 1,4,8] [--runs 3]
                                         [--dir DIR] [--json FILE]

1. Writes (once, cached in DIR) a safetensors file of ``--tensors`` int32 tensors of 8 x 8 (256
   bytes each) and a plan splitting each by rows (``shardload.split``, any N dividing 8).
2. For each N, alternating the two ``--runs`` times, measures wall and CPU seconds (this
   process: every thread) of
   ``shardload-thread``        ``shardload.load_sharded`` on a started ``ThreadedSession(N)``,
                               from opening the file and parsing the plan to every piece kept;
   ``safetensors-load_file``   ``safetensors.torch.load_file`` then, for each worker, a row
                               slice ``clone()``d per tensor: what a user would write;
   and checks that both end with the same pieces.
3. Prints the medians, CPU per piece (``N x tensors`` pieces) and the CPU ratio of shardload to
   ``load_file``. Its bytes are nothing: what it measures is the work per tensor and per piece
   (headers, the plan, read plans, allocation, bookkeeping), which decides a load of a
   checkpoint with tens of thousands of tensors (a large MoE).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from shardbench import harness  # noqa: E402
from shardbench.harness import default_dir  # noqa: E402

ROWS = 8


def ensure_file(root: str, tensors: int) -> str:
    """The cached folder holding ``model.safetensors`` and ``shard_info.json``."""
    from safetensors.torch import save_file

    folder = os.path.join(root, f"tiny-{tensors}x8x8-int32-v1")
    if os.path.isfile(os.path.join(folder, "shard_info.json")):
        return folder
    os.makedirs(folder, exist_ok=True)
    base = torch.arange(ROWS * ROWS, dtype=torch.int32).reshape(ROWS, ROWS)
    save_file(
        {f"t{i}": base + i for i in range(tensors)}, os.path.join(folder, "model.safetensors")
    )
    step = ["shardload.split", [["num_shards", f"{ROWS} // num_shards", ROWS], "int32"], 0]
    tmp = os.path.join(folder, "shard_info.json.tmp")
    with open(tmp, "w") as f:
        json.dump({f"t{i}": [step] for i in range(tensors)}, f)
    os.replace(tmp, os.path.join(folder, "shard_info.json"))
    return folder


def run_shardload(folder: str, session):
    from shardload import load_sharded

    return load_sharded(folder, os.path.join(folder, "shard_info.json"), session, progress=False)


def run_load_file(folder: str, n: int) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    full = load_file(os.path.join(folder, "model.safetensors"))
    rows = ROWS // n
    return [
        {name: t[i * rows : (i + 1) * rows].clone() for name, t in full.items()} for i in range(n)
    ]


def timed(fn) -> tuple[float, float, list]:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--shards", default="1,4,8")
    harness.add_common(ap, runs=3, dir=True)
    args = ap.parse_args(argv)
    harness.check_runs(ap, args)
    shards = harness.int_list(ap, args.shards)
    bench = harness.Bench("bench_per_piece", args)
    from shardload import ThreadedSession

    folder = ensure_file(os.path.abspath(args.dir or default_dir()), args.tensors)
    results = []
    print(f"{args.tensors} tensors of 8x8 int32; medians of {args.runs}; cpu: this process")
    print(
        f"{'method':24} {'N':>2} {'wall s':>7} {'cpu s':>7} {'cpu us/piece':>13} "
        f"{'cpu vs load_file':>17}"
    )
    for n in shards:
        samples: dict[str, list[tuple[float, float]]] = {
            "shardload-thread": [],
            "safetensors-load_file": [],
        }
        with ThreadedSession(n) as session:
            for r in range(args.runs):
                pieces = {}
                for method in harness.rotated(list(samples), r):
                    fn = (
                        functools.partial(run_shardload, folder, session)
                        if method.startswith("shard")
                        else functools.partial(run_load_file, folder, n)
                    )
                    wall, cpu, pieces[method] = timed(fn)
                    samples[method].append((wall, cpu))
                sharded = pieces["shardload-thread"]  # its pieces taken outside the timing
                a = [sharded.worker(i) for i in range(n)]
                b = pieces["safetensors-load_file"]
                if not all(torch.equal(a[i][k], b[i][k]) for i in range(n) for k in b[i]):
                    print("error: the two methods' pieces differ", file=sys.stderr)
                    return 3
                del pieces, sharded, a, b
        base = harness.median(c for _, c in samples["safetensors-load_file"])
        for method, runs in samples.items():
            wall = harness.median(w for w, _ in runs)
            cpu = harness.median(c for _, c in runs)
            per = cpu / (n * args.tensors) * 1e6
            print(f"{method:24} {n:>2} {wall:7.2f} {cpu:7.2f} {per:13.1f} {cpu / base:16.2f}x")
            results.append(
                {
                    "method": method,
                    "n": n,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "cpu_us_per_piece": per,
                    "cpu_vs_load_file": cpu / base,
                }
            )
    bench.finish({"tensors": args.tensors, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
