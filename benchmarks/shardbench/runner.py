"""One run of the load benchmark, from the parsed flags to the exit status: the checkpoint, then
for each N a warm pass (and a cold one) of every method, repeated and rotated, then the report,
the JSON and, where CUDA is available, the CUDA section. Progress goes to stderr, the report to
stdout."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

import torch

from shardload import ShardInfo, open_checkpoint
from shardload.errors import PlanError
from shardload.planners import plan_for

from . import GB, MiB
from .checkpoints import (
    MODEL_FILE,
    PLAN_FILE,
    choose_geometry,
    choose_moe_geometry,
    default_dir,
    ensure_checkpoint,
)
from .cuda import bench_cuda
from .harness import Bench, rotated
from .measure import PageCache, RssSampler, cold_mode_check, measure, warm_page_cache
from .methods import METHODS, SHARDLOAD, Case, reference_pieces
from .peers import zero_copy_get_tensor
from .report import (
    cuda_targets,
    machine_info,
    print_cuda,
    print_report,
    summarise,
    targets,
    wrong_pieces,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plan_at(ckpt, info: ShardInfo, n: int) -> ShardInfo:
    """``info`` where it splits the checkpoint over ``n`` workers, else the planner's plan
    zero-padded for ``n`` (heads or groups that do not divide: ``shardload.take_units``), as
    ``shardload load`` does; ``PlanError`` where neither can."""
    metadata = ckpt.metadata()
    try:
        info.bind(n).validate(metadata)
        return info
    except PlanError:
        padded = plan_for(ckpt, num_shards=n)
        validated = padded.bind(n).validate(metadata)
        units = sum(1 for p in validated for s in p.steps if s.func == "shardload.take_units")
        log(
            f"N={n}: the saved plan does not divide; the planner's plan padded for N={n} "
            f"({units} tensors through shardload.take_units)"
        )
        return padded


def bench_n(
    ckpt_dir: str,
    info: ShardInfo,
    n: int,
    methods: list[str],
    runs: int,
    sampler: RssSampler,
    zero_copy: bool,
    cache: PageCache | None,
    skipped: dict[str, str],
) -> tuple[dict, dict[str, float]]:
    """Every method at this N: {"warm": {method: [Run]}, "cold": {...}} and start-up times. A
    peer that fails is dropped from both passes and recorded in ``skipped``."""
    case, startup = Case.open(
        ckpt_dir, info, n, zero_copy, process_session="shardload-process" in methods
    )
    if case.process_session is not None:
        sampler.pids = case.process_session.pids  # its workers count in every method's memory
    passes = ["warm"] + (["cold"] if cache is not None else [])
    results: dict[str, dict] = {c: {m: [] for m in methods} for c in passes}
    try:
        case.reference = reference_pieces(ckpt_dir, info, case.thread_session)
        active = list(methods)
        for mode in passes:
            if mode == "cold":
                log(f"  N={n}: cold runs (the page cache dropped before every method)")
            for r in range(runs):
                for method in rotated(active, r):
                    if method not in active:
                        continue
                    # pieces in worker processes come back over pipes: checked once per pass
                    check = method != "shardload-process" or r == 0
                    run = measure(case, method, sampler, cache if mode == "cold" else None, check)
                    if run.error is not None:
                        skipped[method] = f"failed at N={n} ({mode}): {run.error}"
                        log(f"  N={n} {method}: skipped, {run.error}")
                        active.remove(method)
                        for c in passes:
                            results[c].pop(method, None)
                        continue
                    results[mode][method].append(run)
                    c = run.check
                    log(
                        f"  N={n} {mode} run {r + 1}/{runs} {method:<22} {run.seconds:8.3f} s  "
                        f"peak +{(run.peak[0] - run.base[0]) / MiB:8.1f} MiB  cpu "
                        f"{run.cpu_s:5.2f} s, others {run.other_cpu_s:5.2f} s"
                        + (
                            ""
                            if c is None or c.verified is None
                            else "  equal"
                            if c.verified
                            else f"  WRONG: {c.detail}"
                        )
                        + (
                            ""
                            if run.drop is None
                            else f"  [drop: {run.drop['how']}, {run.drop['evidence']}]"
                        )
                    )
            if mode == "cold":
                warm_page_cache(case.file)
    finally:
        sampler.pids = []
        case.close()
    expected = case.plan.bytes_per_worker()
    for mode in results.values():
        for method, rs in mode.items():
            for run in rs:
                if method != "read-file" and any(k != expected for k in run.kept):
                    raise SystemExit(
                        f"{method} at N={n} kept {run.kept} bytes per worker; "
                        f"the plan says {expected}: the method is wrong"
                    )
    return results, {k: v for k, v in startup.items() if k in methods}


#: the exit status of ``--cuda-only`` where there is no CUDA device (and no ``--cuda-stand-in``)
NO_CUDA = 4


def run(args: argparse.Namespace, bench: Bench | None = None) -> int:
    """The benchmark for ``bench_load.py``'s parsed flags; the exit status (0; 2: a worker
    count the checkpoint cannot be split over; 3: some method's pieces were wrong; 4:
    ``--cuda-only`` without CUDA). ``bench`` (the harness: the environment, the JSON, the
    figures) is made here if not given."""
    bench = bench or Bench("bench_load", args)
    cuda_only, stand_in = getattr(args, "cuda_only", False), getattr(args, "cuda_stand_in", False)
    if cuda_only and not stand_in and not torch.cuda.is_available():
        log(
            "error: --cuda-only needs a CUDA device, and torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); --cuda-stand-in runs the section on the CPU"
        )
        return NO_CUDA
    root = os.path.abspath(args.dir or default_dir())
    geom = (
        choose_moe_geometry(args.size_gb)
        if args.model == "moe"
        else choose_geometry(args.size_gb, args.intermediate)
    )
    ckpt_dir, made, make_s = ensure_checkpoint(root, geom)
    file = os.path.join(ckpt_dir, MODEL_FILE)
    log(
        f"checkpoint: {ckpt_dir}, {geom.total_bytes() / GB:.2f} GB, {geom.tensors} tensors "
        f"({'written in %.1f s' % make_s if made else 'cached'})"
    )
    info = ShardInfo.load(os.path.join(ckpt_dir, PLAN_FILE))
    plans: dict[int, ShardInfo] = {}
    with open_checkpoint(ckpt_dir) as ckpt:
        metadata = ckpt.metadata()
        for n in args.shards:
            try:
                plans[n] = plan_at(ckpt, info, n)
            except PlanError as exc:
                log(f"error: this checkpoint cannot be split over {n} workers: {exc}")
                return 2
    padded = [n for n in args.shards if plans[n] is not info]
    largest = max(metadata.values(), key=lambda m: m.nbytes)

    skipped: dict[str, str] = {}
    methods = []
    for m in [] if cuda_only else args.methods:
        why = METHODS[m].unavailable(file)
        if why is not None:
            skipped[m] = why
            log(f"{m}: skipped, {why}")
        else:
            methods.append(m)
    cache, cold_skipped, cold_trial = None, None, None
    if args.cold:
        cache, cold_skipped, cold_trial = cold_mode_check(file, args.cold_drop, log)
        if cold_skipped:
            log(f"cold mode skipped: {cold_skipped}")
    warm_s = warm_page_cache(file)
    if cuda_only:
        log("--cuda-only: the CPU methods are not run")
    zero_copy = zero_copy_get_tensor(file, largest.name)
    log(
        f"page cache warmed in {warm_s:.2f} s; {os.cpu_count()} CPUs; "
        f"safetensors get_tensor zero-copy: {zero_copy}"
    )

    sampler = RssSampler()
    all_runs: dict[tuple[str, int], dict] = {}
    startup: dict[str, dict[str, float]] = {k: {} for k in SHARDLOAD}
    try:
        for n in args.shards:
            runs, started = bench_n(
                ckpt_dir, plans[n], n, methods, args.runs, sampler, zero_copy, cache, skipped
            )
            for mode, by_method in runs.items():
                all_runs[(mode, n)] = by_method
            for k, v in started.items():
                startup[k][str(n)] = v

        rows = summarise(all_runs)
        checks = targets(rows, largest.nbytes)
        checkpoint = {
            "path": ckpt_dir,
            "file": file,
            "file_bytes": os.path.getsize(file),
            "tensor_bytes": sum(m.nbytes for m in metadata.values()),
            "num_tensors": len(metadata),
            "largest_tensor": largest.name,
            "largest_tensor_bytes": largest.nbytes,
            "geometry": asdict(geom),
            "plan": os.path.join(ckpt_dir, PLAN_FILE),
            "written_now": made,
            "padded_n": padded,
        }
        report = {
            "machine": machine_info(zero_copy),
            "checkpoint": checkpoint,
            "results": rows,
            "skipped": skipped,
            "cold": {
                "requested": args.cold,
                "ran": cache is not None,
                "skipped": cold_skipped,
                "trial": cold_trial,
            },
            "session_startup_s": {k: v for k, v in startup.items() if v},
            "runs": args.runs,
            "targets": checks,
        }
        bench.write(report)  # the CPU results stand even if the CUDA part dies
        if not cuda_only:
            print_report(report)

        if stand_in or (torch.cuda.is_available() and not args.no_cuda):

            def so_far(section: dict) -> None:  # each N's rows kept as soon as it is done
                bench.write(
                    {
                        **report,
                        "cuda": {k: v for k, v in section.items() if k != "results"},
                        "cuda_results": section["results"],
                    }
                )

            try:
                cuda = bench_cuda(
                    ckpt_dir,
                    plans,
                    args.shards,
                    args.runs,
                    sampler,
                    zero_copy,
                    log,
                    dry_run_on_cpu=stand_in,
                    after_each_n=so_far,
                )
                report["cuda"] = {k: v for k, v in cuda.items() if k != "results"}
                report["cuda_results"] = cuda["results"]
                ctargets = cuda_targets(cuda)
                report["targets"] = checks + ctargets
                print_cuda(cuda, ctargets)
            except Exception as exc:  # noqa: BLE001 - reported: never fails the CPU benchmark
                import traceback

                traceback.print_exc()
                log(f"cuda section failed: {type(exc).__name__}: {exc}")
                report["cuda_error"] = f"{type(exc).__name__}: {exc}"
                print(f"\ncuda section failed: {type(exc).__name__}: {exc}")
                if cuda_only:
                    bench.finish(report)
                    return 1
        bench.finish(report)
        if args.json:
            print(f"\nwrote {args.json}")
    finally:
        sampler.close()
    wrong = wrong_pieces(report)
    if wrong:
        print(f"\nWRONG PIECES (not equal to shardload's): {', '.join(wrong)}")
        return 3
    return 0
