#!/usr/bin/env bash
# The environment of the quantization tools the tests take checkpoints from, made once and
# kept: GPTQModel (GPTQ, with and without act-order, as people quantize for vLLM), in its own
# virtual environment, because it pins other versions of numpy, transformers' companions and
# torchao than the tests' environment.
#
#   scripts/quant-tools-env.sh     # makes it (about 1 to 2 minutes), then prints its python
#
# Where: $SHARDLOAD_QUANT_VENV, else $SHARDLOAD_CACHE/quant-venv, else
# ~/.cache/shardload/quant-venv. torch is pinned to 2.13.0, which pip takes from this machine's
# disk (a CPU build); GPTQModel quantizes on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SHARDLOAD_QUANT_VENV:-${SHARDLOAD_CACHE:-$HOME/.cache/shardload}/quant-venv}"
GPTQMODEL=7.6.0
# the last step writes $VENV/ready: an environment half made (a run stopped midway, or one
# still being made) is made again, and the tests never take it for a ready one
if [ "$(cat "$VENV/ready" 2>/dev/null)" != "gptqmodel==$GPTQMODEL" ]; then
    echo "making the quantization tools' environment at $VENV (GPTQModel $GPTQMODEL)" >&2
    rm -rf "$VENV"
    python -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 "gptqmodel==$GPTQMODEL" "transformers==5.25.0" 2>&1 \
        | grep -v "^WARNING: " >&2 || true
    "$VENV/bin/python" -c "import gptqmodel" 2>/dev/null || {
        echo "GPTQModel did not install in $VENV" >&2; exit 1; }
    echo "gptqmodel==$GPTQMODEL" > "$VENV/ready"
fi
echo "$VENV/bin/python"
