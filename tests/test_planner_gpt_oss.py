"""gpt-oss, bf16 as transformers saves it and MXFP4 as openai/gpt-oss-20b is published.

gpt-oss keeps a layer's experts fused: ``mlp.experts.gate_up_proj`` [E, H, 2I] (gate and up
interleaved along the last dim: gate = ``[..., ::2]``, up = ``[..., 1::2]``),
``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; the MXFP4
checkpoint stores the two weights as ``*_blocks`` uint8 [E, rows, K/32, 16] and ``*_scales``
[E, rows, K/32] (rows = outputs: 2I for gate_up, H for down). Attention has biases on q/k/v/o and
one learned ``sinks`` logit per query head.

Two module-scoped checkpoints: a bf16 one (transformers' ``save_pretrained`` of a random
``from_config`` model, intermediate 64, biases and norms randomised so that a mis-sharded one
shows) and an MXFP4 one (``helpers.gpt_oss_tool``: transformers + compressed-tensors,
intermediate 96 = three 32-groups, so N=2 and N=4 need MLP zero-padding and N=3 pads only the
heads). Each test plans and loads them over N workers and compares every worker's every tensor
with a reference written here from the rules (``helpers.tp_reference`` and ``pick``), never from
the planner's output:

* tensor parallel: MLP row j of an expert is gate_up rows 2j and 2j+1 and down_proj's K index j;
  worker i holds a contiguous block of MLP rows of every expert (or, zero-padded, the blocks of
  ``padded_units``, 32 rows each for MXFP4 so that no 32-group of down_proj's K is cut, -1 a
  zero block); ``down_proj_bias``, ``o_proj.bias``, router, norms, embeddings replicated; q rows,
  q bias and sinks by whole query heads, k/v rows and biases by KV heads (replicated to 2 workers
  each at N=4), o_proj columns by query heads; zero-padded heads (``padded_heads``) at N=3;
* expert parallel: every stacked expert tensor split along dim 0 in whole experts, contiguous and
  balanced, the shorter workers padded with zero slots.

Beyond the bytes: transformers' own MXFP4 dequantizer (``dequantize``) applied to each worker's
blocks and scales gives that worker's slice of the whole dequantized weight; transformers' own
``GptOssExperts`` run on each worker's pieces (same routing, ``down_proj_bias`` on worker 0
only) sum to the whole module's output; transformers itself loads the MXFP4 folder to the same
dequantized weights (so the checkpoint is what transformers reads); and the CLI plans and loads
it.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.cli_runs import invoke_ok
from helpers.gpt_oss_tool import (
    dequantize,
    load_with_transformers,
    tiny_config,
    write_gpt_oss_mxfp4,
)
from helpers.loads import decided_load
from helpers.planner_checks import check_padded_layout
from helpers.tp_reference import expert_slots, padded_heads, padded_units, rows_of, take
from safetensors.torch import load_file
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from shardload import ProcessSession, ThreadedSession

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, EXPERTS, LAYERS = 4, 2, 16, 64, 4, 2
BF16_INTER, MXFP4_INTER, GROUP = 64, 96, 32
TP_SHARDS = (1, 2, 4, 3)
EP_SHARDS = (1, 2, 3, 4, 8)


# ---- the checkpoints -----------------------------------------------------------------------------


def write_bf16(folder, config) -> None:
    """transformers' ``save_pretrained`` of a random ``from_config`` gpt-oss in bf16, biases and
    norms randomised (init leaves them 0 and 1) as ``write_gpt_oss_mxfp4`` does."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
    model.to(torch.bfloat16).save_pretrained(folder)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """(folder, config, stored tensors) of the bf16 checkpoint."""
    folder = tmp_path_factory.mktemp("gpt_oss_bf16")
    config = tiny_config(intermediate_size=BF16_INTER)
    write_bf16(folder, config)
    return folder, config, load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(folder, config, stored tensors) of the MXFP4 checkpoint."""
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    config = tiny_config(intermediate_size=MXFP4_INTER)
    write_gpt_oss_mxfp4(folder, config, seed=0)
    return folder, config, load_file(str(folder / "model.safetensors"))


# ---- the reference: worker i's piece, from the rules ---------------------------------------------


def pick(w: torch.Tensor, units: list[int], size: int, dim: int) -> torch.Tensor:
    """``tp_reference.take`` on a torch tensor: the ``size``-wide units along ``dim`` a worker
    holds, -1 a zero unit (bf16, which numpy lacks, goes through its int16 bits: +0.0 is 0)."""
    bits = w.view(torch.int16) if w.dtype == torch.bfloat16 else w
    out = torch.from_numpy(take(bits.numpy(), units, size, dim))
    return out.view(torch.bfloat16) if w.dtype == torch.bfloat16 else out


def units_of(n: int, i: int, inter: int, padded: bool, block: int):
    """(query heads, KV heads, MLP blocks, rows per MLP block) worker i holds. Unpadded: an
    even split (``rows_of``: KV heads replicated when the workers outnumber them), the MLP as
    one block of ``inter / n`` rows; zero-padded: ``padded_heads`` and ``padded_units`` of
    ``block``-row MLP blocks."""
    if padded:
        q_heads, kv_heads = padded_heads(HEADS, KV_HEADS, n)
        return q_heads[i], kv_heads[i], padded_units(inter // block, n)[i], block
    q, kv = rows_of(n, i, HEADS, HEADS, False), rows_of(n, i, KV_HEADS, KV_HEADS, True)
    return list(range(q.start, q.stop)), list(range(kv.start, kv.stop)), [i], inter // n


def expected(name: str, w: torch.Tensor, units, slots=None) -> torch.Tensor:
    """Worker's piece of the stored tensor ``name``: ``units`` from ``units_of``; ``slots``:
    the worker's experts under expert parallelism (None: tensor parallel)."""
    q, kv, mlp, rows = units
    module, leaf = name.split(".")[-2:]
    if module in ("q_proj", "k_proj", "v_proj"):
        return pick(w, q if module == "q_proj" else kv, HEAD_DIM, 0)  # weight and bias
    if module == "o_proj":
        return pick(w, q, HEAD_DIM, 1) if leaf == "weight" else w  # bias added once
    if leaf == "sinks":
        return pick(w, q, 1, 0)
    if module != "experts":
        return w  # router, norms, embeddings, lm_head
    if slots is not None:
        return pick(w, slots, 1, 0)  # whole experts along dim 0
    if leaf == "gate_up_proj":  # [E, H, 2I]: MLP row j = columns 2j, 2j+1
        return pick(w, mlp, 2 * rows, 2)
    if leaf.startswith("gate_up_proj_"):  # bias [E, 2I], blocks/scales [E, 2I, ...]
        return pick(w, mlp, 2 * rows, 1)
    if leaf == "down_proj":  # [E, I, H]
        return pick(w, mlp, rows, 1)
    if leaf in ("down_proj_blocks", "down_proj_scales"):  # [E, H, I/32, ...]: whole groups
        assert rows % GROUP == 0
        return pick(w, mlp, rows // GROUP, 2)
    assert leaf == "down_proj_bias"
    return w  # added once, after the row-parallel sum


def check_every_piece(sharded, stored: dict, n: int, unit_of, slots=None) -> int:
    """Every worker's every tensor equals its expected piece exactly; returns how many pieces
    were smaller than the stored tensor (split) or zero-filled."""
    assert sorted(sharded.names) == sorted(stored)
    changed = 0
    for i in range(n):
        worker = sharded.worker(i)
        assert sorted(worker) == sorted(stored)
        for name, w in stored.items():
            want = expected(name, w, unit_of(i), None if slots is None else slots[i])
            got = worker[name]
            assert got.dtype == want.dtype and got.shape == want.shape, (name, i, n, got.shape)
            assert torch.equal(got, want), (name, i, n)
            changed += not torch.equal(want, w) if want.shape == w.shape else 1
    return changed


def check_layout(decision, n: int, inter: int, block: int) -> None:
    """The padded plan's record at N: the rule's heads and ``inter``'s ``block``-row blocks."""
    heads = padded_heads(HEADS, KV_HEADS, n)
    blocks = {inter: padded_units(inter // block, n)}
    check_padded_layout(decision, heads, blocks, block=block, head_dim=HEAD_DIM)


def expert_names(stored: dict) -> list[str]:
    return [k for k in stored if ".mlp.experts." in k]


# ---- tensor parallel -----------------------------------------------------------------------------


def test_bf16_tensor_parallel_every_piece(bf16):
    """bf16 at N = 1, 2, 4 (unpadded: 4 workers replicate each KV head to 2) and 3 (heads
    zero-padded; 64 one-row MLP blocks as ``padded_units(64, 3)``): every worker's every tensor
    is exactly its slice by the rules, gate_up in whole interleaved (gate, up) pairs."""
    folder, _, stored = bf16
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        EXPERTS,
        HIDDEN,
        2 * BF16_INTER,
    )
    assert stored["model.layers.0.mlp.experts.down_proj"].shape == (EXPERTS, BF16_INTER, HIDDEN)
    assert stored["model.layers.0.self_attn.sinks"].shape == (HEADS,)
    assert all(w.dtype == torch.bfloat16 for w in stored.values())
    for n in TP_SHARDS:
        with decided_load(folder, n) as (decision, sharded):
            padded = HEADS % n != 0
            assert decision.kind == ("padded" if padded else "unpadded"), n
            if padded:
                check_layout(decision, n, BF16_INTER, 1)
            else:
                assert "tensor_parallel" not in decision.shard_info().metadata
            changed = check_every_piece(
                sharded,
                stored,
                n,
                lambda i, n=n, padded=padded: units_of(n, i, BF16_INTER, padded, 1),
            )
            if n > 1:  # per layer: q/k/v weight+bias, o weight, sinks, gate_up w+bias, down
                assert changed >= n * LAYERS * 10


def test_mxfp4_tensor_parallel_bytes_and_dequantized(mxfp4):
    """MXFP4, intermediate 96 = 3 groups of 32, at N = 1 (unpadded), 2 and 4 (MLP zero-padded in
    32-row blocks, ``padded_units(3, N)``), 3 (heads padded, MLP whole groups): the raw
    blocks/scales bytes are the expected slices (zero blocks zero bytes), and transformers'
    dequantizer of each worker's blocks and scales is that worker's slice of the whole
    dequantized weight (zero where padded)."""
    folder, _, stored = mxfp4
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (
        EXPERTS,
        2 * MXFP4_INTER,
        HIDDEN // GROUP,
        16,
    )
    assert stored["model.layers.0.mlp.experts.down_proj_scales"].shape == (
        EXPERTS,
        HIDDEN,
        MXFP4_INTER // GROUP,
    )
    full = {
        f"{layer}.{proj}": dequantize(
            stored[f"{layer}.{proj}_blocks"], stored[f"{layer}.{proj}_scales"]
        )
        for layer in (f"model.layers.{k}.mlp.experts" for k in range(LAYERS))
        for proj in ("gate_up_proj", "down_proj")
    }
    for n in TP_SHARDS:
        with decided_load(folder, n) as (decision, sharded):
            padded = n != 1
            assert decision.kind == ("padded" if padded else "unpadded"), n
            if padded:
                check_layout(decision, n, MXFP4_INTER, GROUP)
            unit_of = lambda i, n=n, padded=padded: units_of(n, i, MXFP4_INTER, padded, GROUP)  # noqa: E731
            check_every_piece(sharded, stored, n, unit_of)
            for i in range(n):
                _, _, mlp, rows = unit_of(i)
                for name, whole in full.items():
                    got = dequantize(
                        sharded.shard(name + "_blocks", i), sharded.shard(name + "_scales", i)
                    )
                    # [E, K, rows]: gate_up's rows (2 per MLP row) last, down's K in dim 1
                    want = (
                        pick(whole, mlp, 2 * rows, 2)
                        if name.endswith("gate_up_proj")
                        else pick(whole, mlp, rows, 1)
                    )
                    assert torch.equal(got, want), (name, i, n)  # zero blocks: zeros


# ---- expert parallel -----------------------------------------------------------------------------


def check_expert_parallel(folder, stored, n, session_class=ThreadedSession) -> None:
    with decided_load(folder, n, experts="ep", session_class=session_class) as (decision, sharded):
        slots = expert_slots(EXPERTS, n)
        assert sorted(e for held in slots for e in held if e >= 0) == list(range(EXPERTS))
        metadata = decision.shard_info().metadata
        assert metadata["experts"] == {
            "mode": "ep",
            "num_shards": n,
            "experts_per_worker": {str(EXPERTS): slots},
        }
        padded = HEADS % n != 0  # attention as in TP: 4 query heads over 3 or 8 padded
        assert decision.kind == ("padded" if padded else "unpadded"), n
        if padded:
            layout = metadata["tensor_parallel"]
            assert (layout["q_heads"], layout["kv_heads"]) == padded_heads(HEADS, KV_HEADS, n)
        check_every_piece(
            sharded, stored, n, lambda i: units_of(n, i, MXFP4_INTER, padded, GROUP), slots=slots
        )
        for i in range(n):  # spelled out: whole experts byte for byte, zero slots all zero
            for name in expert_names(stored):
                piece = sharded.shard(name, i)
                for slot, e in enumerate(slots[i]):
                    want = stored[name][e] if e >= 0 else torch.zeros_like(stored[name][0])
                    assert torch.equal(piece[slot], want), (name, i, n, e)


def test_mxfp4_expert_parallel(mxfp4):
    """EP at N = 1, 2, 3, 4, 8 on the MXFP4 checkpoint (4 experts): every stacked expert tensor
    (blocks, scales, biases) gives each worker its whole experts, contiguous and balanced, as
    the plan's ``experts_per_worker`` records; zero slots are zero; attention split as in TP
    (padded heads at 3 and 8), routers replicated."""
    folder, _, stored = mxfp4
    assert len(expert_names(stored)) == LAYERS * 6
    for n in EP_SHARDS:
        check_expert_parallel(folder, stored, n)


@pytest.mark.slow
def test_mxfp4_expert_parallel_process_session(mxfp4):
    """The same EP load at N=3 (one worker with a zero slot, padded heads) through worker
    processes gives the same pieces."""
    folder, _, stored = mxfp4
    check_expert_parallel(folder, stored, 3, session_class=ProcessSession)


# ---- forward: transformers' GptOssExperts on each worker's pieces --------------------------------


def experts_module(config, inter: int, weights: dict) -> GptOssExperts:
    """transformers' ``GptOssExperts`` of MLP width ``inter``, float32, with ``weights``."""
    module = GptOssExperts(
        tiny_config(
            intermediate_size=inter,
            swiglu_limit=config.swiglu_limit,
            swiglu_alpha=config.swiglu_alpha,
        )
    ).eval()
    with torch.no_grad():
        for key, value in weights.items():
            getattr(module, key).copy_(value)
    return module


def expert_weights(get, mxfp4: bool) -> dict:
    """Layer 0's expert parameters in transformers' in-memory orientation, float32; ``get``
    maps a stored leaf name to its tensor."""
    if mxfp4:
        w = {
            proj: dequantize(get(proj + "_blocks"), get(proj + "_scales"))
            for proj in ("gate_up_proj", "down_proj")
        }
    else:
        w = {proj: get(proj).float() for proj in ("gate_up_proj", "down_proj")}
    return {
        **w,
        "gate_up_proj_bias": get("gate_up_proj_bias").float(),
        "down_proj_bias": get("down_proj_bias").float(),
    }


@pytest.mark.parametrize("which,n", [("bf16", 2), ("mxfp4", 2), ("mxfp4", 4)])
def test_experts_forward_sums_to_whole(request, which, n):
    """Each worker runs transformers' own ``GptOssExperts`` (width = its MLP rows, zero blocks
    included) on its pieces with the same routing (the replicated router's top-k), down_proj's
    bias on worker 0 only: the sum over workers is the whole module's output. With MXFP4 at
    N=2 and N=4 the zero-padded blocks contribute nothing (the worker holding only a zero block
    outputs exactly 0)."""
    folder, config, stored = request.getfixturevalue(which)
    prefix = "model.layers.0.mlp."
    with decided_load(folder, n) as (decision, sharded):
        torch.manual_seed(1)
        x = torch.randn(9, HIDDEN)
        router = GptOssTopKRouter(config)
        with torch.no_grad():
            router.weight.copy_(sharded.shard(prefix + "router.weight", 0).float())
            router.bias.copy_(sharded.shard(prefix + "router.bias", 0).float())
            _, scores, indices = router(x)
            assert indices.unique().numel() > 1
            whole = experts_module(
                config,
                config.intermediate_size,
                expert_weights(lambda leaf: stored[prefix + "experts." + leaf], which == "mxfp4"),
            )
            want = whole(x, indices, scores)
            got = torch.zeros_like(want)
            for i in range(n):
                weights = expert_weights(
                    lambda leaf, i=i: sharded.shard(prefix + "experts." + leaf, i), which == "mxfp4"
                )
                if i:
                    weights["down_proj_bias"] = torch.zeros_like(weights["down_proj_bias"])
                inter = weights["down_proj"].shape[1]
                part = experts_module(config, inter, weights)(x, indices, scores)
                if decision.kind == "padded":
                    blocks = decision.shard_info().metadata["tensor_parallel"]["mlp_blocks"]
                    if all(b == -1 for b in blocks[str(config.intermediate_size)][i]):
                        assert torch.equal(part, torch.zeros_like(part)), (which, n, i)
                got += part
        assert want.abs().max() > 0.01
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---- the checkpoint is what transformers reads ---------------------------------------------------


def test_transformers_reads_the_mxfp4_checkpoint(mxfp4):
    """transformers loads the MXFP4 folder (``Mxfp4Config(dequantize=True)``) to experts equal
    to ``dequantize`` of the stored blocks/scales (``[E, rows, K/32, 16]`` -> in-memory
    ``[E, K, rows]``: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]), and to the stored
    biases and sinks: the reference the other tests dequantize with is the one transformers
    uses."""
    folder, _, stored = mxfp4
    model = load_with_transformers(folder)
    for k in range(LAYERS):
        layer = model.model.layers[k]
        experts, prefix = layer.mlp.experts, f"model.layers.{k}."
        for proj in ("gate_up_proj", "down_proj"):
            want = dequantize(
                stored[f"{prefix}mlp.experts.{proj}_blocks"],
                stored[f"{prefix}mlp.experts.{proj}_scales"],
            )
            got = getattr(experts, proj).detach()
            assert got.shape == (
                want.shape[0],
                *((HIDDEN, 2 * MXFP4_INTER) if proj == "gate_up_proj" else (MXFP4_INTER, HIDDEN)),
            )
            assert torch.equal(got, want), (k, proj)
            bias = getattr(experts, proj + "_bias").detach()
            assert torch.equal(bias, stored[f"{prefix}mlp.experts.{proj}_bias"].float())
        assert torch.equal(
            layer.self_attn.sinks.detach(), stored[f"{prefix}self_attn.sinks"].float()
        )


# ---- command line --------------------------------------------------------------------------------


def test_cli_plan_and_load(mxfp4):
    """``shardload plan --shards 4`` prints the padded TP plan (take_units of 32-row blocks for
    the experts, the 4th a zero block) and ``--experts ep`` the EP plan (split along the experts
    for every stacked tensor); ``shardload load --shards 3 --experts ep --json`` loads it."""
    folder, _, stored = mxfp4
    experts = expert_names(stored)

    plan = json.loads(invoke_ok("plan", "--shards", 4, folder).stdout)
    assert plan["__metadata__"]["tensor_parallel"]["mlp_blocks"] == {
        str(MXFP4_INTER): padded_units(MXFP4_INTER // GROUP, 4)
    }
    for name in experts:
        if name.endswith("down_proj_bias"):
            assert name not in plan  # replicated
        else:
            assert [step[0] for step in plan[name]] == ["shardload.take_units"], name
    assert plan["model.layers.0.self_attn.sinks"][0][0] == "shardload.take_units"

    plan = json.loads(invoke_ok("plan", "--shards", 4, "--experts", "ep", folder).stdout)
    assert plan["__metadata__"]["experts"]["experts_per_worker"] == {
        str(EXPERTS): expert_slots(EXPERTS, 4)
    }
    for name in experts:
        assert [step[0] for step in plan[name]] == ["shardload.split"], name
    assert plan["model.layers.0.self_attn.q_proj.weight"][0][0] == "shardload.split_segments"

    report = json.loads(
        invoke_ok("load", "--shards", 3, "--experts", "ep", folder, "--json").stdout
    )
    assert report["num_shards"] == 3 and len(report["workers"]) == 3
    assert all(w["tensors"] == len(stored) for w in report["workers"])
