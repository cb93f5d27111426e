#!/usr/bin/env bash
# The GPU machine's Python packages, simulated here for the GPU check's dry run: a virtual
# environment holding only what that machine's image holds (devtools/gpu_machine.py's IMAGE,
# at the versions read there, with this machine's CPU torch instead of its CUDA one), and the
# wheels the check carries there, for this interpreter, in its folder. Made once and kept.
#
#   scripts/gpu-sim-env.sh     # makes it (about a minute; 0.3 GB of downloads the first time),
#                              # then prints its python
#
# Where: $SHARDLOAD_GPU_SIM_VENV, else $SHARDLOAD_CACHE/gpu-sim-venv, else
# ~/.cache/shardload/gpu-sim-venv. tests/test_gpu_check.py runs benchmarks/gpu_check.sh with
# it, without a network (docs/development.md, "The GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SHARDLOAD_GPU_SIM_VENV:-${SHARDLOAD_CACHE:-$HOME/.cache/shardload}/gpu-sim-venv}"
# what the last step writes to $VENV/ready (a half-made environment is made again)
READY="gpu machine image, simulated 1"
if [ "$(cat "$VENV/ready" 2>/dev/null)" != "$READY" ]; then
    echo "making the GPU machine's simulated environment at $VENV" >&2
    rm -rf "$VENV"
    python -m venv "$VENV"
    # shellcheck disable=SC2046  (one requirement a word)
    "$VENV/bin/pip" install -q $(python -m devtools.gpu_machine image --pinned) 2>&1 \
        | grep -v "^WARNING: " >&2 || true
    "$VENV/bin/python" -c "import torch, numpy, safetensors, click, tqdm, pytest" 2>/dev/null \
        || { echo "the simulated environment did not install in $VENV" >&2; exit 1; }
    echo "$READY" > "$VENV/ready"
fi
# the carried wheels as devtools/gpu_machine.py's WHEELS name them now (a wheel added there is
# fetched on the next run; those already there are kept)
python -m devtools.gpu_machine download --dest "$VENV/gpu-wheels" \
    --python-version "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" >&2
echo "$VENV/bin/python"
