"""The figures: load time and peak memory against N, one line per loader, drawn from a run's
JSON (matplotlib, Agg backend: no display).

    python -m shardbench.figures RESULT.json OUT_DIR     # from benchmarks/ (or with it on
                                                         # PYTHONPATH): redraw saved results

``draw_load``     ``bench_load.py``'s report: ``load_time.png``, ``load_memory.png``
``draw_objects``  ``bench_objects.py``'s report: ``objects_time.png``, ``objects_memory.png``
``draw``          either, by the report's ``header`` (or its rows' shape, for a JSON written
                  before the header existed)

Each returns the paths it wrote.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

MiB = 1 << 20
#: the figures' size (inches) and resolution: about 40 KB a PNG
SIZE = (7.0, 4.2)
DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(report: dict) -> str:
    env = (report.get("header") or {}).get("environment") or {}
    if not env:
        return ""
    mem = env.get("memory_bytes")
    return (
        f"{env.get('cpus')} CPUs"
        + (f", {mem / 2**30:.0f} GiB" if mem else "")
        + f"; shardload {env.get('shardload')}"
        + (f" ({env['commit']})" if env.get("commit") else "")
    )


def _plot(
    series: dict[str, dict[int, float]],
    title: str,
    ylabel: str,
    path: str,
    subtitle: str = "",
    reference: dict[int, float] | None = None,
    reference_label: str = "",
) -> str:
    """One line per series ({label: {N: value}}), N on a log2 axis; ``reference`` dotted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=SIZE, dpi=DPI)
    ns = sorted({n for points in series.values() for n in points})
    markers = "os^DvPX*h<>"
    for k, (label, points) in enumerate(series.items()):
        xs = sorted(points)
        dashed = label.endswith("(cold)")
        ax.plot(
            xs,
            [points[n] for n in xs],
            marker=markers[k % len(markers)],
            linestyle="--" if dashed else "-",
            label=label,
            markersize=4,
            linewidth=1.4,
        )
    if reference:
        xs = sorted(reference)
        ax.plot(xs, [reference[n] for n in xs], ":", color="black", label=reference_label)
    if ns:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.minorticks_off()
    ax.set_xlabel("N (workers)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title + ("\n" + textwrap.fill(subtitle, 90) if subtitle else ""), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


# ==== bench_load.py =============================================================================


def draw_load(report: dict, out_dir: str) -> list[str]:
    """``load_time.png`` (median seconds) and ``load_memory.png`` (peak RSS of the process
    tree over its level before the load, MiB; dotted: the bytes the workers keep) against N,
    one line per method and pass (cold dashed)."""
    rows = report.get("results") or []
    cold = any(r["cache"] == "cold" for r in rows)
    times: dict[str, dict[int, float]] = {}
    memory: dict[str, dict[int, float]] = {}
    kept: dict[int, float] = {}
    for r in rows:
        label = r["method"] + (f" ({r['cache']})" if cold else "")
        times.setdefault(label, {})[r["num_shards"]] = r["median_s"]
        if r["cache"] == "warm" and r.get("peak_rss_bytes") is not None:
            memory.setdefault(r["method"], {})[r["num_shards"]] = r["peak_rss_bytes"] / MiB
        if r["method"].startswith("shardload") and r.get("kept_bytes_per_worker"):
            kept[r["num_shards"]] = sum(r["kept_bytes_per_worker"]) / MiB
    ckpt = report.get("checkpoint") or {}
    size = (
        f"{ckpt['tensor_bytes'] / 1e9:.2f} GB, {ckpt['num_tensors']} tensors; "
        if "tensor_bytes" in ckpt
        else ""
    )
    runs = report.get("runs")
    what = f"{size}median of {runs} run(s)" if runs else size.rstrip("; ")
    sub = "; ".join(s for s in (what, _subtitle(report)) if s)
    return [
        _plot(
            times,
            "bench_load.py: load time against N",
            "median seconds",
            os.path.join(out_dir, "load_time.png"),
            sub,
        ),
        _plot(
            memory,
            "bench_load.py: peak memory against N (warm)",
            "peak RSS above the start (MiB)",
            os.path.join(out_dir, "load_memory.png"),
            sub,
            kept,
            "kept by the workers",
        ),
    ]


# ==== bench_objects.py ==========================================================================


def draw_objects(report: dict, out_dir: str) -> list[str]:
    """``objects_time.png`` (median seconds) and ``objects_memory.png`` (the loader tree's
    peak PSS over its level before the load, MiB; dotted: the bytes the workers keep) against
    N, one line per scheme and method."""
    rows = [r for r in report.get("results") or [] if r.get("seconds") is not None]
    times: dict[str, dict[int, float]] = {}
    memory: dict[str, dict[int, float]] = {}
    kept: dict[int, float] = {}
    for r in rows:
        label = f"{r['scheme']}://  {r['method']}"
        times.setdefault(label, {})[r["n"]] = r["seconds"]
        if r.get("peak_pss_bytes") is not None and r.get("base_pss_bytes") is not None:
            memory.setdefault(label, {})[r["n"]] = (r["peak_pss_bytes"] - r["base_pss_bytes"]) / MiB
        if r.get("kept_bytes") is not None:
            kept[r["n"]] = r["kept_bytes"] / MiB
    fb = report.get("file_bytes")
    runs = report.get("runs")
    what = (
        (f"{fb / 1e6:.0f} MB file; " if fb else "") + (f"median of {runs} run(s)" if runs else "")
    ).strip("; ")
    sub = "; ".join(s for s in (what, _subtitle(report)) if s)
    return [
        _plot(
            times,
            "bench_objects.py: object storage load time against N",
            "median seconds",
            os.path.join(out_dir, "objects_time.png"),
            sub,
        ),
        _plot(
            memory,
            "bench_objects.py: peak memory against N",
            "peak PSS above the start (MiB)",
            os.path.join(out_dir, "objects_memory.png"),
            sub,
            kept,
            "kept by the workers",
        ),
    ]


# ==== bench_scale.py ============================================================================


def draw_scale(report: dict, out_dir: str) -> list[str]:
    """``scale_time.png``: each phase against the tensor count, for the checkpoints of one N
    (the first measured); ``scale_n.png``: open + plan (validated) + a rank's read plan against
    N, one line per checkpoint."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    rows = report["results"]
    paths = []
    first_n = rows[0]["num_shards"]
    at_n = sorted((r for r in rows if r["num_shards"] == first_n), key=lambda r: r["tensors"])
    fig, ax = plt.subplots(figsize=SIZE, dpi=DPI)
    for phase in [*report["phases"], *report.get("beside", ()), "total"]:
        ax.plot(
            [r["tensors"] for r in at_n],
            [r[f"{phase}_s"] for r in at_n],
            marker="o",
            markersize=4,
            linewidth=1.4 if phase != "total" else 2.2,
            label=phase,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensors in the checkpoint")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"bench_scale.py: before the first byte, N = {first_n}\n{_subtitle(report)}", fontsize=9
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(os.path.join(out_dir, "scale_time.png"))
    fig.tight_layout()
    fig.savefig(paths[-1])
    plt.close(fig)
    series = {}
    for r in rows:
        series.setdefault(f"{r['model']} ({r['tensors']:,})", {})[r["num_shards"]] = r["total_s"]
    paths.append(
        _plot(
            series,
            "bench_scale.py: open + plan + read plan against N",
            "seconds",
            os.path.join(out_dir, "scale_n.png"),
            _subtitle(report),
        )
    )
    return paths


# ==== either ====================================================================================

DRAW = {"bench_load": draw_load, "bench_objects": draw_objects, "bench_scale": draw_scale}


def kind(report: dict) -> str:
    """Which benchmark wrote ``report``: its header says, else its rows' shape."""
    name = (report.get("header") or {}).get("benchmark")
    if name in DRAW:
        return name
    rows = report.get("results") or []
    if rows and isinstance(rows, list) and isinstance(rows[0], dict):
        if "num_shards" in rows[0] and "cache" in rows[0]:
            return "bench_load"
        if "scheme" in rows[0] and "n" in rows[0]:
            return "bench_objects"
    raise ValueError(
        f"no figures for this report (benchmark {name!r}); figures exist for {', '.join(DRAW)}"
    )


def draw(report_json: str | os.PathLike | dict, out_dir: str) -> list[str]:
    """The figures of a report (its JSON file's path, or the object) in ``out_dir``."""
    if isinstance(report_json, dict):
        report = report_json
    else:
        with open(report_json) as f:
            report = json.load(f)
    return DRAW[kind(report)](report, out_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m shardbench.figures",
        description="Redraw a benchmark's figures from its saved "
        "JSON (bench_load.py, bench_objects.py).",
    )
    ap.add_argument("report", help="the JSON a benchmark wrote with --json")
    ap.add_argument("out_dir", help="where the PNG files go")
    args = ap.parse_args(argv)
    try:
        paths = draw(args.report, args.out_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
