"""Tiny gpt-oss checkpoints in the layout of the published openai/gpt-oss-20b (MXFP4 experts).

Which tool does what:

* transformers builds the model (``GptOssConfig`` + ``from_config``), saves every tensor that is
  not an expert weight (bf16, published names) and ``config.json``, and is the reference reader:
  ``dequantize`` is its ``convert_moe_packed_tensors`` and ``load_with_transformers`` its
  ``Mxfp4Config(dequantize=True)`` load.
* compressed-tensors quantizes the expert weights: its own MXFP4 qparams (``calculate_qparams``
  with the ``MXFP4A16`` preset: E8M0 power-of-two scale per 32 inputs) and its
  ``mxfp4-pack-quantized`` compressor (E2M1 codes, two per byte, even element in the low nibble,
  scale stored as exponent + 127). Its codes, nibble order and scale bytes are exactly gpt-oss's,
  so the only repacking is the reshape ``[E*rows, K/2] -> [E, rows, K/32, 16]``.

transformers cannot write this layout itself here: quantizing with ``Mxfp4Config()`` needs
accelerate, triton >= 3.5, ``kernels`` 0.18.x and the hub kernel
``kernels-community/gpt-oss-triton-kernels`` (downloaded at run time, unreachable offline).

Checked (transformers 5.24.0, compressed-tensors 0.20.1): transformers' dequantized expert
parameters equal compressed-tensors' own decompression bit for bit (max abs diff 0.0), as does
``convert_moe_packed_tensors``; the loaded model runs a forward pass. Writing the tiny model takes
well under a second.

Orientation: the blocks are ``[E, rows, K/32, 16]`` (rows = outputs: ``2I`` for gate_up, ``H``
for down; K = inputs), transposed against transformers' in-memory experts, ``gate_up_proj``
``[E, H, 2I]`` (gate = ``[..., ::2]``, up = ``[..., 1::2]``, interleaved) and ``down_proj``
``[E, I, H]``. Biases, sinks and the router stay unquantized.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

# as in openai/gpt-oss-20b's config.json
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
SCHEME = preset_name_to_scheme("MXFP4A16", ["Linear"])


def tiny_config(**overrides) -> transformers.GptOssConfig:
    """A tiny gpt-oss config; ``hidden_size`` and ``intermediate_size`` must be multiples of
    32 (the MXFP4 group)."""
    kwargs = dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    kwargs.update(overrides)
    return transformers.GptOssConfig(**kwargs)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' MXFP4 of ``weight`` ``[E, rows, K]`` (rows = outputs): gpt-oss's
    ``blocks`` ``[E, rows, K/32, 16]`` and ``scales`` ``[E, rows, K/32]`` (uint8), and the
    library's own decompression ``[E, rows, K]`` (float32)."""
    e, rows, k = weight.shape
    flat = weight.reshape(e * rows, k)
    groups = flat.reshape(e * rows, k // 32, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights)
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    packed = compressor.compress({"weight": flat, "weight_scale": scale}, SCHEME)
    back = compressor.decompress(dict(packed), SCHEME)["weight"].float()
    return (
        packed["weight_packed"].reshape(e, rows, k // 32, 16),
        packed["weight_scale"].reshape(e, rows, k // 32),
        back.reshape(e, rows, k),
    )


def write_gpt_oss_mxfp4(folder, config, seed: int = 0) -> None:
    """A random gpt-oss of ``config`` (seeded) saved to ``folder`` as openai/gpt-oss-20b is:
    bf16 everywhere except the experts' MXFP4 ``*_blocks`` / ``*_scales``."""
    folder = Path(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # init leaves biases 0 and norms 1: make a mis-sharded one visible
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    model = model.to(torch.bfloat16)
    model.config.quantization_config = QUANTIZATION_CONFIG
    model.save_pretrained(folder)

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # in memory [E, K, rows] (x @ W), serialized as [E, rows, K]
        blocks, scales, _ = quantize(tensors.pop(name).transpose(1, 2).float())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own ``convert_moe_packed_tensors`` in float32: blocks ``[E, rows, K/32, 16]``
    and scales ``[E, rows, K/32]`` give ``[E, K, rows]``, the in-memory orientation
    (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``)."""
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def load_with_transformers(folder):
    """The checkpoint as transformers loads it on CPU: experts dequantized, float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    )
