"""Mixtral, Qwen2-MoE and Qwen3-MoE as transformers itself writes them.

transformers 5 fuses a layer's experts in memory (``experts.gate_up_proj`` [E, 2 x inter,
hidden], ``experts.down_proj`` [E, hidden, inter]) but ``save_pretrained`` writes them back per
expert, as the hub's checkpoints are: ``experts.{e}.gate_proj/up_proj/down_proj`` (Qwen) and
``block_sparse_moe.experts.{e}.w1/w3/w2`` (Mixtral). ``test_transformers_saves_experts_per_expert``
pins that, so that a transformers that starts saving fused 3-D experts fails here first.

Each test saves a tiny random model (4 experts; Qwen2-MoE with a shared expert and its
``shared_expert_gate``; Qwen3-MoE with per-head q/k norms; the Qwen models with one dense layer
through ``mlp_only_layers``), plans and loads it over N workers, and compares every worker's every
tensor with a reference written here from the rules (``helpers.tp_reference``), not from the
planner: every expert's gate/up rows and down columns split like an MLP of
``moe_intermediate_size`` (Mixtral: ``intermediate_size``), the shared expert like one of
``shared_expert_intermediate_size``, the dense layer like one of ``intermediate_size``; routers
(``gate``) and ``shared_expert_gate`` replicated. Then each worker runs transformers' own MoE
block on its shards, with the same routing, and the sum is the whole block's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers.loads import plan_and_load
from helpers.moe_configs import CONFIGS, EXPERTS, HEADS, HIDDEN, KV_HEADS, mlp_sizes
from helpers.planner_checks import split_of
from helpers.tp_reference import padded_heads, padded_units, rows_of, take
from safetensors.torch import load_file, save_file

from shardload import FormatError
from shardload.planners import plan_for

UNPADDED = (1, 2, 4)
PADDED = 3  # 4 heads, 96/32/48/128-row MLPs over 3 workers: zero-padded

#: where each model keeps a layer's MoE block in the checkpoint, and its expert names
MOE = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def save_model(folder: Path, arch: str):
    config = CONFIGS[arch]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return config


def expected(name, w, n, i, config, padded=None):
    split = split_of(name, config)
    if split is None:
        return w
    axis, rows, units, replicable, kind = split
    if padded is None:
        index = rows_of(n, i, rows, units, replicable)
        return w[index] if axis == 0 else w[:, index]
    q_heads, kv_heads = padded_heads(HEADS, KV_HEADS, n)
    head_dim = rows // units
    worker_units = (
        {"q": q_heads, "kv": kv_heads}[kind][i] if kind in ("q", "kv") else padded_units(rows, n)[i]
    )
    return torch.from_numpy(
        take(w.numpy(), worker_units, 1 if kind not in ("q", "kv") else head_dim, axis)
    )


def test_transformers_saves_experts_per_expert(tmp_path):
    for arch, (block, (gate, up, down)) in MOE.items():
        config = save_model(tmp_path / arch, arch)
        shapes = {
            k: list(v.shape)
            for k, v in load_file(str(tmp_path / arch / "model.safetensors")).items()
        }
        inter = mlp_sizes(config)["experts"]
        for e in range(EXPERTS):
            prefix = f"model.layers.0.{block}.experts.{e}."
            assert shapes[prefix + gate + ".weight"] == [inter, HIDDEN], arch
            assert shapes[prefix + up + ".weight"] == [inter, HIDDEN], arch
            assert shapes[prefix + down + ".weight"] == [HIDDEN, inter], arch
        assert shapes[f"model.layers.0.{block}.gate.weight"] == [EXPERTS, HIDDEN]
        assert not any(len(s) == 3 for s in shapes.values()), arch  # nothing fused
        if arch == "qwen2_moe":
            assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == [1, HIDDEN]
            assert shapes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == [48, HIDDEN]
        if arch != "mixtral":  # mlp_only_layers=[1]: a dense MLP, no router
            assert shapes["model.layers.1.mlp.gate_proj.weight"] == [128, HIDDEN]
            assert "model.layers.1.mlp.gate.weight" not in shapes


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_shard_is_its_slice(tmp_path, arch):
    config = save_model(tmp_path, arch)
    dense = load_file(str(tmp_path / "model.safetensors"))
    routers = [k for k in dense if k.endswith((".gate.weight", "shared_expert_gate.weight"))]
    assert len(routers) == (1 if arch != "mixtral" else 2) + (arch == "qwen2_moe")
    for n in (*UNPADDED, PADDED):
        info, sharded = plan_and_load(tmp_path, n)
        padded = None
        if n == PADDED:
            layout = info.metadata["tensor_parallel"]
            assert (layout["q_heads"], layout["kv_heads"]) == padded_heads(HEADS, KV_HEADS, n)
            assert layout["mlp_block"] == 1
            assert layout["mlp_blocks"] == {
                str(size): padded_units(size, n) for size in mlp_sizes(config).values()
            }
            padded = True
        assert sorted(sharded.names) == sorted(dense)
        split = 0
        for i in range(n):
            worker = sharded.worker(i)
            for name, w in dense.items():
                want = expected(name, w, n, i, config, padded)
                assert torch.equal(worker[name], want), (arch, name, i, n)
                split += want.shape != w.shape
        for name in routers:
            assert all(torch.equal(sharded.shard(name, i), dense[name]) for i in range(n))
        if n > 1:  # every projection of every expert was split
            assert split >= sum(split_of(k, config) is not None for k in dense)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_moe_block_forward_equal_at_2_workers(tmp_path, arch):
    # each worker runs transformers' own sparse MoE block (loaded by from_pretrained from a
    # checkpoint of its shards, with the MLP sizes halved) on the same input: the router is
    # replicated, so every worker routes each token to the same experts with the same weights;
    # the experts' (and shared expert's) down projections are row-parallel, so the sum of the
    # workers' outputs (the all-reduce) is the whole block's
    n = 2
    config = save_model(tmp_path / "full", arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    _, sharded = plan_and_load(tmp_path / "full", n)
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    torch.manual_seed(1)
    x = torch.randn(1, 5, config.hidden_size)
    with torch.no_grad():
        want = model.model.layers[0].mlp(x)
        got = torch.zeros_like(want)
        for i in range(n):
            folder = tmp_path / f"worker{i}"
            folder.mkdir()
            config_json = json.loads((tmp_path / "full" / "config.json").read_text())
            for key in (
                "intermediate_size",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
            ):
                if config_json.get(key):
                    config_json[key] //= n
            (folder / "config.json").write_text(json.dumps(config_json))
            # attention is not under test: keep it whole so that the worker model loads
            weights = {
                k: (full[k] if ".self_attn." in k else v.contiguous())
                for k, v in sharded.worker(i).items()
            }
            save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
            part = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            got += part.model.layers[0].mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_sizes_the_experts_contradict_are_refused(tmp_path):
    save_model(tmp_path, "qwen2_moe")
    config = json.loads((tmp_path / "config.json").read_text())
    config["shared_expert_intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        FormatError,
        match=r"shared_expert\.(gate|up|down)_proj\.weight.*"
        r"'shared_expert_intermediate_size' = 64",
    ):
        plan_for(str(tmp_path))
