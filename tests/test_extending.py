"""Extending shardload is one room each: a quantization format is one module (here: one class in
this file), a Llama-like architecture one table row, a kind of session one registered opener, a
shard function one registration. Each is done here, in this file alone, and then used through
the public front door: planned, loaded, dequantized, run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from helpers.paths import EXAMPLE
from safetensors.torch import save_file

from shardload import Selection, ThreadedSession, load_sharded, open_checkpoint, register_shard_func
from shardload.cli import cli
from shardload.formats import (
    Axis,
    QuantFormat,
    Scheme,
    TensorAxes,
    dequantize_module,
    register_format,
    unregister_format,
)
from shardload.planners import plan_decision, plan_for
from shardload.planners.architectures import (
    Architecture,
    register_architecture,
    unregister_architecture,
)

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- a quantization format: one class ----------------------------------------------------------


class RowInt8(QuantFormat):
    """A toy format: ``codes`` int8 [N, K] and one float scale per output row, ``row_scale``
    [N]: W = codes * row_scale[:, None]."""

    name = "toy-row-int8"
    description = "int8 codes with a scale per output row (a test's toy)"
    parts = ("codes", "row_scale")
    quantized_parts = ("codes",)
    configs = {"toy-row-int8": lambda quant: Scheme("toy-row-int8", 8)}

    def tensor_axes(self, scheme, suffix, meta, fmt):
        if suffix == "codes":
            return TensorAxes(Axis(0), Axis(1))
        if suffix == "row_scale":
            return TensorAxes(Axis(0), None)  # rows split with the codes; whole on a K split
        return None

    def dense(self, parts, scheme, ggml_types):
        return parts["codes"].float() * parts["row_scale"].float()[:, None]


@pytest.fixture
def toy_format():
    register_format(RowInt8())
    yield
    unregister_format("toy-row-int8")


def _toy_checkpoint(folder) -> transformers.PreTrainedModel:
    """A random Llama stored in the toy format; returns transformers' model of the same weights
    (the dequantized ones), the reference."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            module, _, suffix = name.rpartition(".")
            if module.rpartition(".")[2] in LINEARS:
                scale = param.abs().amax(dim=1) / 127
                codes = torch.round(param / scale[:, None]).to(torch.int8)
                tensors[f"{module}.codes"] = codes
                tensors[f"{module}.row_scale"] = scale
                param.copy_(codes.float() * scale[:, None])  # the reference holds the same
            else:
                tensors[name] = param.detach().clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved["quantization_config"] = {"quant_method": "toy-row-int8"}
    (folder / "config.json").write_text(json.dumps(saved))
    return model


def test_a_format_is_one_class_planned_loaded_dequantized_and_run(toy_format, tmp_path):
    reference = _toy_checkpoint(tmp_path)
    decision = plan_decision(str(tmp_path), 2)
    steps = decision.shard_info().steps
    assert decision.summary.scheme.method == "toy-row-int8"
    layer = "model.layers.0."
    assert (
        layer + "self_attn.q_proj.codes" in steps and layer + "self_attn.q_proj.row_scale" in steps
    )  # column split: rows with their scales
    assert layer + "self_attn.o_proj.row_scale" not in steps  # row split: scales whole
    with open_checkpoint(str(tmp_path)) as ckpt, ThreadedSession(2) as sess:
        sharded = load_sharded(ckpt, None, sess, progress=False)
        for module in ("self_attn.q_proj", "mlp.down_proj"):
            whole = dequantize_module(
                "toy-row-int8",
                {p: ckpt.read(f"{layer}{module}.{p}") for p in ("codes", "row_scale")},
            )["weight"]
            for worker in (0, 1):
                piece = dequantize_module(
                    "toy-row-int8",
                    {
                        p: sharded.shard(f"{layer}{module}.{p}", worker)
                        for p in ("codes", "row_scale")
                    },
                )["weight"]
                want = (
                    whole.chunk(2, dim=0) if module.endswith("q_proj") else whole.chunk(2, dim=1)
                )[worker]
                assert torch.equal(piece, want)
    # and transformers' own model runs on it, split over the workers
    from shardload.hf import load_tp_model

    ids = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        want = reference(ids).logits
    with ThreadedSession(2) as sess, load_tp_model(str(tmp_path), sess) as model:
        got = model(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_an_unknown_format_is_refused_naming_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                **SIZES,
                "quantization_config": {"quant_method": "toy-row-int8"},
            }
        )
    )
    save_file(
        {"model.embed_tokens.weight": torch.zeros(96, 64)}, str(tmp_path / "model.safetensors")
    )
    from shardload import PlanError

    with pytest.raises(
        PlanError,
        match=r"'toy-row-int8': that quantization method is not "
        r"supported by the planner \(awq, compressed-tensors",
    ):
        plan_for(str(tmp_path), 2)


# ---- an architecture: one table row ------------------------------------------------------------


def test_a_llama_like_architecture_is_one_row(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({**json.loads(open(f"{EXAMPLE}/config.json").read()), "model_type": "my_llama"})
    )
    (folder / "model.safetensors").symlink_to(f"{EXAMPLE}/model.safetensors")
    from shardload import PlanError

    with pytest.raises(PlanError, match="model_type 'my_llama' is not supported"):
        plan_for(str(folder), 4)
    register_architecture(Architecture("my_llama", "Llama under another name (a test's row)"))
    try:
        mine, llama = plan_for(str(folder), 4), plan_for(EXAMPLE, 4)
        assert mine.steps == llama.steps and mine.metadata["model"]["architecture"] == "my_llama"
        from shardload.frontdoor.tables import architectures_markdown, planner_help

        assert (
            "my_llama" in planner_help()
            and "| `my_llama` | Llama under" in architectures_markdown()
        )
    finally:
        unregister_architecture("my_llama")


# ---- a kind of session: one registered opener ----------------------------------------------------


def test_a_session_kind_is_one_registered_opener(tmp_path):
    (tmp_path / "kind_plugin.py").write_text(
        "from shardload import ThreadedSession\n"
        "from shardload.sessions.kinds import register_session_kind\n"
        "opened = []\n"
        "@register_session_kind('counted', 'threads, counted (a test plugin)', override=True)\n"
        "def open_counted(num_workers, *, device, plugins, timeout):\n"
        "    opened.append(num_workers)\n"
        "    return ThreadedSession(num_workers, device=device or 'cpu', timeout=timeout)\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        result = CliRunner().invoke(
            cli,
            [
                "load",
                "--shards",
                "2",
                "--session",
                "counted",
                "--plugin",
                "kind_plugin",
                "--json",
                EXAMPLE,
            ],
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["num_shards"] == 2
        assert sys.modules["kind_plugin"].opened == [2]
    finally:
        sys.path.remove(str(tmp_path))
        from shardload.sessions.kinds import unregister_session_kind

        unregister_session_kind("counted")
        sys.modules.pop("kind_plugin", None)


# ---- a shard function: one registration --------------------------------------------------------


def test_a_shard_function_is_one_registration():
    def rule(in_shape, in_dtype, *, num_shards):
        return (num_shards, in_shape[0] // num_shards, *in_shape[1:]), in_dtype

    def ranges(in_shape, in_dtype, *, num_shards, index):
        rows = in_shape[0] // num_shards
        return Selection(axis=0, ranges=((index * rows, rows),))

    @register_shard_func("tests.extending.rows", shape_rule=rule, ranges=ranges)
    def rows(input, output):
        output.copy_(input.reshape(output.shape))

    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    plan = {"x": [["tests.extending.rows", [["num_shards", "6 // num_shards", 4], "float32"]]]}
    with ThreadedSession(3) as sess:
        sharded = load_sharded({"x": x}, plan, sess, progress=False)
    for worker in range(3):
        assert np.array_equal(sharded.shard("x", worker).numpy(), x[2 * worker : 2 * worker + 2])
    assert sharded.stats.bytes_read_per_worker == [32, 32, 32]  # each read only its rows
