"""compressed-tensors' W8A8 int8 (``int-quantized``), NVFP4 (``nvfp4-pack-quantized``) and MXFP4
(``mxfp4-pack-quantized``) checkpoints, written by compressed-tensors itself.

Each checkpoint is a tiny random model made by transformers (Llama; Phi-3 for the fused
``qkv_proj`` / ``gate_up_proj``), quantized with the library's preset scheme, calibrated with
its own qparam functions and compressed and saved by its ``ModelCompressor``
(``helpers.compressed_tensors_tool.compress_preset``); nothing here writes a quantized tensor.
For every worker and every quantized layer, the library's own decompressor applied to the
worker's shards must give exactly that worker's slice of the library's decompression of the
whole layer (``helpers.tp_reference``: vLLM's GQA layout and the zero-padding rule); every
other tensor (global and activation scales, norms, embeddings) is the stored one, replicated.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from click.testing import CliRunner
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from helpers.compressed_tensors_tool import compress_preset, decompress
from helpers.loads import plan_and_load
from helpers.tp_reference import layer_piece, padded_head_runs, padded_units
from safetensors.torch import load_file

from shardload import FormatError, PlanError
from shardload.cli import cli
from shardload.formats import scheme_from_hf
from shardload.planners import plan_for

HEADS, KV_HEADS, HIDDEN, INTER = 4, 2, 128, 256
SMALL = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTER,
    num_hidden_layers=1,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    vocab_size=96,
)
ARCHS = {
    "llama": lambda **kw: transformers.LlamaConfig(**{**SMALL, **kw}),
    "phi3": lambda **kw: transformers.Phi3Config(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**SMALL, **kw}
    ),
}
PADDED = 3  # 4 query heads and the MLP blocks over 3 workers: zero-padded
#: (preset, architecture, static activation scale): what each format is checked on
CASES = [
    ("W8A8", "llama", False),
    ("W8A8", "llama", True),
    ("W8A8", "phi3", False),
    ("NVFP4A16", "llama", False),
    ("NVFP4", "llama", False),
    ("NVFP4", "phi3", False),
    ("MXFP4A16", "llama", False),
    ("MXFP4", "phi3", False),
]
#: what the library writes for each preset: format, the planner's method, the MLP rows a
#: padded plan moves together (down_proj's K in whole scale groups), the per-module tensors
FORMATS = {
    "W8A8": ("int-quantized", "int-quantized", 1, {"weight", "weight_scale"}),
    "NVFP4A16": (
        "nvfp4-pack-quantized",
        "nvfp4",
        16,
        {"weight_packed", "weight_scale", "weight_global_scale"},
    ),
    "NVFP4": (
        "nvfp4-pack-quantized",
        "nvfp4",
        16,
        {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"},
    ),
    "MXFP4A16": ("mxfp4-pack-quantized", "mxfp4", 32, {"weight_packed", "weight_scale"}),
    "MXFP4": ("mxfp4-pack-quantized", "mxfp4", 32, {"weight_packed", "weight_scale"}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(preset, arch, static)``: (folder, config, scheme, format), made once per
    module."""
    made = {}

    def make(preset: str, arch: str, static: bool = False, **sizes):
        key = (preset, arch, static, tuple(sorted(sizes.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{preset}-{arch}")
            config = ARCHS[arch](**sizes)
            scheme, fmt = compress_preset(folder, config, preset, static_input=static)
            made[key] = folder, config, scheme, fmt
        return made[key]

    return make


# ---- the reference: which rows or columns of a layer worker i holds ----------------------------


def segments(module: str, head_dim: int):
    """[(rows, units, replicable, kind)] along the axis the module splits."""
    q, kv = (HEADS * head_dim, HEADS, False, "q"), (KV_HEADS * head_dim, KV_HEADS, True, "kv")
    mlp = (INTER, INTER, False, "mlp")
    return {
        "q_proj": [q],
        "o_proj": [q],
        "k_proj": [kv],
        "v_proj": [kv],
        "qkv_proj": [q, kv, kv],
        "gate_proj": [mlp],
        "up_proj": [mlp],
        "down_proj": [mlp],
        "gate_up_proj": [mlp, mlp],
    }[module]


def expected(
    layer: str, w: torch.Tensor, n: int, i: int, head_dim: int, padded=None
) -> torch.Tensor:
    """Worker i's piece of a layer's dense weight; ``padded``: (query heads, KV heads, MLP
    rows) per worker, -1 a zero unit."""
    module = layer.rsplit(".", 1)[1]
    axis = 1 if module in ("o_proj", "down_proj") else 0
    return layer_piece(w, axis, segments(module, head_dim), n, i, head_dim, padded)


def check_every_shard(folder, config, scheme, fmt: str, n: int, mlp_block: int) -> int:
    """Every worker's every tensor against the library's own decompression; returns how
    many quantized layers were checked."""
    stored = load_file(str(folder / "model.safetensors"))
    head_dim = config.hidden_size // config.num_attention_heads
    info, sharded = plan_and_load(folder, n)
    padded = None
    if "tensor_parallel" in info.metadata:
        layout = info.metadata["tensor_parallel"]
        # heads narrower than a scale group of o_proj's K pad in runs that fill whole groups
        run = math.lcm(head_dim, mlp_block) // head_dim
        q_heads, kv_heads = padded_head_runs(HEADS, KV_HEADS, n, run)
        assert (layout["q_heads"], layout["kv_heads"]) == (q_heads, kv_heads)
        assert layout["mlp_block"] == mlp_block
        mlp = [
            [
                r
                for u in units
                for r in (range(u * mlp_block, (u + 1) * mlp_block) if u >= 0 else [-1] * mlp_block)
            ]
            for units in padded_units(INTER // mlp_block, n)
        ]
        padded = q_heads, kv_heads, mlp
    assert ("tensor_parallel" in info.metadata) == (n == PADDED or (n, head_dim) in NARROW), n
    assert sorted(sharded.names) == sorted(stored)
    layers = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")})
    workers = [sharded.worker(i) for i in range(n)]
    for layer in layers:
        full = decompress(stored, layer, scheme, fmt)
        for i, worker in enumerate(workers):
            got = decompress(worker, layer, scheme, fmt)
            assert torch.equal(got, expected(layer, full, n, i, head_dim, padded)), (layer, i, n)
    replicated = [
        k
        for k in stored
        if k.rsplit(".", 1)[0] not in layers
        or k.rsplit(".", 1)[1] in ("weight_global_scale", "input_global_scale", "input_scale")
    ]
    for name in replicated:
        for worker in workers:
            assert torch.equal(worker[name], stored[name]), name
    return len(layers)


# ---- every format: every worker, every quantized tensor -----------------------------------------


@pytest.mark.parametrize(
    "preset, arch, static", CASES, ids=[f"{p}-{a}{'-static' if s else ''}" for p, a, s in CASES]
)
def test_shards_decompress_to_their_slice(checkpoint, preset, arch, static):
    folder, config, scheme, fmt = checkpoint(preset, arch, static)
    want_fmt, method, mlp_block, tensors = FORMATS[preset]
    assert fmt == want_fmt
    stored = load_file(str(folder / "model.safetensors"))
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert scheme_from_hf({"quantization_config": quant}).method == method
    layer = "model.layers.0.mlp.down_proj"
    own = {k.rsplit(".", 1)[1] for k in stored if k.startswith(layer + ".")}
    assert own == tensors | ({"input_scale"} if static else set())
    if preset == "W8A8":  # what the preset really writes: int8 codes, a per-channel scale
        assert stored[layer + ".weight"].dtype == torch.int8
        assert stored[layer + ".weight_scale"].shape == (HIDDEN, 1)
    else:  # two FP4 codes per byte; FP8 E4M3 or E8M0 (uint8) group scales
        assert stored[layer + ".weight_packed"].shape == (HIDDEN, INTER // 2)
        group = 16 if method == "nvfp4" else 32
        assert stored[layer + ".weight_scale"].shape == (HIDDEN, INTER // group)
        assert stored[layer + ".weight_scale"].dtype == (
            torch.float8_e4m3fn if method == "nvfp4" else torch.uint8
        )
    expected_layers = 4 if arch == "phi3" else 7
    for n in (1, 2, 4, PADDED):
        assert check_every_shard(folder, config, scheme, fmt, n, mlp_block) == expected_layers


def test_nvfp4_global_scale_is_the_reciprocal_and_replicated(checkpoint):
    # compressed-tensors stores weight_global_scale = 448 * 6 / amax (dequantize divides the
    # group scale by it); one per module, so Phi-3's fused qkv_proj has one, never narrowed
    folder, config, scheme, fmt = checkpoint("NVFP4", "phi3")
    stored = load_file(str(folder / "model.safetensors"))
    layer = "model.layers.0.self_attn.qkv_proj"
    assert stored[layer + ".weight_global_scale"].shape == (1,)
    full = decompress(stored, layer, scheme, fmt)
    assert torch.allclose(
        stored[layer + ".weight_global_scale"], 448 * 6 / full.abs().max().reshape(1), rtol=0.1
    )
    steps = plan_for(str(folder), 2).to_dict()
    assert layer + ".weight_global_scale" not in steps  # replicated
    assert layer + ".weight_scale" in steps


def test_padding_is_exact_though_an_e8m0_zero_byte_is_not_zero(checkpoint):
    # take_units pads with zero bytes: an FP8 E4M3 zero byte is +0.0, but an E8M0 zero byte is
    # 2^-127 (not zero); the padded codes are FP4 code 0 (+0), so the block is exactly zero
    assert decompress_mx_scale(torch.zeros(1, dtype=torch.uint8)).item() == 2.0**-127
    assert torch.zeros(1, dtype=torch.uint8).view(torch.float8_e4m3fn).float().item() == 0.0
    folder, config, scheme, fmt = checkpoint("MXFP4", "phi3")
    _, sharded = plan_and_load(folder, PADDED)
    layer = "model.layers.0.mlp.down_proj"
    last = sharded.worker(PADDED - 1)  # holds the padded MLP blocks (8 over 3)
    weight = decompress(last, layer, scheme, fmt)
    assert (last[layer + ".weight_scale"][:, -1] == 0).all()  # a padded group's scale byte
    assert torch.equal(weight[:, -32:], torch.zeros(HIDDEN, 32))


# ---- refusals: a split that would cut a scale group ----------------------------------------------

#: (N, head_dim) that pad heads narrower than a scale group (below)
NARROW = {(4, 8), (4, 16)}


@pytest.mark.parametrize("preset, hidden, group", [("NVFP4A16", 32, 16), ("MXFP4A16", 64, 32)])
def test_heads_narrower_than_a_group_pad_in_pairs(checkpoint, preset, hidden, group):
    # heads of hidden / 4 elements: o_proj's K holds 2 heads per scale group, so 3 and 4
    # workers would cut groups; the heads pad in pairs (whole groups), and every worker's
    # shards decompress to its padded piece. Without padding, 4 is refused naming the groups.
    folder, config, scheme, fmt = checkpoint(preset, "llama", hidden_size=hidden)
    for n in (PADDED, 4):
        assert check_every_shard(folder, config, scheme, fmt, n, group) == 7
    with pytest.raises(PlanError) as err:
        plan_for(str(folder), 4, pad=False)
    message = str(err.value)
    assert f"stored in 2 blocks of {group}" in message
    assert f"weights.group_size' = {group}" in message
    assert "N that work (up to 64): 1, 2" in message and "o_proj" in message


# ---- the command line ----------------------------------------------------------------------------


def test_cli_plans_and_loads(checkpoint, tmp_path):
    folder, *_ = checkpoint("NVFP4", "phi3")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", "--shards", "4", str(folder), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "nvfp4 4-bit group 16" in result.output and "1, 2, 4" in result.output
    for n, plan in ((4, ["--shard-info", str(out)]), (PADDED, [])):
        result = CliRunner().invoke(cli, ["load", "--shards", str(n), "--json", *plan, str(folder)])
        assert result.exit_code == 0, result.output
    refused, *_ = checkpoint("MXFP4A16", "llama", hidden_size=64)
    result = CliRunner().invoke(cli, ["plan", "--shards", "4", "--no-pad", str(refused)])
    assert result.exit_code == 2 and "blocks of 32" in result.output, result.output


# ---- reading the configs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"num_bits": 4, "type": "float", "group_size": 32}, "group_size' is 32"),
        ({"num_bits": 4, "type": "float", "group_size": "16"}, "group_size' is '16'"),
        ({"num_bits": 8, "type": "float", "group_size": 16}, "4-bit float"),
        ({"num_bits": 4, "type": "float", "group_size": 16, "symmetric": False}, "asymmetric"),
    ],
)
def test_nvfp4_configs_are_read_strictly(weights, message):
    quant = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    with pytest.raises((PlanError, FormatError)) as err:
        scheme_from_hf({"quantization_config": quant}, "config.json")
    assert message in str(err.value)


@pytest.mark.parametrize(
    "weights, message",
    [
        (
            {"num_bits": 8, "type": "int", "strategy": "block", "block_structure": [128, 128]},
            "'block'",
        ),
        ({"num_bits": 8, "type": "float", "strategy": "channel"}, "'float'"),
        (
            {
                "num_bits": 8,
                "type": "int",
                "strategy": "group",
                "group_size": 128,
                "actorder": "group",
            },
            "act-order",
        ),
    ],
)
def test_int_quantized_configs_are_read_strictly(weights, message):
    quant = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    with pytest.raises((PlanError, FormatError)) as err:
        scheme_from_hf({"quantization_config": quant}, "config.json")
    assert message in str(err.value)


# ---- a projection ending in a partial FP8 block: whole, at N = 1 --------------------------------


def test_fp8_block_kv_rows_in_a_partial_block_load_at_one_worker(checkpoint):
    """SmolLM2's attention (9 query, 3 KV heads of 64) in compressed-tensors' 128x128 FP8
    blocks: k_proj and v_proj are 192 rows, a block and a half, so no split of them is exact.
    The plan fits N = 1 (it was refused at every N): every layer as the library decompresses
    it; N = 2 is refused, naming the partial block."""
    folder, config, scheme, fmt = checkpoint(
        "FP8_BLOCK",
        "llama",
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=256,
    )
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert stored["model.layers.0.self_attn.k_proj.weight_scale"].shape == (2, 5)
    info, sharded = plan_and_load(folder, 1)
    worker = sharded.worker(0)
    layers = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")})
    assert len(layers) == 7
    for layer in layers:
        assert torch.equal(
            decompress(worker, layer, scheme, fmt), decompress(stored, layer, scheme, fmt)
        ), layer
    with pytest.raises(PlanError, match="whose 192 elements end in a partial 128-element block"):
        plan_for(str(folder), 2, pad=False)
