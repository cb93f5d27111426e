#!/usr/bin/env bash
# The wheels the GPU check carries to a GPU machine that can fetch nothing (gguf and the peer
# loaders, for that machine's Python 3.12, each needing only what its image holds), downloaded
# here into .gpu-wheels/ (git ignores it), with their total size. The device call carries that
# folder; benchmarks/gpu_check.sh installs from it alone. See devtools/gpu_machine.py.
#
#   scripts/gpu-wheels.sh                                   # .gpu-wheels/, for Python 3.12
#   scripts/gpu-wheels.sh --python-version 3.11 --dest DIR  # another interpreter (the dry run's)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m devtools.gpu_machine download "$@"
