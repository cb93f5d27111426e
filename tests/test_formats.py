"""``shardload.formats``' dequantization: every format's dequantization against an oracle that
shares none of its code, on what the producing tool itself writes wherever the tool is installed
here.

Oracles: compressed-tensors' own compressors and decompressors (pack-quantized, int-quantized,
float-quantized, nvfp4, mxfp4), ModelOpt's ``NVFP4QTensor``, transformers'
``convert_moe_packed_tensors`` (gpt-oss) and ``_dequantize_fp8_weight`` (block FP8), gguf-py's
quantizers and dequantizer, and the project's numpy references for the formats whose tools are
not installed (``helpers.quant_refs``: GPTQ, AWQ; ``helpers.mlc_reference``: MLC q4f16_1).
Then: a worker's piece dequantizes to the matching slice of the whole, and the all-zero pieces
zero-padded plans make dequantize to exact zeros in every format.

Equality is exact throughout: each oracle computes the same products in float32 (or rounds an
exact float32 product once to its own dtype, which the codec's cast to that dtype reproduces).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from helpers import deepseek_fp8_tool, gpt_oss_tool, modelopt_tool
from helpers.gguf_blocks import blocks as gguf_k_blocks
from helpers.mlc_reference import dequantize_q4f16_1, quantize_q4f16_1
from helpers.quant_refs import awq as awq_ref
from helpers.quant_refs import gptq as gptq_ref
from safetensors.torch import load_file

from shardload import formats
from shardload.formats import dequantize_module

N, K = 64, 256  # a small linear: 64 outputs, 256 inputs (whole groups, words and blocks)


def weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def spread_weight(n: int = N, k: int = K, seed: int = 0) -> torch.Tensor:
    """A weight whose 16-element groups span orders of magnitude: many distinct FP4 scales, so
    an order of operations other than the tool's shows up as rounding differences."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp(2 * torch.randn(n, k // 16, 1, generator=g))
    return (torch.randn(n, k // 16, 16, generator=g) * spread).reshape(n, k)


def as_torch(parts: dict) -> dict[str, torch.Tensor]:
    return {
        name: torch.as_tensor(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
        for name, t in parts.items()
    }


def assert_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and values (``torch.equal``: -0.0 == 0.0, the one difference allowed,
    as tools differ in the sign of a zero product)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        got.dtype,
        got.shape,
        want.dtype,
        want.shape,
    )
    assert torch.equal(got, want), f"max |diff| {(got.double() - want.double()).abs().max()}"


# ---- GPTQ and AWQ: the project's numpy references (AutoGPTQ / AutoAWQ are not installed) ----


def gptq_case(bits: int, version: int, sym: bool, act_order: bool, group: int = 32) -> dict:
    w = weight().numpy()
    if not sym:  # all-positive rows: zero point 0, which v1 stores as an all-ones field
        w[:8] = np.abs(w[:8])
    perm = np.random.default_rng(1).permutation(K) if act_order else None
    return gptq_ref.quantize_gptq(w, bits, group, sym=sym, version=version, perm=perm)


@pytest.mark.parametrize("act_order", [False, True], ids=["ordered", "act-order"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_matches_the_reference(bits, version, sym, act_order):
    stored = gptq_case(bits, version, sym, act_order)
    got = dequantize_module(
        "gptq", as_torch(stored), bits=bits, group_size=32, gptq_version=version
    )["weight"]
    want = torch.from_numpy(gptq_ref.dequantize_gptq(stored, bits, version))
    assert_equal(got, want)
    if not sym and version == 1:  # the wrap-around case is really exercised
        fields = gptq_ref.unpack_bits(stored["qzeros"], bits, axis=1)
        assert (fields == (1 << bits) - 1).any()


@pytest.mark.parametrize("group", [32, -1])
def test_gptq_without_g_idx_uses_k_over_group(group):
    stored = gptq_case(4, 1, False, False, group)
    want = torch.from_numpy(gptq_ref.dequantize_gptq(stored, 4, 1))
    del stored["g_idx"]
    assert_equal(
        dequantize_module("gptq", as_torch(stored), bits=4, group_size=group)["weight"], want
    )
    # group_size -1 with several groups: K / groups, from the shapes
    assert_equal(dequantize_module("gptq", as_torch(stored), bits=4)["weight"], want)


@pytest.mark.parametrize("group", [32, -1])
def test_awq_matches_the_reference(group):
    w = weight().numpy()
    w[:, :40] = np.abs(w[:, :40])  # some zero points 0
    stored = awq_ref.quantize_awq(w, group)
    got = dequantize_module("awq", as_torch(stored), group_size=group)["weight"]
    assert_equal(got, torch.from_numpy(awq_ref.dequantize_awq(stored)))


# ---- compressed-tensors: its own compressors are both the writer and the oracle --------------


def ct_compress(fmt: str, scheme, w: torch.Tensor, scale_dtype=None) -> tuple[dict, torch.Tensor]:
    """``w`` calibrated with compressed-tensors' ``calculate_qparams`` (min/max, per its
    strategy), compressed by its compressor for ``fmt``; returns what it stores and its own
    decompression of that."""
    args = scheme.weights
    if args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    else:
        groups = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    state = {"weight": w}
    global_scale = None
    if args.strategy == "tensor_group":  # NVFP4: a per-tensor global scale, its reciprocal
        global_scale = state["weight_global_scale"] = generate_gparam(w.min(), w.max())
    scale, zero = calculate_qparams(lo, hi, args, global_scale=global_scale)
    state["weight_scale"] = scale if scale_dtype is None else scale.to(scale_dtype)
    state["weight_zero_point"] = zero
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = dict(compressor.compress(state, scheme))
    return stored, compressor.decompress(dict(stored), scheme)["weight"]


def ct_scheme(preset: str, **weights):
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weights:
        scheme.weights = QuantizationArgs(**{**scheme.weights.model_dump(), **weights})
    return scheme


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_quantized_matches_compressed_tensors(bits, sym, strategy, scale_dtype):
    group = 32 if strategy == "group" else None
    scheme = ct_scheme("W4A16", num_bits=bits, symmetric=sym, strategy=strategy, group_size=group)
    stored, want = ct_compress("pack-quantized", scheme, weight(), scale_dtype)
    assert ("weight_zero_point" in stored) == (not sym)
    # the library computes in the scale's dtype: one rounding of the exact product
    got = dequantize_module(
        "pack-quantized", stored, bits=bits, group_size=group or -1, dtype=scale_dtype
    )["weight"]
    assert_equal(got, want)
    exact = dequantize_module("pack-quantized", stored, bits=bits)["weight"]
    assert_equal(exact.to(scale_dtype), want)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_pack_quantized_act_order_g_idx(sym):
    """compressed-tensors 0.20.1 no longer applies ``weight_g_idx`` itself, so the act-order
    weight is made and read with its own functions, each column given its group's scale and
    zero point (``scale[:, g_idx]``, a group of one column)."""
    w, bits, group = weight(), 4, 32
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(2))] = (
        torch.arange(K, dtype=torch.int32) // group
    )
    args = QuantizationArgs(num_bits=bits, symmetric=sym, strategy="group", group_size=group)
    per_column = QuantizationArgs(num_bits=bits, symmetric=sym, strategy="group", group_size=1)
    lo = torch.stack([w[:, g_idx == j].amin(1) for j in range(K // group)], 1)
    hi = torch.stack([w[:, g_idx == j].amax(1) for j in range(K // group)], 1)
    scale, zero = calculate_qparams(lo, hi, args)
    cols = g_idx.long()
    zero_cols = None if sym else zero[:, cols]
    codes = quantize(w, scale[:, cols], zero_cols, per_column, dtype=torch.int8)
    stored = {
        "weight_packed": pack_to_int32(codes, bits),
        "weight_scale": scale,
        "weight_g_idx": g_idx,
        "weight_shape": torch.tensor([N, K]),
    }
    if not sym:
        stored["weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0)
    unpacked = unpack_from_int32(stored["weight_packed"], bits, torch.Size([N, K]))
    want = dequantize(unpacked, scale[:, cols], zero_cols, per_column, dtype=torch.float32)
    got = dequantize_module("pack-quantized", stored, bits=bits, group_size=group)["weight"]
    assert_equal(got, want)


@pytest.mark.parametrize(
    "strategy,sym",
    [("channel", True), ("channel", False), ("group", True), ("group", False), ("tensor", True)],
)
def test_int_quantized_matches_compressed_tensors(strategy, sym):
    group = 64 if strategy == "group" else None
    scheme = ct_scheme("W8A8", symmetric=sym, strategy=strategy, group_size=group)
    stored, want = ct_compress("int-quantized", scheme, weight())
    assert stored["weight"].dtype == torch.int8
    assert ("weight_zero_point" in stored) == (not sym)
    stored["input_scale"] = torch.tensor([0.02])  # a static activation scale: not the weight's
    got = dequantize_module("int-quantized", stored, group_size=group or -1)["weight"]
    assert_equal(got, want)


def test_nvfp4_matches_compressed_tensors():
    # (3x: a global scale with which both other orders below round differently)
    stored, want = ct_compress("nvfp4-pack-quantized", ct_scheme("NVFP4A16"), weight() * 3)
    assert want.dtype == torch.bfloat16  # the library's decompressor answers in bf16
    assert_equal(dequantize_module("nvfp4", stored, dtype=torch.bfloat16)["weight"], want)
    # in float32: the library's own unpacking and dequantize, asked for float32
    codes = unpack_fp4_from_uint8(stored["weight_packed"], N, K, dtype=torch.float32)
    scale, global_scale = stored["weight_scale"].float(), stored["weight_global_scale"]
    exact = dequantize(
        codes,
        scale,
        args=ct_scheme("NVFP4A16").weights,
        global_scale=global_scale,
        dtype=torch.float32,
    )
    assert_equal(dequantize_module("nvfp4", stored)["weight"], exact)
    # the order matters in float32 (the library's bf16 output hides it): codes times the
    # scale, then divided, or times the global scale's reciprocal, round otherwise here
    scale = scale.repeat_interleave(16, -1)
    assert not torch.equal(codes * scale / global_scale, exact)
    assert not torch.equal(codes * (scale * (1 / global_scale)), exact)


def test_mxfp4_matches_compressed_tensors():
    stored, want = ct_compress("mxfp4-pack-quantized", ct_scheme("MXFP4A16"), spread_weight())
    assert stored["weight_scale"].dtype == torch.uint8
    # FP4 times a power of two is exact in any float type: float32 equals the library's bf16
    assert_equal(dequantize_module("mxfp4", stored)["weight"], want.float())


# ---- gpt-oss's MXFP4 experts: transformers' own converter is the oracle ---------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> dict[str, torch.Tensor]:
    folder = tmp_path_factory.mktemp("gpt_oss")
    gpt_oss_tool.write_gpt_oss_mxfp4(folder, gpt_oss_tool.tiny_config())
    return load_file(folder / "model.safetensors")


def test_gpt_oss_experts_match_transformers(gpt_oss):
    prefix = "model.layers.1.mlp.experts."
    parts = {k[len(prefix) :]: v for k, v in gpt_oss.items() if k.startswith(prefix)}
    assert set(parts) == {
        "gate_up_proj_blocks",
        "gate_up_proj_scales",
        "gate_up_proj_bias",
        "down_proj_blocks",
        "down_proj_scales",
        "down_proj_bias",
    }
    got = dequantize_module("mxfp4", parts)
    for p in ("gate_up_proj", "down_proj"):
        want = gpt_oss_tool.dequantize(parts[f"{p}_blocks"], parts[f"{p}_scales"])
        assert_equal(got[p], want)
        assert_equal(got[f"{p}_bias"], parts[f"{p}_bias"].float())
    config = gpt_oss_tool.tiny_config()
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    assert got["gate_up_proj"].shape == (e, h, 2 * i) and got["down_proj"].shape == (e, i, h)


def test_bf16_gpt_oss_experts_pass_through():
    parts = {
        "gate_up_proj": torch.randn(2, 8, 12).bfloat16(),
        "down_proj": torch.randn(2, 6, 8).bfloat16(),
        "gate_up_proj_bias": torch.randn(2, 12).bfloat16(),
    }
    got = dequantize_module("none", parts, dtype=torch.bfloat16)
    assert got.keys() == parts.keys()
    for name, t in parts.items():
        assert_equal(got[name], t)


# ---- ModelOpt NVFP4: its own quantizer and dequantizer ------------------------------------


@pytest.mark.slow
def test_modelopt_nvfp4_matches_modelopt():
    _, _, NVFP4QTensor = modelopt_tool._import_quiet()
    packed, scale, scale_2 = NVFP4QTensor.quantize(spread_weight(), modelopt_tool.NVFP4_GROUP)
    parts = {
        "weight": packed._quantized_data,
        "weight_scale": scale,
        "weight_scale_2": scale_2,
        "input_scale": torch.tensor(0.01),
    }
    want = modelopt_tool.dequantize(parts["weight"], scale, scale_2)
    assert_equal(dequantize_module("modelopt-nvfp4", parts)["weight"], want)
    # the order matters: codes times weight_scale, then times weight_scale_2, rounds otherwise
    codes = unpack_fp4_from_uint8(parts["weight"], N, K, dtype=torch.float32)
    other = codes * scale.float().repeat_interleave(16, -1) * scale_2
    assert not torch.equal(other, want)


def test_an_unquantized_module_passes_through():
    lm_head = torch.randn(96, 64).bfloat16()  # ModelOpt, compressed-tensors keep lm_head float
    for method in [f.name for f in formats.list_formats()]:
        got = dequantize_module(method, {"weight": lm_head}, dtype=torch.bfloat16)
        assert_equal(got["weight"], lm_head)


# ---- FP8 --------------------------------------------------------------------------------------


def fp8_weight(n: int, k: int) -> torch.Tensor:
    return (weight(n, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("name", ["weight_scale_inv", "weight_scale"])
def test_fp8_blocks_match_transformers(name):
    n, k = 200, 300  # partial edge blocks: a 2 x 3 grid of 128 x 128
    w = fp8_weight(n, k)
    s = torch.rand(2, 3, generator=torch.Generator().manual_seed(3)) + 0.01
    got = dequantize_module("fp8", {"weight": w, name: s}, block=(128, 128))["weight"]
    assert_equal(got, deepseek_fp8_tool.dequantize(w, s))


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_fp8_per_tensor_and_channel(strategy):
    scheme = preset_name_to_scheme("FP8", ["Linear"])
    scheme.weights = QuantizationArgs(**{**scheme.weights.model_dump(), "strategy": strategy})
    stored, want = ct_compress("float-quantized", scheme, weight())
    got = dequantize_module("fp8", stored)["weight"]
    assert_equal(got, want)  # compressed-tensors' own decompression
    hand = stored["weight"].float() * stored["weight_scale"].float()  # by hand: w * s
    assert_equal(got, hand)
    if strategy == "tensor":  # older checkpoints store a 0-d scale
        scalar = {"weight": stored["weight"], "weight_scale": stored["weight_scale"].reshape(())}
        assert_equal(dequantize_module("fp8", scalar)["weight"], hand)


# ---- GGUF: gguf-py quantizes (or, for K-quants it cannot, valid random blocks) -------------

GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "MXFP4", "F16", "BF16"]


def gguf_weight(name: str, shape=(N, K)) -> np.ndarray:
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(4)
    rows, k = math.prod(shape[:-1]), shape[-1]
    raw = gguf_k_blocks(rng, qtype, rows, k)  # gguf-py's quantizer where it has one
    return raw.view(np.uint8).reshape(*shape[:-1], -1)  # raw bytes, as the reader gives them


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_matches_gguf_py(name):
    raw = gguf_weight(name)
    got = dequantize_module("gguf", {"weight": torch.from_numpy(raw)}, ggml_types={"weight": name})[
        "weight"
    ]
    want = torch.from_numpy(gguf_quants.dequantize(raw, GGMLQuantizationType[name]))
    assert got.shape == (N, K)
    assert_equal(got, want)


def test_gguf_q8_0_by_hand():
    """Independent of gguf-py's dequantizer: a Q8_0 block is an fp16 d and 32 int8 codes."""
    raw = gguf_weight("Q8_0")
    blocks = raw.reshape(N, K // 32, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].view(np.int8).astype(np.float32)
    want = torch.from_numpy((d * q).reshape(N, K))
    got = dequantize_module(
        "gguf", {"weight": torch.from_numpy(raw)}, ggml_types={"weight": "Q8_0"}
    )["weight"]
    assert_equal(got, want)


def test_gguf_stacked_experts_and_float_tensors():
    raw = gguf_weight("Q4_K", (3, N, K))  # ffn_*_exps: [E, rows, row bytes]
    got = dequantize_module(
        "gguf", {"weight": torch.from_numpy(raw)}, ggml_types={"weight": GGMLQuantizationType.Q4_K}
    )["weight"]
    want = gguf_quants.dequantize(raw.reshape(3 * N, -1), GGMLQuantizationType.Q4_K)
    assert_equal(got, torch.from_numpy(want).reshape(3, N, K))
    f32 = torch.randn(N, K)  # F32 / F16 tensors come back from the reader as floats
    out = dequantize_module(
        "gguf", {"weight": f32, "bias": torch.ones(N)}, ggml_types={"weight": "F32", "bias": "F32"}
    )
    assert_equal(out["weight"], f32)
    assert_equal(out["bias"], torch.ones(N))


# ---- MLC q4f16_1 --------------------------------------------------------------------------


def test_mlc_matches_the_reference():
    q_weight, q_scale = quantize_q4f16_1(weight().numpy())
    parts = {"q_weight": torch.from_numpy(q_weight), "q_scale": torch.from_numpy(q_scale)}
    want = dequantize_q4f16_1(q_weight, q_scale)
    assert_equal(dequantize_module("mlc", parts)["weight"], torch.from_numpy(want))
    # MLC computes in float16: the exact float32 product rounded once
    got16 = dequantize_module("mlc", parts, dtype=torch.float16)["weight"]
    assert_equal(got16, torch.from_numpy(want.astype(np.float16)))


# ---- a worker's piece is the slice of the whole -------------------------------------------


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("act_order", [False, True], ids=["ordered", "act-order"])
def test_gptq_row_split_piece_is_the_slice(bits, act_order):
    """Row-parallel (K split, 2 workers of 4 whole groups of 32): qweight rows in words,
    g_idx sliced; scales and qzeros in whole groups with g_idx rebased, or (act-order: any row
    may use any group) replicated with g_idx as it is."""
    stored = as_torch(gptq_case(bits, 1, False, act_order))
    whole = dequantize_module("gptq", stored, bits=bits, group_size=32)["weight"]
    half, words, groups = K // 2, K // 2 * bits // 32, K // 2 // 32
    for i in range(2):
        piece = {
            "qweight": stored["qweight"][i * words : (i + 1) * words],
            "g_idx": stored["g_idx"][i * half : (i + 1) * half],
        }
        if act_order:
            piece.update(scales=stored["scales"], qzeros=stored["qzeros"])
        else:
            piece.update(
                scales=stored["scales"][i * groups : (i + 1) * groups],
                qzeros=stored["qzeros"][i * groups : (i + 1) * groups],
                g_idx=piece["g_idx"] - i * groups,
            )
        got = dequantize_module("gptq", piece, bits=bits, group_size=32)["weight"]
        assert_equal(got, whole[:, i * half : (i + 1) * half])


def test_gptq_column_split_piece_is_the_slice():
    stored = as_torch(gptq_case(4, 2, False, True))
    whole = dequantize_module("gptq", stored, bits=4, group_size=32, gptq_version=2)["weight"]
    for i in range(4):  # 16 columns each: 2 whole qzeros words
        cols = slice(i * 16, (i + 1) * 16)
        piece = {
            "qweight": stored["qweight"][:, cols],
            "scales": stored["scales"][:, cols],
            "qzeros": stored["qzeros"][:, i * 2 : (i + 1) * 2],
            "g_idx": stored["g_idx"],
        }
        got = dequantize_module("gptq", piece, bits=4, group_size=32, gptq_version=2)["weight"]
        assert_equal(got, whole[cols])


def test_nvfp4_pieces_are_the_slices():
    """3 workers: K split at 32 (whole 16-element groups, whole bytes), or N split; the global
    scale is per module, replicated."""
    n, k = 48, 96
    stored, _ = ct_compress("nvfp4-pack-quantized", ct_scheme("NVFP4A16"), spread_weight(n, k))
    whole = dequantize_module("nvfp4", stored)["weight"]
    gs = stored["weight_global_scale"]
    for i in range(3):
        cols = slice(i * 32, (i + 1) * 32)
        piece = {
            "weight_packed": stored["weight_packed"][:, i * 16 : (i + 1) * 16],
            "weight_scale": stored["weight_scale"][:, i * 2 : (i + 1) * 2],
            "weight_global_scale": gs,
        }
        assert_equal(dequantize_module("nvfp4", piece)["weight"], whole[:, cols])
        rows = slice(i * 16, (i + 1) * 16)
        piece = {
            "weight_packed": stored["weight_packed"][rows],
            "weight_scale": stored["weight_scale"][rows],
            "weight_global_scale": gs,
        }
        assert_equal(dequantize_module("nvfp4", piece)["weight"], whole[rows])


# ---- zero padding -------------------------------------------------------------------------


def z(*shape, dtype=torch.int32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


#: "method [variant]": the zero pieces a padded plan makes for each format (its per-module
#: scalars, which are replicated, keep real values), and the scheme's keyword arguments
ZERO_PIECES = {
    "none": ({"weight": z(N, K, dtype=torch.bfloat16)}, {}),
    "gptq v1": (
        {
            "qweight": z(K // 8, N),
            "qzeros": z(K // 32, N // 8),
            "g_idx": z(K),
            "scales": z(K // 32, N, dtype=torch.float16),
        },
        {"group_size": 32},
    ),
    "gptq 3-bit v2": (
        {
            "qweight": z(K * 3 // 32, N),
            "qzeros": z(K // 32, N * 3 // 32),
            "scales": z(K // 32, N, dtype=torch.float16),
        },
        {"bits": 3, "group_size": 32, "gptq_version": 2},
    ),
    "awq": (
        {
            "qweight": z(K, N // 8),
            "qzeros": z(K // 32, N // 8),
            "scales": z(K // 32, N, dtype=torch.float16),
        },
        {"group_size": 32},
    ),
    "pack-quantized": (
        {
            "weight_packed": z(N, K // 8),
            "weight_zero_point": z(N // 8, K // 32),
            "weight_scale": z(N, K // 32, dtype=torch.bfloat16),
            "weight_shape": torch.tensor([N, K]),
        },
        {"group_size": 32},
    ),
    "int-quantized": (
        {"weight": z(N, K, dtype=torch.int8), "weight_scale": z(N, 1, dtype=torch.float32)},
        {},
    ),
    "nvfp4": (
        {
            "weight_packed": z(N, K // 2, dtype=torch.uint8),
            "weight_scale": z(N, K // 16, dtype=torch.float8_e4m3fn),
            "weight_global_scale": torch.tensor([1000.0]),
        },
        {},
    ),
    "mxfp4": (
        {
            "weight_packed": z(N, K // 2, dtype=torch.uint8),
            "weight_scale": z(N, K // 32, dtype=torch.uint8),
        },
        {},
    ),
    "mxfp4 gpt-oss": (
        {
            "gate_up_proj_blocks": z(2, N, K // 32, 16, dtype=torch.uint8),
            "gate_up_proj_scales": z(2, N, K // 32, dtype=torch.uint8),
            "down_proj_blocks": z(2, K, N // 32, 16, dtype=torch.uint8),
            "down_proj_scales": z(2, K, N // 32, dtype=torch.uint8),
        },
        {},
    ),
    "modelopt-nvfp4": (
        {
            "weight": z(N, K // 2, dtype=torch.uint8),
            "weight_scale": z(N, K // 16, dtype=torch.float8_e4m3fn),
            "weight_scale_2": torch.tensor(0.01),
        },
        {},
    ),
    "fp8": (
        {
            "weight": z(256, K, dtype=torch.float8_e4m3fn),
            "weight_scale_inv": z(2, 2, dtype=torch.float32),
        },
        {},
    ),
    "mlc": (
        {
            "q_weight": z(N, K // 8, dtype=torch.uint32),
            "q_scale": z(N, K // 32, dtype=torch.float16),
        },
        {},
    ),
    **{
        f"gguf {t}": (
            {
                "weight": z(
                    N,
                    K
                    // GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]
                    * GGML_QUANT_SIZES[GGMLQuantizationType[t]][1],
                    dtype=torch.uint8,
                )
            },
            {"ggml_types": {"weight": t}},
        )
        for t in GGUF_TYPES
    },
}


@pytest.mark.parametrize("case", ZERO_PIECES)
def test_zero_pieces_dequantize_to_zeros(case):
    parts, kwargs = ZERO_PIECES[case]
    out = dequantize_module(case.split()[0], parts, **kwargs)
    assert out
    for name, t in out.items():
        assert torch.count_nonzero(t) == 0, f"{name} is not all zeros (NaN counts)"


# ---- refusals, bias, and what the module imports -------------------------------------------


def test_bias_is_passed_through_cast():
    stored = as_torch(gptq_case(4, 1, True, False))
    stored["bias"] = torch.randn(N).half()
    out = dequantize_module("gptq", stored, group_size=32, dtype=torch.bfloat16)
    assert out["weight"].dtype == torch.bfloat16
    assert_equal(out["bias"], stored["bias"].bfloat16())


def test_refusals():
    stored = as_torch(gptq_case(4, 1, True, False))
    with pytest.raises(ValueError, match="unknown quantization method 'bnb'"):
        dequantize_module("bnb", stored)
    with pytest.raises(ValueError, match=r"unknown parts \['qweight_typo'\]"):
        dequantize_module("gptq", {**stored, "qweight_typo": stored["qweight"]})
    with pytest.raises(ValueError, match="missing part 'scales'"):
        dequantize_module("gptq", {k: v for k, v in stored.items() if k != "scales"})
    no_g_idx = {k: v for k, v in stored.items() if k != "g_idx"}
    with pytest.raises(ValueError, match="groups of 64 is 4 groups, the scales have 8"):
        dequantize_module("gptq", no_g_idx, group_size=64)
    with pytest.raises(ValueError, match="needs its ggml type"):
        dequantize_module("gguf", {"weight": z(N, 144, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="neither per tensor, per channel nor per 128x128"):
        dequantize_module("fp8", {"weight": fp8_weight(N, K), "weight_scale": torch.ones(3)})


def test_formats_import_nothing_heavy_until_they_dequantize():
    # the format table is read by the planners and the CLI's help: torch is imported by the
    # numeric helpers (packing.py) alone, numpy and gguf-py only inside a dequantization
    folder = Path(formats.__file__).parent
    light = {"__future__", "typing", "dataclasses", "re", "threading", "collections", ""}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        top, inner = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else ["" if node.level else node.module]
                )
                (top if node in tree.body else inner).update(n.split(".")[0] for n in names)
        allowed = light | ({"torch"} if path.name == "packing.py" else set())
        assert top <= allowed, (path.name, top - allowed)
        assert inner <= {"torch", "numpy", "gguf", ""}, (path.name, inner)
