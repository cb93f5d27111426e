"""NVIDIA ModelOpt NVFP4 checkpoints (``quant_method: modelopt``, ``quant_algo: NVFP4``), written by
ModelOpt itself.

Each checkpoint is a tiny random model made by transformers (Llama; Phi-3 for the fused
``qkv_proj`` / ``gate_up_proj``; Qwen3-MoE, whose experts ModelOpt exports one tensor per
expert), quantized with ModelOpt's ``NVFP4_DEFAULT_CFG``, calibrated, and exported by its
``export_hf_checkpoint`` (``helpers.modelopt_tool``); nothing here writes a quantized tensor.
The exports are cached outside the repository (``cached_modelopt_nvfp4``: keyed by the ModelOpt
version and a hash of the config), so a machine makes them once.

For every worker and every quantized module, ModelOpt's own dequantizer
(``NVFP4QTensor.dequantize``) applied to the worker's ``weight`` / ``weight_scale`` /
``weight_scale_2`` must give exactly (bit for bit: it is elementwise, so slicing commutes with
it) that worker's slice of ModelOpt's dequantization of the whole module. The slice is written
here from the rules (``helpers.tp_reference``: rows for q, k, v, gate, up and each segment of a
fused one on its own, K for o and down; vLLM's GQA layout; zero padding of heads and of MLP
blocks of 16 rows, down_proj's K in whole groups), not from the planner, and is zero where
padded. ``weight_scale_2`` and ``input_scale`` are the stored scalars on every worker; every other
tensor (embeddings, lm_head, norms, routers) is the stored one, replicated. With expert
parallelism every expert's tensors are whole on the one worker a balanced contiguous assignment
gives it, and on no other. Heads narrower than a group are refused with the N that work (a
vocabulary N does not divide, when vocab-parallel, too); the planner reads
``hf_quant_config.json`` when config.json has no ``quantization_config`` (older exports); the
CLI names the format.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner
from helpers.loads import load_decision
from helpers.modelopt_configs import CONFIGS, EXPERTS, HEADS, HIDDEN, INTER, MOE_INTER, VOCAB
from helpers.modelopt_tool import cached_modelopt_nvfp4, dequantize_module
from helpers.planner_checks import check_padded_layout, expert_of
from helpers.tp_reference import expert_slots, layer_piece, padded_head_runs, padded_units, rows_of
from safetensors.torch import load_file

from shardload import ProcessSession, load_sharded
from shardload.cli import cli
from shardload.planners import plan_decision

GROUP = 16  # NVFP4: one E4M3 scale per 16 weights along K
#: the tensors ModelOpt writes per quantized linear
NVFP4_TENSORS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
PADDED = 3  # 4 query heads and 8 MLP blocks over 3 workers: zero-padded


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def export(name: str):
    """ModelOpt's export of ``CONFIGS[name]`` (made once per machine, then cached)."""
    return cached_modelopt_nvfp4(name, CONFIGS[name]())


# ---- the reference: which rows or columns of a module worker i holds -----------------------------


def segments(module: str, config) -> list:
    """[(rows, units, replicable, kind)] along the axis the module splits; each segment of a
    fused module (Phi-3's qkv_proj, gate_up_proj) on its own."""
    d = head_dim(config)
    q = (config.num_attention_heads * d, config.num_attention_heads, False, "q")
    kv = (config.num_key_value_heads * d, config.num_key_value_heads, True, "kv")
    inter = config.moe_intermediate_size if ".experts." in module else config.intermediate_size
    mlp = (inter, inter, False, "mlp")
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
    }[module.rsplit(".", 1)[1]]


def mlp_rows(inter: int, n: int) -> list[list[int]]:
    """Each worker's MLP rows for a zero-padded N (-1 a zero row): whole blocks of ``GROUP``
    rows, so that down_proj's K splits in whole scale groups."""
    return [
        [r for b in blocks for r in (range(b * GROUP, (b + 1) * GROUP) if b >= 0 else [-1] * GROUP)]
        for blocks in padded_units(inter // GROUP, n)
    ]


def heads_per_run(config) -> int:
    """The fewest heads that fill whole ``GROUP``-element scale groups of o_proj's K: they pad
    together (``padded_head_runs``)."""
    return math.lcm(head_dim(config), GROUP) // head_dim(config)


def expected(module: str, full: torch.Tensor, n: int, i: int, config, padded: bool) -> torch.Tensor:
    """Worker i's piece of a module's dequantized weight ``full``."""
    axis = 1 if module.endswith(("o_proj", "down_proj")) else 0
    segs = segments(module, config)
    layout = None
    if padded:
        q, kv = padded_head_runs(
            config.num_attention_heads, config.num_key_value_heads, n, heads_per_run(config)
        )
        mlp = [s for s in segs if s[3] == "mlp"]
        layout = q, kv, mlp_rows(mlp[0][0], n) if mlp else None
    return layer_piece(full, axis, segs, n, i, head_dim(config), layout)


def balanced(experts: int, n: int) -> list[list[int]]:
    """Contiguous experts per worker, the first ``experts % n`` workers taking one more."""
    return [[e for e in held if e >= 0] for held in expert_slots(experts, n)]


def check_every_worker(folder, config, decision, sharded, owners=None, vocab_parallel=False) -> int:
    """Every worker's every tensor against ModelOpt's dequantization and the rules; ``owners``
    (expert -> worker) for expert parallelism. Returns the quantized modules checked."""
    n = decision.num_shards
    stored = load_file(str(folder / "model.safetensors"))
    assert sorted(sharded.names) == sorted(stored)
    modules = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")})
    padded = decision.kind == "padded"
    for module in modules:
        full = dequantize_module(stored, module)
        expert = expert_of(module)
        for i in range(n):
            if owners is not None and expert is not None:  # whole, on its worker alone
                for name in (f"{module}.{s}" for s in NVFP4_TENSORS):
                    assert sharded.holds(name, i) == (i == owners[expert]), (name, i, n)
                    if i == owners[expert]:
                        assert torch.equal(sharded.shard(name, i), stored[name]), (name, i)
                continue
            shards = {
                f"{module}.{s}": sharded.shard(f"{module}.{s}", i)
                for s in ("weight", "weight_scale", "weight_scale_2")
            }
            got = dequantize_module(shards, module)
            assert torch.equal(got, expected(module, full, n, i, config, padded)), (module, i, n)
            for name in (f"{module}.weight_scale_2", f"{module}.input_scale"):
                assert torch.equal(sharded.shard(name, i), stored[name]), (name, i)  # 0-d
    vocab = ("lm_head.weight", "model.embed_tokens.weight") if vocab_parallel else ()
    for name in stored:
        if name.rsplit(".", 1)[0] in modules:
            continue
        for i in range(n):
            want = (
                stored[name][rows_of(n, i, VOCAB, VOCAB, False)] if name in vocab else stored[name]
            )
            assert torch.equal(sharded.shard(name, i), want), (name, i, n)
    return len(modules)


def check_layout(decision, config, mlp_sizes) -> None:
    """The padded plan's record of each worker's heads and MLP blocks: the rule's."""
    n = decision.num_shards
    heads = padded_head_runs(
        config.num_attention_heads, config.num_key_value_heads, n, heads_per_run(config)
    )
    blocks = {size: padded_units(size // GROUP, n) for size in mlp_sizes}
    check_padded_layout(decision, heads, blocks, block=GROUP)


def dense_shape(module: str, config) -> tuple[int, int]:
    """[N, K] of a module's dense weight."""
    q, kv = (
        config.num_attention_heads * head_dim(config),
        config.num_key_value_heads * head_dim(config),
    )
    hidden = config.hidden_size
    inter = config.moe_intermediate_size if ".experts." in module else config.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "qkv_proj": (q + 2 * kv, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "gate_up_proj": (2 * inter, hidden),
    }[module.rsplit(".", 1)[1]]


# ---- what ModelOpt writes ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_what_modelopt_writes(name):
    # pins the format the planner's rules are for: a ModelOpt that writes another fails here
    folder, config = export(name), CONFIGS[name]()
    stored = load_file(str(folder / "model.safetensors"))
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["quant_algo"]) == ("modelopt", "NVFP4")
    side = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert (side["quant_algo"], side["group_size"]) == ("NVFP4", GROUP)
    modules = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")})
    per_layer = {"llama": 7, "llama_narrow_heads": 7, "phi3": 4, "qwen3_moe": 4 + 3 * EXPERTS}[name]
    assert len(modules) == per_layer * config.num_hidden_layers
    for module in modules:
        rows, k = dense_shape(module, config)
        assert stored[f"{module}.weight"].dtype == torch.uint8
        assert stored[f"{module}.weight"].shape == (rows, k // 2), module
        assert stored[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert stored[f"{module}.weight_scale"].shape == (rows, k // GROUP), module
        for scalar in ("weight_scale_2", "input_scale"):
            assert stored[f"{module}.{scalar}"].shape == (), (module, scalar)
            assert stored[f"{module}.{scalar}"].dtype == torch.float32, (module, scalar)
    # unquantized: float weights, no scales
    floats = ["lm_head", "model.embed_tokens"]
    if name == "qwen3_moe":  # and the routers; the experts one tensor each, gate and up apart
        floats += [f"model.layers.{layer}.mlp.gate" for layer in range(2)]
        assert not any(t.dim() > 2 for t in stored.values())
        assert {
            (m.split(".")[2], expert_of(m), m.rsplit(".", 1)[1])
            for m in modules
            if ".experts." in m
        } == {
            (str(layer), e, p)
            for layer in range(2)
            for e in range(EXPERTS)
            for p in ("gate_proj", "up_proj", "down_proj")
        }
    for module in floats:
        assert stored[f"{module}.weight"].dtype == torch.float32
        assert f"{module}.weight_scale" not in stored


# ---- tensor parallel: every worker, every quantized module ---------------------------------------


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_every_worker_dequantizes_to_its_slice(arch):
    folder, config = export(arch), CONFIGS[arch]()
    for n, kind in ((1, "unpadded"), (2, "unpadded"), (4, "unpadded"), (PADDED, "padded")):
        decision = plan_decision(str(folder), n)
        assert decision.kind == kind, n
        assert "modelopt-nvfp4 4-bit group 16" in str(decision.summary)
        if kind == "padded":
            check_layout(decision, config, [INTER])
        else:
            assert "tensor_parallel" not in decision.shard_info().metadata
        sharded = load_decision(folder, decision)
        assert check_every_worker(folder, config, decision, sharded) == (4 if arch == "phi3" else 7)
        if kind == "padded":
            check_last_worker_is_padded_with_zeros(sharded, arch)


def check_last_worker_is_padded_with_zeros(sharded, arch: str) -> None:
    """Zero where padded, in zero bytes (an E4M3 zero byte is +0): the last of 3 workers holds
    no heads (2 zero query heads, 1 zero KV head) and MLP blocks 6, 7 and a zero one."""
    last = {name: sharded.shard(name, PADDED - 1) for name in sharded.names}
    attention = ["qkv_proj"] if arch == "phi3" else [f"{p}_proj" for p in "qkvo"]
    for module in (f"model.layers.0.self_attn.{a}" for a in attention):
        assert last[f"{module}.weight"].numel() and not last[f"{module}.weight"].any(), module
        assert not last[f"{module}.weight_scale"].view(torch.uint8).any(), module
    down = "model.layers.0.mlp.down_proj"
    assert last[f"{down}.weight"].shape == (HIDDEN, 3 * GROUP // 2)
    assert not last[f"{down}.weight"][:, -GROUP // 2 :].any()
    assert not last[f"{down}.weight_scale"][:, -1].view(torch.uint8).any()
    assert last[f"{down}.weight"][:, : -GROUP // 2].any()


def test_qwen3_moe_experts_split_like_an_mlp_of_32_rows():
    # 32-row experts are 2 blocks of 16 (down_proj's K in 2 scale groups): N=4 would cut a
    # group, so the plan for N=4 zero-pads whole blocks instead (workers 2 and 3 hold zero
    # expert rows), exactly; attention divides as it is
    folder, config = export("qwen3_moe"), CONFIGS["qwen3_moe"]()
    for n, kind in ((1, "unpadded"), (2, "unpadded"), (4, "padded")):
        decision = plan_decision(str(folder), n)
        assert decision.kind == kind, n
        if kind == "padded":
            check_layout(decision, config, [MOE_INTER])
            assert decision.shard_info().metadata["tensor_parallel"]["mlp_blocks"] == {
                "32": [[0], [1], [-1], [-1]]
            }
        sharded = load_decision(folder, decision)
        assert check_every_worker(folder, config, decision, sharded) == 2 * (4 + 3 * EXPERTS)
    expert = "model.layers.1.mlp.experts.2"
    for i in (2, 3):
        assert not sharded.shard(f"{expert}.gate_proj.weight", i).any()
        assert not sharded.shard(f"{expert}.down_proj.weight", i).any()
        assert sharded.shard(f"{expert}.down_proj.weight", i).shape == (HIDDEN, GROUP // 2)


# ---- expert parallel: each expert whole on one worker --------------------------------------------


@pytest.mark.parametrize(
    "n, processes",
    [(2, False), (3, False), (4, False), pytest.param(3, True, marks=pytest.mark.slow)],
    ids=["2", "3", "4", "3-processes"],
)
def test_qwen3_moe_expert_parallel_places_whole_experts(n, processes):
    folder, config = export("qwen3_moe"), CONFIGS["qwen3_moe"]()
    decision = plan_decision(str(folder), n, experts="ep")
    assert decision.kind == ("padded" if HEADS % n else "unpadded")  # the heads, not experts
    plan = decision.shard_info()
    workers = balanced(EXPERTS, n)
    width = max(map(len, workers))
    assert plan.metadata["experts"]["experts_per_worker"] == {
        str(EXPERTS): [w + [-1] * (width - len(w)) for w in workers]
    }
    owners = {e: w for w, held in enumerate(workers) for e in held}
    stored = load_file(str(folder / "model.safetensors"))
    assert plan.placement.params == {
        name: (owners[expert_of(name.rsplit(".", 1)[0])],) for name in stored if ".experts." in name
    }
    assert len(plan.placement.params) == 2 * EXPERTS * 3 * len(NVFP4_TENSORS)
    if decision.kind == "padded":  # the attention's heads; no MLP is split
        check_layout(decision, config, [])
    if not processes:
        sharded = load_decision(folder, decision)
        assert check_every_worker(folder, config, decision, sharded, owners) == 2 * (
            4 + 3 * EXPERTS
        )
        return
    with ProcessSession(n) as session:  # shards stay in the workers: check them there
        sharded = load_sharded(str(folder), decision.validated, session, progress=False)
        assert check_every_worker(folder, config, decision, sharded, owners) == 2 * (
            4 + 3 * EXPERTS
        )
        name = "model.layers.0.mlp.experts.0.down_proj.weight_scale"
        with pytest.raises(KeyError, match="places it on"):
            sharded.shard(name, n - 1)


# ---- refusals ------------------------------------------------------------------------------------


def test_heads_narrower_than_a_group_pad_in_pairs():
    # 4 heads of 8 elements: o_proj's K is 2 groups of 16, two heads each. 3 and 4 workers
    # would cut the groups: the heads pad in pairs (2 query and 1 KV pair, laid out as heads
    # twice as wide), each worker's dequantized weights exactly its padded piece. Without
    # padding, those N are refused naming the groups.
    folder, config = export("llama_narrow_heads"), CONFIGS["llama_narrow_heads"]()
    assert heads_per_run(config) == 2
    for n in (3, 4):
        decision = plan_decision(str(folder), n)
        assert decision.kind == "padded", n
        check_layout(decision, config, [config.intermediate_size])
        assert check_every_worker(folder, config, decision, load_decision(folder, decision)) == 7
        refused = plan_decision(str(folder), n, pad=False)
        assert refused.kind == "refused" and refused.validated is None, n
        message = str(refused.error)
        assert "N that work (up to 64): 1, 2" in message, message
    message = str(plan_decision(str(folder), 4, pad=False).error)
    assert "the 4 query heads ('num_attention_heads' = 4), stored in 2 blocks of 16" in message
    decision = plan_decision(str(folder), 2)
    assert decision.kind == "unpadded"
    assert check_every_worker(folder, config, decision, load_decision(folder, decision)) == 7


def test_vocab_parallel_splits_the_float_lm_head_and_never_pads_it():
    # lm_head and the embeddings stay float in ModelOpt's export: vocab-parallel splits their
    # rows like a dense weight, for N that divide the vocabulary (96) only
    folder, config = export("llama"), CONFIGS["llama"]()
    decision = plan_decision(str(folder), 4, vocab_parallel=True)
    assert decision.kind == "unpadded"
    sharded = load_decision(folder, decision)
    assert check_every_worker(folder, config, decision, sharded, vocab_parallel=True) == 7
    refused = plan_decision(str(folder), 5, vocab_parallel=True)
    assert refused.kind == "refused"
    message = str(refused.error)
    assert "the 96 vocabulary rows ('vocab_size' = 96) do not divide among 5 workers" in message
    assert "the vocabulary is split evenly, never padded" in message
    assert plan_decision(str(folder), 5).kind == "padded"  # replicated: heads padded


# ---- older exports: hf_quant_config.json only ----------------------------------------------------


@pytest.mark.parametrize(
    "arch, cases",
    [
        ("llama", [(2, "tp"), (PADDED, "tp")]),
        ("phi3", [(PADDED, "tp")]),
        ("qwen3_moe", [(4, "tp"), (3, "ep")]),
        ("llama_narrow_heads", [(4, "tp")]),
    ],
)
def test_hf_quant_config_alone_gives_the_same_plan(tmp_path, arch, cases):
    folder = export(arch)
    old = tmp_path / arch
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    del config["quantization_config"]
    (old / "config.json").write_text(json.dumps(config))
    for n, experts in cases:
        new, was = (plan_decision(str(f), n, experts=experts) for f in (folder, old))
        assert was.kind == new.kind, (n, experts)
        assert was.summary.scheme == new.summary.scheme
        assert was.summary.scheme.source == str(old / "hf_quant_config.json")
        assert new.summary.scheme.source == str(folder / "config.json")
        if new.kind == "refused":
            # the same refusal; only hf_quant_config.json has a group_size key to name
            assert "('quantization_config.group_size' = 16)" in str(
                was.error
            ) and "group_size'" not in str(new.error)
            assert str(was.error).replace(str(old), "F").replace(
                " ('quantization_config.group_size' = 16)", ""
            ) == str(new.error).replace(str(folder), "F")
        else:
            assert was.shard_info().to_dict() == new.shard_info().to_dict(), (n, experts)


# ---- the command line ----------------------------------------------------------------------------


def test_cli_plan_names_the_format():
    folder = export("phi3")
    result = CliRunner().invoke(cli, ["plan", "--shards", "2", str(folder)])
    assert result.exit_code == 0, result.output
    assert "modelopt-nvfp4 4-bit group 16" in result.stderr, result.stderr
    assert "valid for N in 1, 2, 4" in result.stderr
    steps = json.loads(result.stdout)
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" in steps
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_2" not in steps  # replicated
    result = CliRunner().invoke(
        cli, ["plan", "--shards", "4", "--no-pad", str(export("llama_narrow_heads"))]
    )
    assert result.exit_code == 2 and "N that work (up to 64): 1, 2" in result.output
