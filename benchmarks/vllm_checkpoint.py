"""The benchmark's quantized checkpoint: a ~1.5 GB Llama quantized W8A8 by compressed-tensors.

    python benchmarks/vllm_checkpoint.py          # prints its folder (made once)

Random weights (the load does not care what they are), quantized with compressed-tensors'
``W8A8`` preset (int8 weights per channel, dynamic int8 activations) by the same calls the
tests use (``tests/helpers/compressed_tensors_tool.py``: the library's own qparams and
``ModelCompressor``), saved by transformers. Made into ``$SHARDLOAD_CACHE/bench`` (default
``~/.cache/shardload/bench``), atomically.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "llama_1p5gb_w8a8"


def folder() -> Path:
    root = Path(os.environ.get("SHARDLOAD_CACHE", Path.home() / ".cache" / "shardload"))
    return root / "bench" / NAME


def make() -> Path:
    out = folder()
    if (out / ".complete").exists():
        return out
    import transformers

    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.compressed_tensors_tool import compress_preset

    # 1.35 B int8 weights + 2 x 65.5 M bf16 embedding rows: ~1.6 GB on disk
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=26, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, vocab_size=32000, max_position_embeddings=512,
        tie_word_embeddings=False, torch_dtype="bfloat16")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=out.parent))
    try:
        compress_preset(tmp, config, "W8A8")
        (tmp / ".complete").write_text("")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(make())
