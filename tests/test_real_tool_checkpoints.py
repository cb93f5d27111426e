"""Checkpoints written by the tools people use, not by our own code: transformers'
``save_pretrained`` (config.json and weights, as a user downloads them), transformers'
``GPTQConfig`` and compressed-tensors' quantization configs (as llmcompressor writes them), and a
model compressed to W4A16 ``pack-quantized`` by compressed-tensors itself; each loaded directly
and through the staged pipeline.

The reference for every shard is the tool's own output: the dense weights the model saved, or
the weights compressed-tensors' own unpacking and dequantization give back; which rows or columns
worker i holds comes from ``helpers.tp_reference`` (vLLM's layout, written from the rules).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers  # the test extra installs it and compressed-tensors: missing is an error
from click.testing import CliRunner
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from helpers.compressed_tensors_tool import compress_w4a16 as compress_llama_w4a16
from helpers.compressed_tensors_tool import dequant
from helpers.paths import EXAMPLE
from helpers.tp_reference import rows_of
from safetensors.torch import load_file

from shardload import ShardInfo, Staging, ThreadedSession, load_sharded
from shardload.cli import cli
from shardload.formats import scheme_from_hf
from shardload.planners import plan_for

HEADS, KV_HEADS = 4, 2
CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),  # q/k/v biases
    "qwen3": (
        transformers.Qwen3Config,
        {"head_dim": 48},
    ),  # per-head q/k norms, head_dim != hidden/heads
}


def save_model(folder: Path, arch: str, hidden: int = 64, inter: int = 128):
    """A tiny random model of ``arch`` saved by transformers; returns its config."""
    cls, extra = CONFIGS[arch]
    config = cls(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=96,
        **extra,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return config


def expected(name: str, w: torch.Tensor, n: int, i: int, config) -> torch.Tensor:
    """Worker i's piece of the dense tensor ``name`` (its logical [out, in] weight or bias)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // HEADS
    q, kv, inter = HEADS * head_dim, KV_HEADS * head_dim, config.intermediate_size
    module = name.rsplit(".", 2)[-2]
    if module == "q_proj":
        return w[rows_of(n, i, q, HEADS, False)]
    if module in ("k_proj", "v_proj"):
        return w[rows_of(n, i, kv, KV_HEADS, True)]
    if module in ("gate_proj", "up_proj"):
        return w[rows_of(n, i, inter, inter, False)]
    if module == "o_proj":
        return w[:, rows_of(n, i, q, HEADS, False)]
    if module == "down_proj":
        return w[:, rows_of(n, i, inter, inter, False)]
    return w  # norms, embeddings, lm_head: replicated


#: the direct path, and the staged pipeline with a ring small enough to cut every tensor
STAGINGS = {"direct": False, "staged": Staging(buffers=2, buffer_mib=0.004)}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("staging", sorted(STAGINGS))
def test_transformers_checkpoints_shard_exactly(tmp_path, arch, n, staging):
    config = save_model(tmp_path, arch)
    dense = load_file(str(tmp_path / "model.safetensors"))
    with ThreadedSession(n) as session:
        sharded = load_sharded(
            str(tmp_path),
            plan_for(str(tmp_path), n),
            session,
            progress=False,
            staging=STAGINGS[staging],
        )
    assert sorted(sharded.names) == sorted(dense)
    for name, w in dense.items():
        for i in range(n):
            assert torch.equal(sharded.shard(name, i), expected(name, w, n, i, config)), (name, i)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_transformers_checkpoints_load_padded_through_the_cli(tmp_path, arch):
    save_model(tmp_path, arch)  # 4 heads over 3 workers: zero-padded
    for command in ("validate", "load"):
        result = CliRunner().invoke(cli, [command, "--shards", "3", str(tmp_path)])
        assert result.exit_code == 0, result.output


def test_transformers_gptq_config_plans_like_the_shipped_example(tmp_path):
    shutil.copy(EXAMPLE + "/model.safetensors", tmp_path)
    config = json.loads(Path(EXAMPLE, "config.json").read_text())
    config["quantization_config"] = transformers.GPTQConfig(
        bits=4, group_size=32, desc_act=False, sym=False
    ).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    shipped = ShardInfo.load(Path(EXAMPLE, "shard_info.json")).to_dict()
    assert plan_for(str(tmp_path), 4).to_dict() == shipped


@pytest.mark.parametrize(
    "preset, fmt, method, bits, group",
    [
        ("W4A16", "pack-quantized", "pack-quantized", 4, 128),
        ("W4A16_ASYM", "pack-quantized", "pack-quantized", 4, 128),
        ("W8A16", "pack-quantized", "pack-quantized", 8, 128),
        ("FP8", "float-quantized", "fp8", 8, -1),
        ("FP8_DYNAMIC", "float-quantized", "fp8", 8, -1),
        ("FP8_BLOCK", "float-quantized", "fp8", 8, -1),
    ],
)
def test_compressed_tensors_configs_are_read(preset, fmt, method, bits, group):
    qc = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        format=fmt,
        ignore=["lm_head"],
    )
    quant = json.loads(json.dumps({**qc.model_dump(), "quant_method": "compressed-tensors"}))
    scheme = scheme_from_hf({"quantization_config": quant}, "config.json")
    assert (scheme.method, scheme.bits, scheme.group_size) == (method, bits, group)


def compress_w4a16(folder: Path, symmetric: bool):
    """A tiny Llama compressed to pack-quantized int4, group 32, by compressed-tensors
    (``helpers.compressed_tensors_tool``). Returns the config and the library's quantization
    args."""
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=96,
    )
    return config, compress_llama_w4a16(folder, config, symmetric)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("staging", sorted(STAGINGS))
def test_compressed_tensors_w4a16_shards_dequantize_to_their_slice(tmp_path, symmetric, n, staging):
    config, args = compress_w4a16(tmp_path, symmetric)
    stored = load_file(str(tmp_path / "model.safetensors"))
    layers = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_packed")})
    assert len(layers) == 7
    with ThreadedSession(n) as session:
        sharded = load_sharded(
            str(tmp_path),
            plan_for(str(tmp_path), n),
            session,
            progress=False,
            staging=STAGINGS[staging],
        )
    for layer in layers:
        full = dequant(stored, layer, args)
        for i in range(n):
            piece = {k: sharded.shard(k, i) for k in stored if k.startswith(layer + ".")}
            assert torch.equal(
                dequant(piece, layer, args), expected(layer + ".weight", full, n, i, config)
            ), (layer, i)
