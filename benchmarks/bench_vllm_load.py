"""How long vLLM's loaders and ``--load-format shardload`` take to load a model's weights.

    python benchmarks/bench_vllm_load.py [--tp 1,2] [--formats auto,runai_streamer,...] [--json F]

On one quantized checkpoint (``vllm_checkpoint.py``: ~1.6 GB, W8A8 by compressed-tensors), for
each load format and tensor-parallel size, one engine with a cold page cache (the checkpoint's
pages evicted first with ``posix_fadvise(DONTNEED)``) then ``--warm`` warm ones (the median): the
time the loader's ``load_weights`` took (the slowest rank's; timed alike for every loader by
the workers' extension, ``devtools/vllm_ext.py``: Run:ai's loader prints no time), the
checkpoint's bytes in the page cache after the cold load (what the whole engine read, counted
by the kernel: ``mincore``), and shardload's own bytes read per rank. Ratios are against
vLLM's default loader (``auto``) in the same run. Engines run in vLLM's environment
(``scripts/vllm-env.sh --peers``, which adds the peers' libraries, runai-model-streamer and
fastsafetensors).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from shardbench import harness  # noqa: E402
from vllm_checkpoint import make  # noqa: E402

TIMED = "vllm_ext load_weights: "  # devtools/vllm_ext.py's TIMING_PREFIX
STATS = "shardload load: "

_libc = ctypes.CDLL(None, use_errno=True)


def _files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def evict(ckpt: Path) -> None:
    for f in _files(ckpt):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(ckpt: Path) -> int:
    """Bytes of the checkpoint's files in the page cache: ``mincore`` over a private map of
    each (pages it has not touched report the page cache's state)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for f in _files(ckpt):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            anchor = ctypes.c_char.from_buffer(m)
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            rc = _libc.mincore(
                ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec
            )
            del anchor
            if rc != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {f}")
            total += sum(v & 1 for v in vec) * page
        finally:
            m.close()
    return total


def _first_json(text: str) -> dict:
    """The JSON object a log line starts with (two workers' lines can land on one line)."""
    return json.JSONDecoder().raw_decode(text.lstrip())[0]


def run(python: str, ckpt: Path, fmt: str, tp: int, out: Path) -> dict:
    # the checkout first, for shardload and for devtools.vllm_ext, which vLLM's workers import
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        python,
        str(REPO / "devtools" / "vllm_engine.py"),
        str(ckpt),
        "--tp",
        str(tp),
        "--load-format",
        fmt,
        "--tokens",
        "1",
        "--time-loads",
        "--out",
        str(out),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    log = proc.stdout + proc.stderr
    # each rank's load_weights, timed alike for every loader (devtools.vllm_ext)
    took = [
        _first_json(line.split(TIMED, 1)[1])["seconds"]
        for line in log.splitlines()
        if TIMED in line
    ]
    stats = [_first_json(line.split(STATS, 1)[1]) for line in log.splitlines() if STATS in line]
    result = {
        "format": fmt,
        "tp": tp,
        "ok": proc.returncode == 0 and bool(took),
        "load_s": max(took) if took else None,
        "engine_s": time.perf_counter() - start,
        "shardload_bytes_read": [s["bytes_read"] for s in sorted(stats, key=lambda s: s["rank"])]
        or None,
    }
    if not result["ok"]:
        errors = [line for line in log.splitlines() if "Error" in line and " ERROR " in line] or [
            line for line in log.splitlines() if "Error" in line
        ]
        result["error"] = (errors[-1] if errors else log[-300:]).strip()[-300:]
    return result


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    disk = shutil.disk_usage(Path.home())
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB memory, "
        f"{disk.total / 2**30:.0f} GiB disk, Linux {platform.release()}"
    )


def main() -> None:
    ap = harness.parser(__doc__.splitlines()[0])
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--formats", default="auto,runai_streamer,fastsafetensors,shardload")
    ap.add_argument("--warm", type=int, default=3, help="warm engines per row (the median)")
    ap.add_argument("--python", default=None, help="vLLM's python (default: scripts/vllm-env.sh)")
    harness.add_common(ap)
    args = ap.parse_args()
    tps = harness.int_list(ap, args.tp, "--tp")
    bench = harness.Bench("bench_vllm_load", args)

    ckpt = make()
    python = (
        args.python
        or subprocess.run(
            ["bash", str(REPO / "scripts" / "vllm-env.sh"), "--peers"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
    )
    # this checkout's bytecode, as an installed shardload has it (pip compiles a wheel's
    # modules; an editable checkout under PYTHONDONTWRITEBYTECODE=1, as on these machines,
    # would otherwise compile every module in every rank, inside the timed load_weights)
    subprocess.run([python, "-m", "compileall", "-q", str(REPO / "shardload")], check=True)
    size = sum(f.stat().st_size for f in _files(ckpt))
    out = Path("/tmp") / f"bench-vllm-{os.getpid()}.json"
    rows = []
    for tp in tps:
        for fmt in args.formats.split(","):
            evict(ckpt)
            before = resident(ckpt)
            cold = run(python, ckpt, fmt, tp, out)
            cold["resident_before"], cold["resident_after"] = before, resident(ckpt)
            # the median of the warm loads: one engine's load time varies by tens of percent here
            warms = sorted(
                (run(python, ckpt, fmt, tp, out) for _ in range(args.warm)),
                key=lambda w: (not w["ok"], w["load_s"] or 0),
            )
            warm = warms[(len(warms) - 1) // 2] if all(w["ok"] for w in warms) else warms[-1]
            warm["warm_load_s"] = [w["load_s"] for w in warms]
            rows.append({"cold": cold, "warm": warm})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = {(r["cold"]["tp"]): r for r in rows if r["cold"]["format"] == "auto"}
    version = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    print(
        f"checkpoint: {ckpt.name}, {size / 1e9:.2f} GB; machine: {machine()}; "
        f"vLLM {version.stdout.strip()}"
    )
    print()
    print(
        "| load format | TP | cold: load s | × auto | read (page cache after) | warm: load s "
        "| × auto | shardload bytes read per rank |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def ratio(x, key):
        """``x``'s load time against the auto format's at the same TP."""
        b = base.get(x["cold"]["tp"])
        ref = b and b[key]["load_s"]
        return f"{x[key]['load_s'] / ref:.2f}" if x[key]["ok"] and ref else "-"

    def secs(x):
        return f"{x['load_s']:.2f}" if x["ok"] else f"n/a: {x.get('error', '')[:80]}"

    for r in rows:
        c, w = r["cold"], r["warm"]
        per_rank = (
            ", ".join(f"{n / 1e9:.2f} GB" for n in c["shardload_bytes_read"])
            if c["shardload_bytes_read"]
            else ""
        )
        print(
            f"| {c['format']} | {c['tp']} | {secs(c)} | {ratio(r, 'cold')} | "
            f"{c['resident_after'] / 1e9:.2f} GB of {size / 1e9:.2f} | {secs(w)} | "
            f"{ratio(r, 'warm')} | {per_rank} |"
        )
    bench.finish({"checkpoint": str(ckpt), "bytes": size, "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
