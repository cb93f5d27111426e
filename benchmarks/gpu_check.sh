#!/usr/bin/env bash
# The GPU check, in one go, on a GPU machine that can fetch nothing:
#
#   bash benchmarks/gpu_check.sh OUTDIR      # from the repository root; about 5 minutes at most
#
# First, here (with a network): scripts/gpu-wheels.sh puts the wheels the machine's image lacks
# (gguf, orjson and the peer loaders, 10 MB, for its Python 3.12) in .gpu-wheels/, which the
# device call carries. Nothing is fetched there: the wheels are installed from that folder alone (pip
# --isolated --no-index --no-deps --target), never over the machine's torch, and the checkout is
# used where it is (PYTHONPATH). The steps, the most important first, so that a run cut short
# has done what matters most; each runs under `timeout`, all of them within GPU_CHECK_BUDGET_S
# (default 330 s); a step that fails or runs out of time is logged and the next one runs:
#
#   1. install  the carried wheels; torch checked unchanged                      (summary.txt)
#   2. machine  nvidia-smi; Python, torch, CUDA; each package's version and import  machine.txt
#   3. tests    pytest -m "gpu and not vllm" on the files holding GPU tests          tests.txt
#   4. load     bench_load.py --cuda-only: the 1.5 GB GPTQ Llama, N = 1, 2, 4, 8, every peer
#               on the pinned host-to-device path of one GPU                          load.json
#   5. moe      the same for the 14,291-tensor Qwen2-MoE (0.5 GB), N = 1 and 8         moe.json
#   6. padded   the same for the Llama at N = 3, where the planner pads its heads   padded.json
#   7. vllm     tests/test_vllm_gpu.py, only where the machine's python has vLLM     tests.txt
#
# summary.txt holds each step's outcome as it ends, then the tables (shardbench/gpu_summary.py,
# also the rows for docs/performance.md's GPU table); whatever else a step prints goes to
# log.txt. Seven files at most, none near 16 MiB. It exits 0.
#
# Environment: PYTHON (default python3, the machine's), GPU_CHECK_WHEELS (default .gpu-wheels),
# GPU_CHECK_BUDGET_S, GPU_CHECK_STAND_IN=cpu (the dry run, on a machine without CUDA: steps 4-6
# run the CUDA section's code on CPU workers, at a small size; tests/test_gpu_check.py).
set -u

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-330}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/.gpu-wheels}
STAND_IN=${GPU_CHECK_STAND_IN:-}
SITE=$(mktemp -d "${TMPDIR:-/tmp}/shardload-gpu-site.XXXXXX") || exit 2
trap 'rm -rf "$SITE"' EXIT
export PYTHONPATH="$REPO:$SITE:$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export SHARDLOAD_CACHE="$SITE/cache"   # whatever a test keeps, gone with the check
SUMMARY="$OUT/summary.txt" LOG="$OUT/log.txt"
: > "$LOG"
START=$SECONDS
LAST_RC=0

# the benchmark steps' sizes: the real ones, or the dry run's (the code path, in seconds)
if [ "$STAND_IN" = cpu ]; then
    LOAD="--size-gb 0.05 --shards 1,2 --runs 1 --cuda-stand-in"
    MOE="--model moe --size-gb 0.02 --shards 1,2 --runs 1 --cuda-stand-in"
    PADDED="--size-gb 0.05 --shards 3 --runs 1 --cuda-stand-in"
else
    LOAD="--size-gb 1.5 --shards 1,2,4,8 --runs 3"
    MOE="--model moe --size-gb 0.5 --shards 1,8 --runs 2"
    PADDED="--size-gb 1.5 --shards 3 --runs 2"
fi

left() { echo $(( BUDGET_S - (SECONDS - START) )); }
say() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME CAP KEEP FILE CMD...: CMD, its output to FILE (appended, under a heading), for at
# most CAP seconds, and never so long that less than KEEP seconds are left for what follows
step() {
    local name=$1 cap=$2 keep=$3 file=$4
    shift 4
    local t=$(( $(left) - keep ))
    (( t > cap )) && t=$cap
    if (( t < 5 )); then
        say "$name: skipped (no time left in the ${BUDGET_S} s budget)"
        LAST_RC=124
        return 0
    fi
    echo "==== $name: $*" >> "$file"
    local t0=$SECONDS
    timeout --kill-after=10 "$t" "$@" >> "$file" 2>&1
    LAST_RC=$?
    local what=ok
    if (( LAST_RC == 124 || LAST_RC == 137 )); then what="timed out after $t s"
    elif (( LAST_RC == 4 )) && [ "$file" = "$LOG" ]; then what="skipped: no CUDA device"
    elif (( LAST_RC != 0 )); then what="failed (exit $LAST_RC)"; fi
    say "$name: $what, $(( SECONDS - t0 )) s (output: $(basename "$file"))"
}

torch_is() { "$PY" -c 'import torch; print(torch.__version__, torch.__file__)' 2>&1; }

{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) at $(git rev-parse --short HEAD 2>/dev/null \
        || echo '?'), budget ${BUDGET_S} s${STAND_IN:+, dry run: CUDA steps on $STAND_IN workers}"
    echo
} > "$SUMMARY"
echo "gpu_check: $REPO -> $OUT"

# ---- 1. install: the carried wheels, nothing else ---------------------------------------------
BEFORE=$(torch_is)
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    step "install $(ls "$WHEELS"/*.whl | wc -l) wheels from $(basename "$WHEELS")" 60 270 "$LOG" \
        "$PY" -m pip --isolated install --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "$WHEELS"/*.whl
else
    say "install: no wheels in $WHEELS (run scripts/gpu-wheels.sh here and carry the folder)"
fi
AFTER=$(torch_is)
if [ "$BEFORE" = "$AFTER" ] && [ ! -e "$SITE/torch" ]; then
    say "torch unchanged: $AFTER"
else
    say "TORCH CHANGED: before '$BEFORE', after '$AFTER'"
fi

# ---- 2. the machine ------------------------------------------------------------------------------
step "nvidia-smi" 20 250 "$OUT/machine.txt" nvidia-smi
step "versions" 60 240 "$OUT/machine.txt" "$PY" -m shardbench.gpu_summary machine

# ---- 3. the GPU tests ----------------------------------------------------------------------------
# the files marking tests `gpu` (not `gpu_sim`), test_gpu.py first; vLLM's are step 7
mapfile -t GPU_TESTS < <(grep -lE 'pytest\.mark\.gpu([^_[:alnum:]]|$)' tests/test_gpu.py \
    tests/test_*.py | grep -v vllm | awk '!seen[$0]++')
step "pytest -m 'gpu and not vllm' ${GPU_TESTS[*]}" 120 150 "$OUT/tests.txt" \
    "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not vllm" "${GPU_TESTS[@]}"
tail -n 1 "$OUT/tests.txt" | tee -a "$SUMMARY"

# ---- 4-6. the load benchmark's CUDA section --------------------------------------------------------
# shellcheck disable=SC2086  (the option lists split on purpose)
step "load: bench_load.py --cuda-only $LOAD" 150 60 "$LOG" \
    "$PY" benchmarks/bench_load.py --cuda-only $LOAD --dir "$SITE/bench" --json "$OUT/load.json"
# shellcheck disable=SC2086
step "moe: bench_load.py --cuda-only $MOE" 100 25 "$LOG" \
    "$PY" benchmarks/bench_load.py --cuda-only $MOE --dir "$SITE/bench" --json "$OUT/moe.json"
# shellcheck disable=SC2086
step "padded: bench_load.py --cuda-only $PADDED" 60 5 "$LOG" \
    "$PY" benchmarks/bench_load.py --cuda-only $PADDED --dir "$SITE/bench" \
    --json "$OUT/padded.json"

# ---- 7. vLLM on the formats only its GPU kernels run, where this python has vLLM -----------------
if "$PY" -c "import vllm" > /dev/null 2>&1; then
    export SHARDLOAD_VLLM_PYTHON; SHARDLOAD_VLLM_PYTHON=$(command -v "$PY")
    step "pytest tests/test_vllm_gpu.py" 200 0 "$OUT/tests.txt" "$PY" -m pytest -q \
        -p no:cacheprovider -m "gpu and vllm" tests/test_vllm_gpu.py
else
    say "vllm: skipped (no vllm in $PY; it cannot be carried)"
fi

# ---- the summary ---------------------------------------------------------------------------------
{
    echo
    echo "$(( SECONDS - START )) s of ${BUDGET_S} s"
    echo
    timeout 30 "$PY" -m shardbench.gpu_summary tables "$OUT" 2>&1
} >> "$SUMMARY"
echo
cat "$SUMMARY"
exit 0
