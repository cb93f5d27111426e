"""The benchmark's quantized checkpoint: a ~1.5 GB Llama quantized W8A8 by compressed-tensors.

    python benchmarks/vllm_checkpoint.py          # prints its folder (made once)

Random weights (the load does not care what they are), quantized with compressed-tensors'
``W8A8`` preset (int8 weights per channel, dynamic int8 activations) by the library itself
(``compress_w8a8``: its preset, its ``calculate_qparams`` on each row's min/max, its
``ModelCompressor``; the tests' ``compress_preset`` makes the same calls), saved by
transformers. Made into ``$SHARDLOAD_CACHE/bench`` (default
``~/.cache/shardload/bench``), atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

NAME = "llama_1p5gb_w8a8"


def folder() -> Path:
    root = Path(os.environ.get("SHARDLOAD_CACHE", Path.home() / ".cache" / "shardload"))
    return root / "bench" / NAME


def compress_w8a8(folder: Path, config) -> None:
    """A random model of ``config`` quantized with compressed-tensors' ``W8A8`` preset (every
    Linear but ``lm_head``), its per-channel weight scales from each row's min/max by the
    library's ``calculate_qparams``, compressed by its ``ModelCompressor`` and saved to
    ``folder``."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.detach().float()
            scale, zero = calculate_qparams(
                weight.amin(1, keepdim=True),
                weight.amax(1, keepdim=True),
                module.quantization_scheme.weights,
            )
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)


def made_once(out: Path, write: Callable[[Path], None]) -> Path:
    """Folder ``out``, written by ``write(folder)`` the first time: into a temporary folder
    beside it, marked complete, then renamed into place (never seen half-written)."""
    if (out / ".complete").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        (tmp / ".complete").write_text("")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def make() -> Path:
    def write(tmp: Path) -> None:
        import transformers

        # 1.35 B int8 weights + 2 x 65.5 M bf16 embedding rows: ~1.6 GB on disk
        config = transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=26,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=32000,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
        )
        compress_w8a8(tmp, config)

    return made_once(folder(), write)


if __name__ == "__main__":
    print(make())
