"""Quantization formats: one module each, behind one protocol and one table.

Each registered ``QuantFormat`` owns recognising its config (``scheme_from_hf``), the tensors a
module stores and their axes (``tensor_axes``), and dequantization (``dequantize_module``);
the planners, the integrations and the CLI's tables only look formats up here. The formats
shardload ships, in the order they are tried for messages:

============== ==============================================================================
name           module
============== ==============================================================================
none           ``dense.py``: fp16 / bf16 / fp32
gptq           ``gptq.py``: GPTQ 2/3/4/8-bit, any group, act-order, v1 and v2 zeros
awq            ``awq.py``: AWQ GEMM 4-bit
pack-quantized ``pack_quantized.py``: compressed-tensors W4A16 / W8A16
int-quantized  ``int_quantized.py``: compressed-tensors W8A8 int8
modelopt-nvfp4 ``modelopt_nvfp4.py``: NVIDIA ModelOpt NVFP4
fp8            ``fp8.py``: FP8 per tensor / channel / block (compressed-tensors, HF, ModelOpt)
nvfp4          ``nvfp4.py``: compressed-tensors NVFP4
mxfp4          ``mxfp4.py``: compressed-tensors MXFP4; gpt-oss MXFP4
gguf           ``gguf.py``: llama.cpp's ggml blocks
mlc            ``mlc.py``: MLC q4f16_1
============== ==============================================================================

A format of your own is a module with a ``QuantFormat`` subclass, registered once:

>>> from shardload.formats import QuantFormat, register_format              # doctest: +SKIP
>>> class Toy(QuantFormat):
...     name = "toy"
...     configs = {"toy": lambda quant: Scheme("toy", 4)}      # quant_method: toy
...     ...
>>> register_format(Toy())
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

from ..config_fields import Fields
from .base import ACTIVATION_PARTS, Axis, QuantFormat, TensorAxes
from .scheme import Scheme
from .table import config_readers, get_format, list_formats, register_format, unregister_format

__all__ = [
    "ACTIVATION_PARTS",
    "Axis",
    "QuantFormat",
    "Scheme",
    "TensorAxes",
    "dequantize_module",
    "get_format",
    "is_quantized",
    "list_formats",
    "register_format",
    "scheme_from_hf",
    "tensor_axes",
    "unpack_int32",
    "unregister_format",
]


def scheme_from_hf(
    config: Fields | Mapping[str, Any], source: str | None = None, *, quant_file: Any | None = None
) -> Scheme:
    """The scheme an HF config's ``quantization_config`` describes (``formats/config.py``).

    ``quant_file`` names the file ``quantization_config`` came from when it is not the config's
    own (``quantize_config.json``, merged in by the reader): a name, or a function giving it.

    >>> scheme_from_hf({"quantization_config": {"quant_method": "gptq", "bits": 4,
    ...                                         "group_size": 128}}).describe()
    'gptq 4-bit group 128'
    """
    from .config import scheme_from_hf as read

    return read(config, source, quant_file=quant_file, readers=config_readers())


def tensor_axes(
    scheme: Scheme, suffix: str, meta, fmt: Mapping[str, Any] | None = None
) -> TensorAxes | None:
    """Where N and K lie in the tensor ``<module>.<suffix>`` of a checkpoint in ``scheme``;
    ``None`` if it is not part of a linear layer the format knows (it is then replicated)."""
    return get_format(scheme.method).axes(scheme, suffix, meta, fmt)


def _is_dense(parts) -> bool:
    """Only a float ``weight`` (and ``bias``): a module the checkpoint did not quantize."""
    import torch

    w = parts.get("weight")
    return (
        w is not None
        and w.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        and set(parts) <= {"weight", "bias"}
    )


def is_quantized(method: str, parts: Mapping[str, Any]) -> bool:
    """Whether one module's stored ``parts`` (suffix -> tensor) of a ``method`` checkpoint hold
    quantized weights (to dequantize), rather than float ones (to take as they are)."""
    return method != "none" and get_format(method).is_quantized(parts)


def dequantize_module(
    method: str,
    parts: Mapping[str, Any],
    *,
    bits: int = 4,
    group_size: int = -1,
    gptq_version: int = 1,
    block: tuple[int, int] = (128, 128),
    ggml_types: Mapping[str, str] | None = None,
    dtype=None,
) -> dict[str, Any]:
    """The dense parameters of one module from its stored ``parts`` (suffix -> tensor; numpy
    arrays are taken too), whole or one worker's pieces: the layouts are the same, only
    smaller.

    Returns ``{"weight": [N, K]}`` (plus ``"bias"``, cast to ``dtype``, default float32); for
    gpt-oss's fused experts ``{"gate_up_proj": [E, H, 2I], "down_proj": [E, I, H]}`` and their
    biases. ``bits``, ``group_size`` and ``gptq_version`` are the checkpoint's (``group_size``
    -1: taken from the shapes, one group when the scales have one column); ``block`` is FP8's
    scale block; ``ggml_types`` the GGUF type name of each part (``{"weight": "Q4_K"}``).
    Activation scales (``input_scale``, ...) are ignored; any other unknown part is an error,
    never silently dropped. A float module in a quantized checkpoint (an lm_head) passes
    through.

    >>> import torch
    >>> qweight = torch.tensor([[0x76543210]], dtype=torch.int32)  # codes 0..7 along K, N = 1
    >>> qzeros = torch.tensor([[0x3]], dtype=torch.int32)          # GPTQ v1 stores z - 1
    >>> scales = torch.tensor([[0.5]], dtype=torch.float16)
    >>> dequantize_module("gptq", {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    {'weight': tensor([[-2.0000, -1.5000, -1.0000, -0.5000,  0.0000,  0.5000,  1.0000,  1.5000]])}
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    fmt = get_format(method)
    parts = {name: torch.as_tensor(t) for name, t in parts.items()}
    if _is_dense(parts):
        return get_format("none").dequantize(parts, Scheme("none"), dtype)
    scheme = Scheme(method, bits, group_size, block=(block[0], block[1]), gptq_version=gptq_version)
    return fmt.dequantize(parts, scheme, dtype, ggml_types)


def unpack_int32(words, bits: int, dim: int, count: int | None = None):
    """``packing.unpack_int32``: unsigned ``bits``-bit codes packed LSB first along ``dim``."""
    from .packing import unpack_int32 as unpack

    return unpack(words, bits, dim, count)


def _register_builtins() -> None:
    from . import (
        awq,
        dense,
        fp8,
        gguf,
        gptq,
        int_quantized,
        mlc,
        modelopt_nvfp4,
        mxfp4,
        nvfp4,
        pack_quantized,
    )

    # the order messages list them in (compressed-tensors: pack, int, float, nvfp4, mxfp4;
    # ModelOpt: NVFP4, FP8)
    for module in (
        dense,
        gptq,
        awq,
        pack_quantized,
        int_quantized,
        modelopt_nvfp4,
        fp8,
        nvfp4,
        mxfp4,
        gguf,
        mlc,
    ):
        register_format(module.FORMAT)


_register_builtins()
