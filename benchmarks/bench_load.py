#!/usr/bin/env python
"""Benchmark: load a 4-bit GPTQ Llama-style checkpoint onto N workers, with shardload and with
the real libraries a user would otherwise load it with.

    python benchmarks/bench_load.py [--size-gb X] [--model dense|moe] [--shards 1,2,4,8]
                                    [--runs R] [--cold] [--json FILE] [--dir DIR]
                                    [--methods a,b,...] [--figures DIR]

1. Writes (once, cached in DIR) a synthetic checkpoint of about X GB: random packed words and
   random fp16 scales in GPTQ v1 layout, ``config.json`` with its ``quantization_config``, and
   the planner's symbolic plan (``shard_info.json``) next to it. ``--model moe`` makes it a
   Qwen2-MoE (60 routed experts and a shared one per layer): real MoE checkpoints hold tens of
   thousands of tensors, where a load's cost per piece counts most.
2. Warms the page cache, then, for each N, loads shardload's pieces once as the reference and
   runs every method R times, rotating their order from one repetition to the next:

   ``floor``                  every kept byte copied once, from a memory map, by a pool of
                              ``os.cpu_count()`` threads: the bound for a copying loader
   ``read-file``              the file read sequentially (``readinto`` a reused 64 MiB
                              buffer): the bound from a cold page cache
   ``safetensors-load_file``  the real peers (``shardbench/peers.py``): safetensors,
   ``safetensors-get_slice``  fastsafetensors, Run:ai Model Streamer, InstantTensor (CUDA
   ``fastsafetensors``        only), each ending with every worker owning exactly
   ``runai-streamer``         shardload's pieces
   ``instanttensor``
   ``disco-emulated``         an emulation of TVM Disco's pattern: worker 0 reads and splits
                              every tensor, each worker clones its piece from there
   ``shardload-thread``       ``load_sharded`` on a started ``ThreadedSession(N)``
   ``shardload-process``      ``load_sharded`` on a started ``ProcessSession(N)``

   Every method's pieces are checked with ``torch.equal`` against the reference (outside the
   timing). With ``--cold`` each N is run a second time with the page cache dropped before
   every method (``drop_caches``, else ``posix_fadvise``; whether the drop happened is checked
   with ``mincore`` and reported).
3. Prints the medians, their ratios to ``floor`` and to ``shardload-thread``, memory, the
   issue's targets as PASS/MISS (a report, not an assertion) and, with ``--json``, writes
   everything as one JSON object (``shardbench/harness.py``'s header first); with
   ``--figures DIR``, load time and peak memory against N as PNGs there
   (``shardbench/figures.py``). Where CUDA is available, a CUDA section follows: every N,
   shardload staged onto the devices and each peer that reaches a GPU. ``--cuda-only`` runs
   that section alone (the GPU check: ``gpu_check.sh``); ``--cuda-stand-in`` runs its code
   with CPU workers (the check's dry run, not a measurement).

This script parses the flags; the benchmark is the package ``shardbench`` next to it, one
module per concern (``shardbench/__init__.py`` lists them). See ``benchmarks/README.md`` for how
to read the output.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    # shardbench imports from here; worker processes take this sys.path, so the plugin
    # shardbench.worker (the benchmark's session function) imports there too
    sys.path.insert(0, HERE)

from shardbench import harness  # noqa: E402
from shardbench.checkpoints import DEFAULT_INTERMEDIATE  # noqa: E402
from shardbench.methods import METHODS  # noqa: E402
from shardbench.runner import run  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument(
        "--size-gb",
        type=float,
        default=1.5,
        help="checkpoint size in GB (1e9 bytes), within about 10%%; below about "
        "0.66 GB (one 7B-style layer), smaller dims",
    )
    ap.add_argument("--shards", default="1,2,4,8", help="comma-separated worker counts")
    harness.add_common(
        ap,
        runs=3,
        runs_help="repetitions per method and N",
        dir=True,
        json_help="write the results as JSON here",
        figures=True,
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="also run every method with the page cache dropped before it",
    )
    ap.add_argument(
        "--cold-drop",
        choices=("auto", "fadvise"),
        default="auto",
        help="how --cold drops the cache: drop_caches (root, machine-wide) and "
        "posix_fadvise on the file (auto), or posix_fadvise only",
    )
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of: " + ", ".join(METHODS),
    )
    ap.add_argument(
        "--model",
        choices=("dense", "moe"),
        default="dense",
        help="dense: a Llama (2,343 tensors at 0.5 GB); moe: a Qwen2-MoE with 60 "
        "experts a layer (14,291 tensors at 0.5 GB)",
    )
    ap.add_argument(
        "--intermediate",
        type=int,
        default=None,
        help=f"MLP size (default {DEFAULT_INTERMEDIATE}; 3072 for the small dims)",
    )
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA section")
    ap.add_argument(
        "--cuda-only",
        action="store_true",
        help="the CUDA section alone (at every N of --shards); exit 4 without CUDA",
    )
    ap.add_argument(
        "--cuda-stand-in",
        action="store_true",
        help="run the CUDA section with CPU workers and no bandwidth figure: the "
        "code path, not a measurement (the GPU check's dry run)",
    )
    args = ap.parse_args(argv)
    args.shards = harness.int_list(ap, args.shards)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        ap.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    harness.check_runs(ap, args)
    if args.no_cuda and (args.cuda_only or args.cuda_stand_in):
        ap.error("--no-cuda contradicts --cuda-only and --cuda-stand-in")
    if args.size_gb <= 0:
        ap.error("--size-gb must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(args, harness.Bench("bench_load", args))


if __name__ == "__main__":
    sys.exit(main())
