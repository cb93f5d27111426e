"""Models compressed by compressed-tensors itself (as llm-compressor does), and the library's own
unpacking and dequantization: the tool-side reference for the real-tool checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam


def compress_w4a16(folder: Path, config, symmetric: bool, group: int = 32, *, seed: int = 0):
    """A random model of ``config`` (torch's seed ``seed``) compressed to pack-quantized int4 in
    groups of ``group`` by compressed-tensors and saved to ``folder``; the scales are min/max
    ones computed with its own ``calculate_qparams`` (what an observer would give). Returns the
    library's quantization args."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    scheme = preset_name_to_scheme("W4A16" if symmetric else "W4A16_ASYM", ["Linear"])
    scheme.weights.group_size = group
    apply_quantization_config(
        model,
        QuantizationConfig(
            config_groups={"group_0": scheme}, ignore=["lm_head"], format="pack-quantized"
        ),
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            groups = module.weight.detach().reshape(module.weight.shape[0], -1, group)
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
            module.weight_scale.data.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return scheme.weights


def dequant(t: dict[str, torch.Tensor], prefix: str, args) -> torch.Tensor:
    """The library's own unpacking and dequantization of one (possibly sharded) layer."""
    shape = torch.Size(t[f"{prefix}.weight_shape"].tolist())
    codes = unpack_from_int32(t[f"{prefix}.weight_packed"], args.num_bits, shape)
    zero = t.get(f"{prefix}.weight_zero_point")
    if zero is not None:  # asymmetric: zero points are packed along the output rows
        zero = unpack_from_int32(
            zero,
            args.num_bits,
            torch.Size([shape[0], t[f"{prefix}.weight_scale"].shape[1]]),
            packed_dim=0,
        )
    return dequantize(codes, t[f"{prefix}.weight_scale"], zero, args=args, dtype=torch.float32)


# ---- any preset: W8A8 int8, NVFP4, MXFP4, FP8 block ----------------------------------------------


def _calibrate(module, args) -> None:
    """Min/max weight qparams for ``module`` computed with the library's own
    ``calculate_qparams`` (and ``generate_gparam`` for NVFP4's per-tensor global scale): what
    llm-compressor's observers give for the weights."""
    weight = module.weight.detach().float()
    rows = weight.shape[0]
    if args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif args.strategy == "block":  # one scale per [bn, bk] block of W
        bn, bk = args.block_structure
        # a last partial block (rows or columns not a multiple of the block) is padded with
        # zeros: the scheme is symmetric, so its scale (the largest magnitude) is unchanged
        padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % bk, 0, -rows % bn))
        blocks = padded.reshape(padded.shape[0] // bn, bn, -1, bk)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:  # group, tensor_group: one scale per group_size elements of K
        groups = weight.reshape(rows, -1, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    global_scale = None
    if hasattr(module, "weight_global_scale"):
        global_scale = generate_gparam(weight.min(), weight.max())
        module.weight_global_scale.data.copy_(global_scale)
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    module.weight_scale.data.copy_(scale)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero)
    # static activation qparams, as a calibration run would leave them
    if hasattr(module, "input_scale"):
        module.input_scale.data.fill_(0.02)
    if hasattr(module, "input_global_scale"):
        module.input_global_scale.data.copy_(generate_gparam(torch.tensor(-3.0), torch.tensor(3.0)))


def compress_preset(
    folder: Path, config, preset: str, *, static_input: bool = False, seed: int = 0
):
    """A random model of ``config`` (torch's seed ``seed``) quantized with the
    compressed-tensors preset ``preset`` (``W8A8``, ``NVFP4A16``, ``NVFP4``, ``MXFP4A16``,
    ``MXFP4``, ...), calibrated with the library's own qparam functions (``_calibrate``),
    compressed by its ``ModelCompressor`` in the format it picks for the preset and saved to
    ``folder`` with transformers.
    ``static_input``: a static per-tensor activation scale (``input_scale``) instead of the
    preset's dynamic one. Returns the library's quantization scheme and the format name."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if static_input:
        scheme.input_activations = QuantizationArgs(
            num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False
        )
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _calibrate(module, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model)
    fmt = compressor.quantization_config.format
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return scheme, str(getattr(fmt, "value", fmt))


def decompress(t: dict[str, torch.Tensor], prefix: str, scheme, fmt: str) -> torch.Tensor:
    """The weight of one (possibly sharded) layer as the library's own decompressor for
    ``fmt`` gives it back (unpacking, scale decoding and dequantization, all its own)."""
    compressor = BaseCompressor.get_value_from_registry(fmt)
    own = {k[len(prefix) + 1 :]: v for k, v in t.items() if k.startswith(prefix + ".")}
    return compressor.decompress(own, scheme)["weight"].float()
