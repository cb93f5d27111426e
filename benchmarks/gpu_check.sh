#!/usr/bin/env bash
# The GPU check, in one go: bash benchmarks/gpu_check.sh OUTDIR   (from the repo root)
#
# Installs what it can (each install may fail: the machine may have no network), records the
# machine, runs the GPU tests and the load benchmark, and writes OUTDIR/summary.txt. Every step
# runs under `timeout`; all of them together stay within GPU_CHECK_BUDGET_S (default 570 s).
# A failed or timed-out step is logged and the script goes on; it exits 0. See
# benchmarks/README.md ("On a GPU machine"). Environment: PYTHON (default python),
# GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_ARGS (default --size-gb 1.5 --shards 1,2,4,8 --runs 3),
# GPU_CHECK_PIP=0 (no installs), GPU_CHECK_PIP_ARGS (extra pip options, e.g. --dry-run).
set -u

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python}
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---size-gb 1.5 --shards 1,2,4,8 --runs 3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"   # the checkout, installed or not
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
PIP_NET="--retries 1 --timeout 15"
PIP_EXTRA=${GPU_CHECK_PIP_ARGS:-}   # e.g. --dry-run, to try the script without installing
LAST_RC=0
STEPS="$OUT/steps.txt"
: > "$STEPS"
START=$SECONDS

left() { echo $(( BUDGET_S - (SECONDS - START) )); }

# step NAME CAP KEEP LOG CMD...: CMD (stdout and stderr to LOG) with at most CAP seconds, and
# never so long that less than KEEP seconds of the budget would be left for what follows.
step() {
    local name=$1 cap=$2 keep=$3 log=$4
    shift 4
    local t=$(( $(left) - keep ))
    (( t > cap )) && t=$cap
    if (( t < 5 )); then
        echo "$name: skipped (no time left in the ${BUDGET_S}s budget)" | tee -a "$STEPS"
        return 0
    fi
    local t0=$SECONDS
    timeout --kill-after=10 "$t" "$@" > "$log" 2>&1
    LAST_RC=$?
    report "$name" "$LAST_RC" "$t" "$t0" "$(basename "$log")"
    return 0
}

report() {  # NAME RC LIMIT T0 LOG
    local what=ok
    if (( $2 == 124 || $2 == 137 )); then what="timed out after $3 s"
    elif (( $2 != 0 )); then what="failed (exit $2)"; fi
    echo "$1: $what, $(( SECONDS - $4 )) s, log $5" | tee -a "$STEPS"
}

echo "gpu_check: $REPO -> $OUT (budget ${BUDGET_S}s)"

# ---- 1. installs (each may fail) -----------------------------------------------------------------
# keep the torch that is there (a CUDA build): pip must not swap it for another
CONS="$OUT/constraints.txt"
: > "$CONS"
timeout 60 "$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$CONS" 2>/dev/null \
    || : > "$CONS"
if [ "${GPU_CHECK_PIP:-1}" = 0 ]; then
    echo "pip installs: skipped (GPU_CHECK_PIP=0)" | tee -a "$STEPS"
else
    # shellcheck disable=SC2086  (the option lists split on purpose)
    step "pip install -e .[cuda,test]" 150 420 "$OUT/pip_project.log" \
        "$PY" -m pip install $PIP_NET $PIP_EXTRA -c "$CONS" -e ".[cuda,test]"
    if (( LAST_RC != 0 )); then  # no network: setuptools may be there, build without an index
        step "pip install -e . (offline fallback)" 60 400 "$OUT/pip_project_offline.log" \
            "$PY" -m pip install $PIP_EXTRA --no-build-isolation --no-deps --no-index -e .
    fi
    for pkg in fastsafetensors runai-model-streamer instanttensor; do
        step "pip install $pkg" 60 380 "$OUT/pip_$pkg.log" \
            "$PY" -m pip install $PIP_NET $PIP_EXTRA -c "$CONS" "$pkg"
    done
fi

# ---- 2. the machine --------------------------------------------------------------------------------
step "nvidia-smi" 20 360 "$OUT/nvidia-smi.txt" nvidia-smi
step "versions" 60 350 "$OUT/env.txt" "$PY" - <<'EOF'
import importlib, importlib.metadata as md, platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available(), "devices", torch.cuda.device_count())
for d in range(torch.cuda.device_count()):
    print(f"  cuda:{d}", torch.cuda.get_device_name(d))
for dist, mod in (("shardload", "shardload"), ("safetensors", "safetensors"),
                  ("cupy-cuda12x", "cupy"), ("fastsafetensors", "fastsafetensors"),
                  ("runai-model-streamer", "runai_model_streamer"),
                  ("instanttensor", "instanttensor")):
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        v = "not installed"
    try:
        m = importlib.import_module(mod)
        where = "imports from " + (getattr(m, "__file__", None) or "?")
    except Exception as exc:
        where = f"does not import: {type(exc).__name__}: {exc}"
    print(f"{dist}: {v}; {where}")
EOF
cat "$OUT/env.txt" 2>/dev/null

# ---- 3. the GPU tests ------------------------------------------------------------------------------
step "pytest -m gpu" 150 300 "$OUT/pytest_gpu.log" "$PY" -m pytest -q -m "gpu and not vllm" \
    -p no:cacheprovider
tail -n 3 "$OUT/pytest_gpu.log" 2>/dev/null
# vLLM's load format on the formats only its GPU kernels run (FP8, block FP8, NVFP4, MXFP4, GGUF),
# where this machine's python has vLLM (nothing to install it from here: it is skipped if not)
if "$PY" -c "import vllm" > /dev/null 2>&1; then
    export SHARDLOAD_VLLM_PYTHON; SHARDLOAD_VLLM_PYTHON=$(command -v "$PY")
    step "pytest -m 'gpu and vllm'" 200 130 "$OUT/pytest_vllm_gpu.log" "$PY" -m pytest -q \
        -m "gpu and vllm" -p no:cacheprovider tests/test_vllm_gpu.py
    tail -n 3 "$OUT/pytest_vllm_gpu.log" 2>/dev/null
else
    echo "pytest -m 'gpu and vllm': skipped (no vllm in $PY)" | tee -a "$STEPS"
fi

# ---- 4. the benchmark (its table teed into bench.txt) ----------------------------------------------
T=$(( $(left) - 15 ))
if (( T >= 30 )); then
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$T" "$PY" benchmarks/bench_load.py $BENCH_ARGS \
        --json "$OUT/bench.json" 2> "$OUT/bench.err" | tee "$OUT/bench.txt"
    report "bench_load.py $BENCH_ARGS" "${PIPESTATUS[0]}" "$T" "$t0" "bench.txt, bench.err"
else
    echo "bench_load.py: skipped (no time left)" | tee -a "$STEPS"
fi

# ---- 5. the summary --------------------------------------------------------------------------------
{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( SECONDS - START )) s of ${BUDGET_S} s"
    echo
    cat "$STEPS"
    echo
    grep -m 3 -E "^(torch|  cuda:)" "$OUT/env.txt" 2>/dev/null
    grep -E "^(fastsafetensors|runai-model-streamer|instanttensor|cupy-cuda12x):" \
        "$OUT/env.txt" 2>/dev/null
    echo
    echo "pytest -m gpu: $(tail -n 1 "$OUT/pytest_gpu.log" 2>/dev/null || echo 'no log')"
    echo
    timeout 30 "$PY" - "$OUT/bench.json" <<'EOF' 2>&1 || true
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    sys.exit(f"no benchmark JSON ({exc})")
def f(x, spec):
    return "-" if x is None else format(x, spec)
cuda = r.get("cuda")
if cuda:
    print(f"CUDA: {', '.join(cuda['devices'])}; pinned host-to-device "
          f"{f(cuda['pinned_h2d_gb_per_s'], '.1f')} GB/s; staging {cuda.get('staging')}")
    for row in r.get("cuda_results", []):
        print(f"  {row['method']:<22} N={row['num_shards']}  {f(row['median_s'], '.3f')} s  "
              f"{f(row['gb_per_s'], '.1f')} GB/s  {f(row['fraction_of_pinned'], '.2f')} of "
              f"pinned  {f(row['ratio_to_shardload_thread'], '.2f')}x thread  host "
              f"+{f(row['peak_anon_bytes'] / 2**20, '.0f')} MiB anon  "
              f"{'equal' if row['verified'] else 'WRONG'}")
    for m, why in cuda.get("skipped", {}).items():
        print(f"  skipped: {m}: {why}")
elif r.get("cuda_error"):
    print("CUDA section failed:", r["cuda_error"])
else:
    print("no CUDA section (torch.cuda.is_available() was False, or the run was cut short)")
for m, why in r.get("skipped", {}).items():
    print(f"skipped on CPU: {m}: {why}")
print("targets:")
for t in r.get("targets", []):
    v = t["value"]
    shown = ("n/a" if v is None else f"{v / 2**20:.0f} MiB (limit {t['limit'] / 2**20:.0f})"
             if t["unit"] == "bytes" else f"{v:.2f} {t['unit']} (limit {t['limit']})")
    print(f"  {t['result']:<4} {t['target']}: {shown}")
wrong = [x for x in r.get("results", []) + r.get("cuda_results", []) if x.get("verified") is False]
print("pieces: " + ("all equal to shardload's" if not wrong else
                    "WRONG: " + ", ".join(f"{x['method']} N={x['num_shards']}" for x in wrong)))
EOF
} > "$OUT/summary.txt" 2>&1
echo
cat "$OUT/summary.txt"
exit 0
