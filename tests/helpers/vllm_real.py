"""Real weights for the vLLM tests: SmolLM2-135M-Instruct as a Hugging Face checkpoint in bf16,
quantized W8A8 and W4A16 by compressed-tensors (``examples/quantized_smollm2.py``, the README's
example, makes these three), and GPTQ by GPTQModel (in the environment
``scripts/quant-tools-env.sh`` makes; without it the calling test skips).

Each is made once into ``$SHARDLOAD_CACHE/models`` (default ``~/.cache/shardload``),
atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import quantized_smollm2  # examples/quantized_smollm2.py

__all__ = ["PROMPT", "smollm2_gptqmodel", "smollm2_hf", "smollm2_quantized"]

PROMPT = "The capital of France is"
_DONE = ".complete"


def smollm2_hf() -> Path:
    """SmolLM2-135M-Instruct in bf16 safetensors, with its tokenizer."""
    return quantized_smollm2.make("bf16")


def smollm2_quantized(preset: str) -> Path:
    """``smollm2_hf()``'s weights quantized by compressed-tensors with ``preset`` (``W8A8``,
    ``W4A16``: groups of 64)."""
    return quantized_smollm2.make(preset)


def smollm2_gptqmodel() -> Path:
    """``smollm2_hf()`` quantized by GPTQModel (``helpers.gptqmodel_tool``): 4-bit, groups of
    64, desc_act false, which vLLM's CPU kernel runs; o_proj's 9 groups do not divide at TP=2."""
    from helpers.gptqmodel_tool import quantize, tool_python

    folder = quantized_smollm2.folder("gptqmodel")
    if (folder / _DONE).exists():
        return folder
    tool_python()  # skips (or fails under CI) before anything is made, where it is missing
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        quantize(smollm2_hf(), tmp, bits=4, group=64, desc_act=False)
        (tmp / _DONE).write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
