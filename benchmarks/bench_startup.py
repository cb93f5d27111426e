#!/usr/bin/env python
"""Benchmark: how long a ProcessSession takes to start, forked from the fork server (now) and
as fresh interpreters (before), against one ``python -c "import torch, shardload"``.

    python benchmarks/bench_startup.py [--shards 1,2,4,8] [--runs R] [--no-spawn]
                                       [--no-distributed] [--json FILE]

Every figure is measured in this one run, each in a fresh controller interpreter (so nothing
is cached in it from a previous measurement), R times, and the median is reported:

``import``           ``python -c "import torch, shardload"``, wall time of the whole process
``forkserver``       ``ProcessSession(N)`` constructed until ready, in a controller that has
                     imported shardload and torch (not timed) and has no fork server yet: the
                     server's start (an interpreter importing torch) is part of the time, as
                     for ``shardload load --session process``
``forkserver-warm``  a second ``ProcessSession(N)`` in that controller: the server is up
``spawn``            the same with ``start_method="spawn"``: one fresh interpreter per worker,
                     each importing torch, as before the fork server

The repetitions are interleaved (every method at every N, then again), so a busy machine slows
them alike. Then the issue's two targets, as ratios (a report: the exit status is 0 whatever
they say): forkserver at the largest N within 1.5x of forkserver at N = 1, and within 2x of
``import``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))

from shardbench import harness  # noqa: E402

#: the controller: import (untimed), then time the session's construction, and a second one
CONTROLLER = """
import json, sys, time
from shardload.sessions.process import ProcessSession

n, method, distributed = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
out = {}
for key in ("cold", "warm") if method == "forkserver" else ("cold",):
    t0 = time.perf_counter()
    session = ProcessSession(n, start_method=method, distributed=distributed)
    out[key] = time.perf_counter() - t0
    t1 = time.perf_counter()
    session.close()
    out[key + "_close"] = time.perf_counter() - t1
print(json.dumps(out))
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("SHARDLOAD_WORKER_START", None)  # the script says which
    return env


def time_import() -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import torch, shardload"], check=True, env=_env(), cwd=REPO
    )
    return time.perf_counter() - t0


def time_session(n: int, method: str, distributed: bool) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CONTROLLER, str(n), method, "1" if distributed else "0"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the {method} controller at N={n} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv=None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--shards", default="1,2,4,8", help="worker counts N (default 1,2,4,8)")
    harness.add_common(parser, runs=3, json_help="also write the figures as JSON")
    parser.add_argument(
        "--no-spawn",
        action="store_true",
        help="skip the fresh-interpreter sessions (slow on few cores)",
    )
    parser.add_argument(
        "--no-distributed",
        action="store_true",
        help="sessions without a process group (distributed=False)",
    )
    args = parser.parse_args(argv)
    harness.check_runs(parser, args)
    shards = harness.int_list(parser, args.shards)
    bench = harness.Bench("bench_startup", args)
    methods = ["forkserver"] + ([] if args.no_spawn else ["spawn"])
    distributed = not args.no_distributed

    times: dict[str, dict[int, list[float]]] = {"import": {0: []}}
    for m in methods + ["forkserver-warm"]:
        times[m] = {n: [] for n in shards}
    closes: dict[str, dict[int, list[float]]] = {m: {n: [] for n in shards} for m in methods}
    for run in range(args.runs):
        print(f"run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
        times["import"][0].append(time_import())
        for n in shards:
            for method in methods:
                got = time_session(n, method, distributed)
                times[method][n].append(got["cold"])
                closes[method][n].append(got["cold_close"])
                if "warm" in got:
                    times["forkserver-warm"][n].append(got["warm"])
                print(f"  N={n} {method}: {got['cold']:.2f} s", file=sys.stderr, flush=True)

    med = {m: {n: harness.median(v) for n, v in d.items() if v} for m, d in times.items()}
    imp = med["import"][0]
    print(
        f"\nmachine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
        f"distributed={distributed}, {args.runs} runs, medians (s)"
    )
    print(f'python -c "import torch, shardload": {imp:.2f} s')
    header = ["method"] + [f"N={n}" for n in shards] + ["close N=" + str(shards[-1])]
    print("\n" + "  ".join(f"{h:>16}" for h in header))
    for m in methods + ["forkserver-warm"]:
        close = (
            harness.median(closes[m][shards[-1]]) if m in closes and closes[m][shards[-1]] else None
        )
        row = (
            [m]
            + [f"{med[m][n]:.2f}" for n in shards]
            + [f"{close:.2f}" if close is not None else "-"]
        )
        print("  ".join(f"{c:>16}" for c in row))

    lo, hi = shards[0], shards[-1]
    fork_lo, fork_hi = med["forkserver"][lo], med["forkserver"][hi]
    targets = [
        (f"forkserver N={hi} / forkserver N={lo}", fork_hi / fork_lo, 1.5),
        (f"forkserver N={hi} / import", fork_hi / imp, 2.0),
    ]
    print("\ntargets (ratios from this run):")
    for name, ratio, limit in targets:
        verdict = "PASS" if ratio <= limit else "MISS"
        print(f"  {name}: {ratio:.2f} (<= {limit}) {verdict}")
    if "spawn" in med:
        print(
            f"  for comparison, spawn N={hi} / spawn N={lo}: "
            f"{med['spawn'][hi] / med['spawn'][lo]:.2f}; spawn N={hi} / import: "
            f"{med['spawn'][hi] / imp:.2f}; spawn / forkserver at N={hi}: "
            f"{med['spawn'][hi] / fork_hi:.1f}x"
        )
    bench.finish(
        {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "runs": args.runs,
            "distributed": distributed,
            "times_s": {m: {str(n): v for n, v in d.items()} for m, d in times.items()},
            "close_s": {m: {str(n): v for n, v in d.items()} for m, d in closes.items()},
            "targets": {name: {"ratio": r, "limit": lim} for name, r, lim in targets},
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
