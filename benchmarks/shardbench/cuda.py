"""The load benchmark's CUDA section (only where CUDA is available; never required):
shardload-thread, through its staged pipeline, and the peers that reach a GPU, with worker i on
``cuda:(i mod device count)``, against the pinned host-to-device bandwidth measured in the same
run. Every piece is checked on the device against shardload's, and shardload's against a CPU
load of the same plan."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from shardload import ShardInfo, Staging, ThreadedSession

from . import GB, MiB, peers
from .checkpoints import MODEL_FILE, bind_plan
from .harness import rotated
from .measure import RssSampler, Window, free_memory
from .methods import Check, Outcome, check_pieces, kept_bytes, reference_pieces, shardload_load
from .report import fmt_num

#: the staging the CUDA section loads with
CUDA_STAGING = dict(buffers=4, buffer_mib=32)


def pinned_h2d_gb_per_s(nbytes: int = 256 * MiB, reps: int = 5) -> float:
    """Host-to-device bandwidth from pinned memory: a 256 MiB uint8 tensor copied to cuda:0
    with non_blocking=True, synchronised, median of 5 (after one warm-up copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(0)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(0)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0)
        times.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / GB


def bench_cuda(
    ckpt_dir: str,
    plans: Mapping[int, ShardInfo],
    shards: list[int],
    runs: int,
    sampler: RssSampler,
    zero_copy: bool,
    log,
    dry_run_on_cpu: bool = False,
    after_each_n: Callable[[dict], None] | None = None,
) -> dict:
    """shardload-thread and the CUDA peers with worker i on cuda:(i mod device count), at
    every N of ``shards`` (with ``plans[n]``); every piece checked against shardload's (on the
    device, all of them), shardload's own checked against a CPU load of the same plan.
    ``after_each_n`` gets the section so far once each N is done (so a run cut short keeps what
    it measured).

    ``dry_run_on_cpu``: the same code with every worker on the CPU and no bandwidth figure (how
    this section is exercised on a machine without CUDA: ``--cuda-stand-in``; not a
    measurement)."""
    file = os.path.join(ckpt_dir, MODEL_FILE)
    cuda = not dry_run_on_cpu
    count = torch.cuda.device_count() if cuda else 1
    staging = Staging(**CUDA_STAGING)
    pinned = pinned_h2d_gb_per_s() if cuda else None
    names = [torch.cuda.get_device_name(d) for d in range(count)] if cuda else ["cpu (dry run)"]
    log(
        f"cuda: {count} device(s), {names[0]}; pinned host-to-device "
        f"{fmt_num(pinned)} GB/s; staging {staging}"
    )
    out: dict[str, Any] = {
        "devices": names,
        "pinned_h2d_gb_per_s": pinned,
        "staging": asdict(staging),
        "staging_bytes_per_worker": staging.nbytes,
        "results": [],
        "skipped": {},
    }

    def sync() -> None:
        for d in range(count if cuda else 0):
            torch.cuda.synchronize(d)

    def timed(fn) -> tuple[float, Any, tuple[int, int], tuple[int, int]]:
        sync()
        with Window(sampler, []) as w:
            holder = fn()
            sync()
        return w.seconds, holder, w.base, w.peak

    for n in sorted(set(shards)):
        devices = [torch.device(f"cuda:{i % count}" if cuda else "cpu") for i in range(n)]
        info = plans[n]
        plan = bind_plan(ckpt_dir, info, n)
        session = ThreadedSession(n, device=[str(d) for d in devices])
        pool = ThreadPoolExecutor(n, "cuda-worker")
        job = peers.Job(file, list(plan), n, peers.direct_map(plan, n), pool, devices, zero_copy)

        def shardload_go(info=info, session=session):
            return shardload_load(ckpt_dir, info, session, staging=staging)

        methods: dict[str, Callable[[], Any]] = {"shardload-thread": shardload_go}
        for name, peer in peers.PEERS.items():
            if not peer.cuda:
                continue
            why = peers.unavailable(name, str(devices[0]), file)
            if why is not None:
                out["skipped"][name] = why
                log(f"  cuda N={n} {name}: skipped, {why}")
            else:
                methods[name] = lambda run=peer.run, job=job: run(job)
        try:
            # the reference: shardload's pieces on the devices (this is also its warm-up:
            # CUDA contexts, the allocator), checked in full against a CPU load
            _, first, _, _ = timed(shardload_go)
            reference = [dict(first.worker(i)) for i in range(n)]
            staging_stats = first.stats.staging_per_worker
            del first
            with ThreadedSession(n) as cpu_session:
                cpu = reference_pieces(ckpt_dir, info, cpu_session)
            on_cpu = [{k: v.cpu() for k, v in w.items()} for w in reference]
            vs_cpu = check_pieces(cpu, Outcome([], [], workers=on_cpu), n)
            del cpu, on_cpu
            out.setdefault("shardload_vs_cpu", {})[str(n)] = asdict(vs_cpu)
            log(
                f"  cuda N={n} shardload's pieces vs a CPU load: "
                f"{'equal' if vs_cpu.verified else 'WRONG: ' + vs_cpu.detail}"
            )
            free_memory(session, cuda=cuda)
            times: dict[str, list[tuple[float, tuple, tuple, int]]] = {m: [] for m in methods}
            checks: dict[str, Check] = {}
            order = list(methods)
            for r in range(-1, runs):  # run -1: every peer's warm-up, checked, not counted
                for name in rotated(order, max(r, 0)):
                    if name not in methods:
                        continue
                    try:
                        seconds, holder, base, peak = timed(methods[name])
                    except Exception as exc:
                        if name == "shardload-thread":
                            raise
                        out["skipped"][name] = f"failed: {type(exc).__name__}: {exc}"
                        log(f"  cuda N={n} {name}: skipped, {out['skipped'][name]}")
                        methods.pop(name)
                        times.pop(name)
                        free_memory(session, cuda=cuda)
                        continue
                    got = (
                        Outcome([], [], sharded=holder)
                        if name == "shardload-thread"
                        else Outcome([], [], workers=holder)
                    )
                    c = check_pieces(reference, got, n)
                    if name not in checks or not c.verified:
                        checks[name] = c
                    kept = (
                        sum(holder.stats.bytes_per_worker)
                        if name == "shardload-thread"
                        else sum(kept_bytes(holder))
                    )
                    del holder, got
                    free_memory(session, cuda=cuda)
                    if r >= 0:
                        times[name].append((seconds, base, peak, kept))
                        log(
                            f"  cuda N={n} run {r + 1}/{runs} {name:<22} {seconds:8.3f} s"
                            + ("" if c.verified else f"  WRONG: {c.detail}")
                        )
            thread_median = statistics.median(t[0] for t in times["shardload-thread"])
            for name, ts in times.items():
                med = statistics.median(t[0] for t in ts)
                moved = ts[0][3]
                row = {
                    "method": name,
                    "num_shards": n,
                    "devices": [str(d) for d in devices],
                    "median_s": med,
                    "min_s": min(t[0] for t in ts),
                    "runs_s": [t[0] for t in ts],
                    "bytes_moved": moved,
                    "gb_per_s": moved / med / GB if med > 0 else None,
                    "fraction_of_pinned": (
                        moved / med / GB / pinned if med > 0 and pinned else None
                    ),
                    "ratio_to_shardload_thread": med / thread_median,
                    "peak_rss_bytes": max(t[2][0] - t[1][0] for t in ts),
                    "peak_anon_bytes": max(t[2][1] - t[1][1] for t in ts),
                    "verified": checks[name].verified,
                    "owns_memory": checks[name].owns,
                    "verify_detail": checks[name].detail + ", on the device",
                }
                if name == "shardload-thread":
                    row["staging_per_worker"] = staging_stats
                out["results"].append(row)
        finally:
            reference = []  # the devices' memory, freed before the next N
            pool.shutdown()
            session.close()
            free_memory(cuda=cuda)
        if after_each_n is not None:
            after_each_n(out)
    return out
