"""The load benchmark's report: runs summarised into rows (the JSON's ``results``), the tables
printed from them, the issue's targets as PASS, MISS or n/a (a report, never an assertion:
they do not change the exit status) and the machine's description (the JSON file: the
harness, ``harness.py``)."""

from __future__ import annotations

import os
import platform
import statistics

import numpy as np
import torch

from . import GB, MiB
from .methods import METHODS, SHARDLOAD
from .peers import PEERS

# ==== rows ======================================================================================


def summarise(all_runs: dict) -> list[dict]:
    """{(pass, N): {method: [measure.Run]}} -> one row per pass, N and method, in table order."""
    rows = []
    for (mode, n), by_method in all_runs.items():
        by_method = {m: rs for m, rs in by_method.items() if rs}
        medians = {m: statistics.median(r.seconds for r in rs) for m, rs in by_method.items()}
        for method in METHODS:
            if method not in by_method:
                continue
            rs = by_method[method]
            med = medians[method]
            floor, thread = medians.get("floor"), medians.get("shardload-thread")
            kept = rs[0].kept
            moved = rs[0].moved if rs[0].moved is not None else sum(kept)
            checks = [r.check for r in rs if r.check is not None]
            verified = (
                None
                if not checks or all(c.verified is None for c in checks)
                else all(c.verified for c in checks)
            )
            owns = [c.owns for c in checks if c.owns is not None]
            row = {
                "method": method,
                "num_shards": n,
                "cache": mode,
                "median_s": med,
                "min_s": min(r.seconds for r in rs),
                "runs_s": [r.seconds for r in rs],
                "ratio_to_floor": med / floor if floor else None,
                "ratio_to_shardload_thread": med / thread if thread else None,
                "bytes_read_per_worker": rs[0].read,
                "kept_bytes_per_worker": kept,
                "gb_per_s": moved / med / GB if med > 0 else None,
                # peak minus the baseline just before the method started, worst run
                "peak_rss_bytes": max(r.peak[0] - r.base[0] for r in rs),
                "peak_rss_abs_bytes": max(r.peak[0] for r in rs),
                "baseline_rss_bytes": min(r.base[0] for r in rs),
                "peak_anon_bytes": max(r.peak[1] - r.base[1] for r in rs),
                "peak_anon_abs_bytes": max(r.peak[1] for r in rs),
                "cpu_s": [r.cpu_s for r in rs],
                # CPU time other processes used while the method ran: how loaded the machine was
                "other_cpu_s": [r.other_cpu_s for r in rs],
                "other_load": min(
                    1.0, max(r.other_cpu_s / (r.seconds * (os.cpu_count() or 1)) for r in rs)
                ),
                "verified": verified,
                "owns_memory": (all(owns) if owns else None),
                "verify_detail": "; ".join(sorted({c.detail for c in checks})) or None,
                "runs_checked": len([c for c in checks if c.verified is not None]),
            }
            if mode == "cold":
                drops = [r.drop for r in rs if r.drop is not None]
                row["cold_drops"] = drops
                row["cold_dropped"] = (
                    None
                    if any(d["dropped"] is None for d in drops)
                    else all(d["dropped"] for d in drops)
                )
            if rs[0].loader_seconds is not None:
                row["loader_stats_s"] = [r.loader_seconds for r in rs]
            rows.append(row)
    return rows


def wrong_pieces(report: dict) -> list[str]:
    """Every row, CPU or CUDA, whose pieces were not equal to shardload's."""
    wrong = [
        f"{r['method']} N={r['num_shards']} ({r['cache']})"
        for r in report["results"]
        if r["verified"] is False
    ]
    wrong += [
        f"cuda {r['method']} N={r['num_shards']}"
        for r in report.get("cuda_results", [])
        if r["verified"] is False
    ]
    return wrong


# ==== tables ====================================================================================


def _size(b: float | None) -> str:
    if b is None:
        return "-"
    if abs(b) >= 1 << 30:
        return f"{b / (1 << 30):.2f}G"
    return f"{b / MiB:.0f}M"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _check_cell(verified: bool | None, owns: bool | None) -> str:
    if verified is None:
        return "-"
    if not verified:
        return "WRONG"
    return "equal" if owns is not False else "equal,view"


def _format(lines: list[tuple]) -> str:
    widths = [max(len(line[k]) for line in lines) for k in range(len(lines[0]))]
    out = []
    for j, line in enumerate(lines):
        out.append(
            "  ".join(
                c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(line, widths))
            )
        )
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    head = (
        "method",
        "N",
        "median s",
        "min s",
        "GB/s",
        "vs floor",
        "vs thread",
        "read/wkr",
        "read tot",
        "peak dRSS",
        "peak RSS",
        "dAnon",
        "cpu s",
        "others",
        "check",
    )
    lines = [head]
    for r in rows:
        reads = r["bytes_read_per_worker"]
        lines.append(
            (
                r["method"],
                str(r["num_shards"]),
                f"{r['median_s']:.3f}",
                f"{r['min_s']:.3f}",
                fmt_num(r["gb_per_s"]),
                _ratio(r["ratio_to_floor"]),
                _ratio(r["ratio_to_shardload_thread"]),
                _size(max(reads)),
                _size(sum(reads)),
                _size(r["peak_rss_bytes"]),
                _size(r["peak_rss_abs_bytes"]),
                _size(r["peak_anon_bytes"]),
                f"{statistics.median(r['cpu_s']):.2f}",
                f"{100 * r['other_load']:.0f}%",
                _check_cell(r["verified"], r["owns_memory"]),
            )
        )
    return _format(lines)


def cuda_table(cuda: dict) -> str:
    head = (
        "method",
        "N",
        "median s",
        "min s",
        "GB/s",
        "of pinned",
        "vs thread",
        "host dRSS",
        "dAnon",
        "check",
    )
    lines = [head]
    for r in cuda["results"]:
        lines.append(
            (
                r["method"],
                str(r["num_shards"]),
                f"{r['median_s']:.3f}",
                f"{r['min_s']:.3f}",
                fmt_num(r["gb_per_s"]),
                fmt_num(r["fraction_of_pinned"]),
                _ratio(r["ratio_to_shardload_thread"]),
                _size(r["peak_rss_bytes"]),
                _size(r["peak_anon_bytes"]),
                _check_cell(r["verified"], r["owns_memory"]),
            )
        )
    return _format(lines)


# ==== targets ===================================================================================


def _target(name: str, value: float | None, limit: float, ok: bool | None, unit: str) -> dict:
    return {
        "target": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "result": "n/a" if ok is None else ("PASS" if ok else "MISS"),
    }


def targets(rows: list[dict], largest_tensor: int) -> list[dict]:
    """The issue's targets, each PASS, MISS or n/a (a method, N or pass that was not run)."""
    by = {(r["cache"], r["method"], r["num_shards"]): r for r in rows}
    ns = sorted({r["num_shards"] for r in rows})
    modes = [m for m in ("warm", "cold") if any(r["cache"] == m for r in rows)]
    out: list[dict] = []

    def get(method, n, key="median_s", mode="warm"):
        r = by.get((mode, method, n))
        return None if r is None else r[key]

    def add(*a):
        out.append(_target(*a))

    for method, limit in (("shardload-thread", 1.15), ("shardload-process", 1.5)):
        v = get(method, 4, "ratio_to_floor")
        add(
            f"{method} N=4 within {limit}x of floor",
            v,
            limit,
            None if v is None else v <= limit,
            "x floor",
        )
    for method in SHARDLOAD:
        r1, r8 = get(method, 1, "ratio_to_floor"), get(method, 8, "ratio_to_floor")
        x = None if r1 is None or r8 is None else r8 / r1
        add(
            f"{method} ratio to floor at N=8 within 1.25x of N=1",
            x,
            1.25,
            None if x is None else x <= 1.25,
            "ratio(N=8)/ratio(N=1)",
        )
    for mode in modes:
        for n in ns:
            s = get("shardload-thread", n, mode=mode)
            ran = {p: get(p, n, mode=mode) for p in PEERS}
            ran = {p: v for p, v in ran.items() if v is not None}
            if s is None or not ran:
                add(
                    f"shardload-thread faster than every real peer at N={n} ({mode})",
                    None,
                    1.0,
                    None,
                    "peer/thread",
                )
                continue
            closest = min(ran, key=lambda p: ran[p])
            x = ran[closest] / s
            add(
                f"shardload-thread faster than every real peer at N={n} ({mode}; closest: "
                f"{closest})",
                x,
                1.0,
                x > 1.0,
                "peer/thread",
            )
    s, d = get("shardload-thread", 4), get("disco-emulated", 4)
    x = None if s is None or d is None else d / s
    add(
        "shardload-thread faster than disco-emulated at N=4 (an emulation)",
        x,
        1.0,
        None if x is None else x > 1.0,
        "disco/thread",
    )
    if "cold" in modes:
        for n in ns:
            s, f = get("shardload-thread", n, mode="cold"), get("read-file", n, mode="cold")
            x = None if s is None or f is None else s / f
            add(
                f"shardload-thread N={n} (cold) within 1.1x of read-file",
                x,
                1.1,
                None if x is None else x <= 1.1,
                "x read-file",
            )
    for method in SHARDLOAD:
        for n in ns:
            r = by.get(("warm", method, n))
            if r is None:
                continue
            limit = sum(r["kept_bytes_per_worker"]) + 2 * largest_tensor + 300 * MiB
            for key, what in (("peak_rss_bytes", "VmRSS"), ("peak_anon_bytes", "RssAnon")):
                add(
                    f"{method} N={n} peak {what} <= shards + 2x largest tensor + 300 MiB",
                    r[key],
                    limit,
                    r[key] <= limit,
                    "bytes",
                )
    return out


def cuda_targets(cuda: dict) -> list[dict]:
    """The CUDA section's targets: shardload-thread's bandwidth against the pinned one, and its
    host memory against its staging buffers."""
    out = []
    by = {(r["method"], r["num_shards"]): r for r in cuda["results"]}
    r1 = by.get(("shardload-thread", 1))
    v = None if r1 is None else r1["fraction_of_pinned"]
    out.append(
        _target(
            "cuda: shardload-thread N=1 GB/s >= 0.8x pinned host-to-device bandwidth",
            v,
            0.8,
            None if v is None else v >= 0.8,
            "x pinned",
        )
    )
    per_worker = cuda["staging_bytes_per_worker"]
    for (method, n), r in sorted(by.items()):
        if method != "shardload-thread":
            continue
        limit = per_worker * n + 300 * MiB
        for key, what in (("peak_rss_bytes", "VmRSS"), ("peak_anon_bytes", "RssAnon")):
            out.append(
                _target(
                    f"cuda: shardload-thread N={n} host peak {what} <= staging "
                    f"({_size(per_worker)} x {n} workers) + 300 MiB",
                    r[key],
                    limit,
                    r[key] <= limit,
                    "bytes",
                )
            )
    return out


# ==== printing ==================================================================================


def print_targets(checks: list[dict]) -> None:
    for c in checks:
        if c["value"] is None:
            shown = "n/a"
        elif c["unit"] == "bytes":
            shown = f"{_size(c['value'])} (limit {_size(c['limit'])})"
        else:
            shown = f"{c['value']:.2f} {c['unit']} (limit {c['limit']})"
        print(f"  {c['result']:<4}  {c['target']}: {shown}", flush=True)


def print_report(report: dict) -> None:
    """The CPU part of the report, to stdout: the checkpoint, the machine, a table per pass,
    what was skipped, the sessions' start-up, the targets."""
    ckpt, machine, g = report["checkpoint"], report["machine"], report["checkpoint"]["geometry"]
    print(
        f"\ncheckpoint: {ckpt['tensor_bytes'] / GB:.2f} GB, {ckpt['num_tensors']} "
        f"tensors, {g['layers']} layers, hidden {g['hidden']}, intermediate "
        f"{g['intermediate']}, {g['heads']} heads / {g['kv_heads']} KV, GPTQ {g['bits']}-bit "
        f"group {g['group']}; largest tensor {_size(ckpt['largest_tensor_bytes'])}"
    )
    print(
        f"machine: {machine['cpu']}, {machine['cpu_count']} CPUs, torch {machine['torch']}; "
        f"median of {report['runs']} run(s)"
    )
    rows = report["results"]
    for mode in ("warm", "cold"):
        mode_rows = [r for r in rows if r["cache"] == mode]
        if not mode_rows:
            continue
        if mode == "warm":
            print("\nwarm page cache (the file read once before)\n")
        else:
            drops = [d for r in mode_rows for d in r["cold_drops"]]
            how = sorted({d["how"] for d in drops if d["how"]})
            worst = max(
                (d["resident_after"] for d in drops if d["resident_after"] is not None),
                default=None,
            )
            print(
                f"\ncold page cache (dropped before every method: {', '.join(how)}; "
                + (
                    "drops not verifiable"
                    if worst is None
                    else f"at most {100 * worst:.1f}% of the file resident after a drop"
                )
                + ")\n"
            )
        print(table(mode_rows), flush=True)
    cold = report["cold"]
    if cold["requested"] and cold["skipped"]:
        print(f"\ncold mode skipped: {cold['skipped']}")
    for m, why in report["skipped"].items():
        print(f"\nskipped: {m}: {why}", end="")
    print()
    if report["session_startup_s"]:
        print(
            "\nsession start-up (s): "
            + "; ".join(
                f"{k} " + ", ".join(f"N={n}: {v:.2f}" for n, v in d.items())
                for k, d in report["session_startup_s"].items()
            )
        )
    print("\ntargets:")
    print_targets(report["targets"])


def print_cuda(cuda: dict, checks: list[dict]) -> None:
    """The CUDA section of the report, to stdout."""
    print(
        f"\nCUDA: {', '.join(cuda['devices'])}; pinned host-to-device "
        f"{fmt_num(cuda['pinned_h2d_gb_per_s'])} GB/s; staging {cuda['staging']}\n"
    )
    print(cuda_table(cuda))
    for m, why in cuda["skipped"].items():
        print(f"skipped on CUDA: {m}: {why}")
    print("\ncuda targets:")
    print_targets(checks)


# ==== the machine, the JSON =====================================================================


def machine_info(zero_copy: bool) -> dict:
    import importlib.metadata as md

    import safetensors

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    versions = {}
    # the peers' own distributions (safetensors has a key of its own)
    for dist in dict.fromkeys(p.pip_name for p in PEERS.values() if p.module != "safetensors"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "peers": versions,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_bytes": mem,
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "cuda": torch.cuda.is_available(),
        "safetensors_get_tensor_zero_copy": zero_copy,
    }
