"""What an RL refit costs: the ``shardload`` weight-transfer backend against a reload and a restart.

    python benchmarks/bench_refit.py [--tp 1,2] [--sources local,s3] [--runs 3] [--json F]

For each tensor-parallel size and source (a local folder, or the S3 emulator: moto behind the
counting proxy of ``devtools/objectservers.py``), on one bf16 Llama (0.37 GB, made once), in
one running engine (``refit_engine.py``, run by vLLM's python), the median of ``--runs`` of:

- **refit**: ``start_weight_update``, ``update_weights({"checkpoint": C})``,
  ``finish_weight_update`` with ``WeightTransferConfig(backend="shardload")``;
- **reload**: the same engine's ``reload_weights`` from the same checkpoint: local, vLLM's
  default loader (``auto``) from the folder; S3, the engine's ``--load-format shardload``
  (vLLM's own loaders cannot read this model from ``s3://``);

then, in a new engine, **fresh**: ``LLM(...)`` to the end of its first generation, with the part
its loader's ``load_weights`` took: once, or ``--runs`` times where ``--runs`` is above 3.
Every method reads the same checkpoint, its pages warm (the engine's first load read them; moto
keeps objects in memory). Ratios are within one (TP, source). Progress on stderr, the table on
stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (HERE, REPO):  # shardbench; devtools (the emulators)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from shardbench import harness  # noqa: E402
from vllm_checkpoint import made_once  # noqa: E402

NAME = "llama_0p37gb_bf16"
#: hidden 1024, 16 query and 8 KV heads of 64, MLP 2816, 10 layers, vocabulary 32000, untied
GEOMETRY = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=10,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
STATS = "shardload load: "  # shardload.vllm.model_loader.STATS_PREFIX
TIMED = "vllm_ext load_weights: "  # devtools.vllm_ext.TIMING_PREFIX
BUCKET, PREFIX = "bench", "refit/"
ENGINE_TIMEOUT = 1200  # seconds; an engine past it is killed (its workers with it)


def checkpoint() -> Path:
    """The bf16 Llama of ``GEOMETRY`` (transformers' random initialisation), written once into
    ``$SHARDLOAD_CACHE/bench-refit`` (default ``~/.cache/shardload``), atomically."""
    root = Path(os.environ.get("SHARDLOAD_CACHE", Path.home() / ".cache" / "shardload"))

    def write(tmp: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(**GEOMETRY, dtype="bfloat16")
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp)

    return made_once(root / "bench-refit" / NAME, write)


def _first_json(text: str) -> dict:
    """The JSON object a log line starts with (two workers' lines can land on one line)."""
    return json.JSONDecoder().raw_decode(text.lstrip())[0]


def engine(python: str, env: dict, model: Path, tp: int, *args: str) -> dict:
    """``refit_engine.py`` on ``model`` at ``tp`` with ``args``: its report, with the
    statistics lines and load times of its log (``error`` where it failed)."""
    out = Path(tempfile.mkstemp(prefix="bench-refit-", suffix=".json")[1])
    cmd = [
        "timeout",
        "-k",
        "15",
        str(ENGINE_TIMEOUT),
        python,
        str(HERE / "refit_engine.py"),
        str(model),
        "--tp",
        str(tp),
        "--out",
        str(out),
        *args,
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        log = (proc.stdout + proc.stderr).splitlines()
        report = json.loads(out.read_text()) if proc.returncode == 0 else {}
    finally:
        out.unlink(missing_ok=True)
    report["process_s"] = time.perf_counter() - start  # python, vLLM's import, the engine, exit
    report["stats"] = [_first_json(line.split(STATS, 1)[1]) for line in log if STATS in line]
    report["load_weights_s"] = [
        _first_json(line.split(TIMED, 1)[1])["seconds"] for line in log if TIMED in line
    ]
    if proc.returncode != 0:
        errors = [line for line in log if "Error" in line] or log[-3:]
        report["error"] = f"exit {proc.returncode}: " + (errors[-1] if errors else "")[-300:]
    return report


def warm(ckpt: Path) -> None:
    """The checkpoint's files read once, into the page cache."""
    for f in sorted(ckpt.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def measure(python: str, env: dict, model: Path, where: str, tp: int, runs: int, s3: bool):
    """One (TP, source): one engine's refits and reloads, then the fresh engines."""
    # local: vLLM's default loader; S3: shardload's, which reads s3:// (and reloads from it)
    fmt = ["--load-format", "shardload", "--extra", json.dumps({"checkpoint": where})] if s3 else []
    reload = [] if s3 else ["--reload-path", where]
    what = f"{'s3' if s3 else 'local'} TP {tp}"
    load_before = os.getloadavg()  # another job on these cores shows here
    session = engine(
        python, env, model, tp, *fmt, *reload, "--checkpoint", where, "--runs", str(runs)
    )
    print(
        f"{what}: refit {session.get('refit')}, reload {session.get('reload')} s "
        f"{session.get('error', '')}",
        file=sys.stderr,
        flush=True,
    )
    # one start is enough to see what a restart costs, unless --runs asks more than the default
    fresh = [
        engine(python, env, model, tp, *fmt, "--fresh") for _ in range(runs if runs > 3 else 1)
    ]
    for f in fresh:
        print(
            f"{what}: fresh {f.get('fresh_s')} s {f.get('error', '')}", file=sys.stderr, flush=True
        )
    refit_stats = [s for s in session["stats"] if s.get("refit")]
    return {
        "tp": tp,
        "source": "s3" if s3 else "local",
        "checkpoint": where,
        "reload_loader": "shardload (get_all_weights)" if s3 else "auto (vLLM's default)",
        "session": session,
        "fresh": fresh,
        "loadavg": {"before": load_before, "after": os.getloadavg()},
        "refit_s": harness.median(session.get("refit", [])),
        "reload_s": harness.median(session.get("reload", [])),
        "fresh_s": harness.median(f.get("fresh_s") for f in fresh),
        "fresh_load_s": harness.median(max(f["load_weights_s"], default=None) for f in fresh),
        "fresh_process_s": harness.median(f["process_s"] for f in fresh),
        # each rank's bytes in its first refit (every refit reads the same)
        "refit_bytes_read": [
            s["bytes_read"] for s in sorted(refit_stats[:tp], key=lambda s: s["rank"])
        ],
    }


def table(rows: list[dict], size: int) -> None:
    def secs(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}"

    print(f"checkpoint: {NAME}, {size / 1e9:.2f} GB, bf16; medians, seconds")
    print()
    print(
        "| source | TP | refit | reload (its loader) | refit/reload | fresh engine | of it: "
        "load_weights | its process | refit/fresh | refit bytes read per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        loader = "shardload" if r["source"] == "s3" else "auto"
        per_rank = ", ".join(f"{n / 1e6:.0f} MB" for n in r["refit_bytes_read"])
        print(
            f"| {r['source']} | {r['tp']} | {secs(r['refit_s'])} | {secs(r['reload_s'])} "
            f"({loader}) | {ratio(r['refit_s'], r['reload_s'])} | {secs(r['fresh_s'])} | "
            f"{secs(r['fresh_load_s'])} | {secs(r['fresh_process_s'])} | "
            f"{ratio(r['refit_s'], r['fresh_s'])} | {per_rank} |"
        )
    for r in rows:
        for what in ("session", *(["fresh"] if r["fresh"] else [])):
            runs = r[what] if isinstance(r[what], list) else [r[what]]
            for run in runs:
                if "error" in run:
                    print(f"{r['source']} TP {r['tp']} {what}: {run['error']}")
        if r["session"].get("same_tokens") is False:
            print(f"{r['source']} TP {r['tp']}: the tokens changed after a refit or reload")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    ap.add_argument("--sources", default="local,s3", help="of local, s3")
    ap.add_argument(
        "--python",
        default=os.environ.get(
            "SHARDLOAD_VLLM_PYTHON",
            str(Path.home() / ".cache" / "shardload" / "vllm-venv" / "bin" / "python"),
        ),
        help="vLLM's python (default $SHARDLOAD_VLLM_PYTHON, else the vLLM environment's)",
    )
    harness.add_common(ap, runs=3, runs_help="refits and reloads per engine; medians reported")
    args = ap.parse_args()
    harness.check_runs(ap, args)
    tps = harness.int_list(ap, args.tp, "--tp")
    sources = args.sources.split(",")
    if not set(sources) <= {"local", "s3"}:
        ap.error(f"--sources takes local and s3, got {args.sources!r}")
    bench = harness.Bench("bench_refit", args)

    ckpt = checkpoint()
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    # this checkout's bytecode, as an installed shardload has it (bench_vllm_load.py: otherwise
    # every rank compiles every module inside the timed loads)
    subprocess.run([args.python, "-m", "compileall", "-q", str(REPO / "shardload")], check=True)
    base_env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1")
    rows = []
    if "local" in sources:
        warm(ckpt)
        rows += [
            measure(args.python, base_env, ckpt, str(ckpt), tp, args.runs, False) for tp in tps
        ]
    if "s3" in sources:
        from devtools import objectservers

        with objectservers.make_server("s3") as server, tempfile.TemporaryDirectory() as config:
            server.make_bucket(BUCKET)
            for f in sorted(ckpt.iterdir()):
                if f.is_file() and not f.name.startswith("."):
                    server.put(BUCKET, PREFIX + f.name, f.read_bytes())
                    if f.suffix != ".safetensors":  # vLLM's model: a folder of its config
                        shutil.copy(f, config)
            env = server.subprocess_env(base_env)
            where = server.url(BUCKET, PREFIX)
            rows += [
                measure(args.python, env, Path(config), where, tp, args.runs, True) for tp in tps
            ]
    table(rows, size)
    bench.finish({"checkpoint": str(ckpt), "bytes": size, "geometry": GEOMETRY, "rows": rows})


if __name__ == "__main__":
    main()
