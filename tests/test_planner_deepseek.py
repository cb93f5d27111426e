"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, MLA), as transformers saves them and,
for V3, in DeepSeek's block FP8 as transformers' own FP8 quantizer writes it.

MLA compresses the hidden state into latents that every head shares, then expands them per head:
``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (V3; V2 with ``q_lora_rank=None`` has one
``q_proj``) gives each query head ``qk_nope + qk_rope`` rows; ``kv_a_proj_with_mqa`` ->
``kv_a_layernorm`` -> ``kv_b_proj`` gives each head its own key (``qk_nope``) and value
(``v_head_dim``) rows, so there is one KV head per query head and no GQA; ``o_proj`` takes
``v_head_dim`` columns per head. So, written here from those rules and never from the planner's
output (``helpers.tp_reference``): the latent projections, their norms, routers (and V3's
``e_score_correction_bias``), norms, embeddings and lm_head are replicated; ``q_proj`` /
``q_b_proj`` split in whole heads of 24 rows, ``kv_b_proj`` in whole heads of 32 rows, ``o_proj``
in whole heads of 16 columns; the dense MLP (96), every routed expert (32) and the shared experts
(32) split their gate/up rows and down columns evenly; at N=3 the heads are zero-padded
(``padded_heads``) and the MLP rows too (``padded_units``, one-row blocks).

The tiny models (4 heads, 4 routed experts + 1 shared, layer 0 dense and layer 1 MoE) are saved
once per module by ``save_pretrained`` of a random ``from_config`` model, their norms and V3's
router bias randomised (init leaves them 1 and 0) so that a mixed-up replicated tensor shows.

What is proven, and how:

* tensor parallel (N = 1, 2, 4, padded 3; one N also through worker processes): every worker's
  every tensor equals its expected piece exactly, and each worker's kept and read bytes are the
  bytes of those pieces (zero padding kept, never read);
* the MLA split computes the right thing: each worker runs transformers' own
  ``DeepseekV3Attention`` / ``DeepseekV2Attention``, built for its head count (zero heads
  included), on its pieces; the sum of the workers' outputs (the all-reduce after the
  row-parallel ``o_proj``) is the whole attention's output, at N=2 and padded N=3. Likewise
  transformers' MoE block of layer 1 at N=2, tensor parallel (every expert halved) and expert
  parallel (whole experts, the others zero), with the same replicated router;
* block FP8 (``helpers.deepseek_fp8_tool``, transformers' ``FineGrainedFP8Config``): 8 heads of
  qk_nope 64 + qk_rope 128 = 192 rows are 12 blocks of 128 in ``q_b_proj`` and ``kv_b_proj``; a
  head straddles blocks, two heads fill three, so workers take pairs of heads: N = 1, 2, 4 load
  (every ``weight`` and ``weight_scale_inv`` piece exact, and transformers' dequantizer of each
  worker's pieces is that worker's slice of the whole dequantized weight); at N = 3 and 8 the
  pairs are zero-padded (``padded_head_runs``) and each worker's dequantized weights are its
  padded piece;
* expert parallel (N = 1, 2, 3, 4, 8): each routed expert's tensors are held whole by the one
  worker of a contiguous balanced assignment computed here (the first E % N workers take one more
  expert), as ``__metadata__.experts`` records; the other workers do not hold them (``holds``
  false, ``shard`` raises KeyError); shared experts, dense MLP and attention split as in TP;
* the command line plans (TP and EP) and loads an EP plan.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers
from helpers.cli_runs import invoke_ok
from helpers.deepseek_configs import (
    EXPERTS,
    FP8_HEADS,
    FP8_HIDDEN,
    FP8_INTER,
    FP8_MOE_INTER,
    FP8_NOPE,
    FP8_ROPE,
    FP8_V,
    HEADS,
    HIDDEN,
    INTER,
    KV_LORA,
    MOE_INTER,
    NOPE,
    Q_LORA,
    ROPE,
    SHARED,
    V_DIM,
    fp8_config,
    tiny_config,
)
from helpers.deepseek_fp8_tool import DEEPSEEK_QUANT_CONFIG, dequantize, write_deepseek_fp8
from helpers.loads import decided_load
from helpers.planner_checks import check_padded_layout, expert_of
from helpers.tp_reference import (
    expert_slots,
    layer_piece,
    padded_head_runs,
    padded_heads,
    padded_units,
    rows_of,
    take,
)
from safetensors.torch import load_file
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2_modeling
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3_modeling

from shardload import ProcessSession, ThreadedSession
from shardload.planners import plan_decision

QK, KV_B = NOPE + ROPE, NOPE + V_DIM  # a query head's rows (24), a kv_b head's rows (32)
TP_SHARDS = (1, 2, 4, 3)  # 3: 4 heads and 32/96-row MLPs zero-padded
EP_SHARDS = (1, 2, 3, 4, 8)
BLOCK = 128  # block FP8: 128 x 128 scale blocks


def write_tiny(folder, version: str):
    """``save_pretrained`` of a random float32 model, norms ~ N(1, 0.1) and V3's router bias
    ~ N(0, 0.01) (small enough that the router still picks every expert group); returns its
    config."""
    config = tiny_config(version)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.01)
    model.save_pretrained(folder)
    return config


def _tiny(tmp_path_factory, version):
    folder = tmp_path_factory.mktemp(f"deepseek_{version}")
    config = write_tiny(folder, version)
    return folder, config, load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(folder, config, stored tensors) of the tiny DeepSeek-V3."""
    return _tiny(tmp_path_factory, "v3")


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    """(folder, config, stored tensors) of the tiny DeepSeek-V2 without q_lora."""
    return _tiny(tmp_path_factory, "v2")


# ---- the reference: worker i's piece, from the rules ---------------------------------------------


def split_of(name: str):
    """(axis, rows, units, rows per unit, kind) of a tensor's split, or None: replicated."""
    module = name.rsplit(".", 2)[-2]
    if module in ("q_proj", "q_b_proj"):
        return 0, HEADS * QK, HEADS, QK, "q"
    if module == "kv_b_proj":  # one key-and-value head per query head: the query heads'
        return 0, HEADS * KV_B, HEADS, KV_B, "q"
    if module == "o_proj":
        return 1, HEADS * V_DIM, HEADS, V_DIM, "q"
    if module in ("gate_proj", "up_proj", "down_proj"):
        rows = (
            MOE_INTER * SHARED
            if ".shared_experts." in name
            else MOE_INTER
            if ".experts." in name
            else INTER
        )
        return (1 if module == "down_proj" else 0), rows, rows, 1, "mlp"
    return None  # q_a_proj, kv_a_proj_with_mqa, their norms, routers, norms, embeddings


def is_routed(name: str) -> bool:
    return ".mlp.experts." in name


def expected(name: str, w: torch.Tensor, n: int, i: int, padded: bool) -> torch.Tensor:
    """Worker i's tensor-parallel piece of the stored tensor ``name``."""
    split = split_of(name)
    if split is None:
        return w
    axis, rows, units, width, kind = split
    layout = None
    if padded:
        q_heads, kv_heads = padded_heads(HEADS, HEADS, n)
        layout = q_heads, kv_heads, padded_units(rows, n)
    return layer_piece(w, axis, [(rows, units, False, kind)], n, i, width, layout)


def read_bytes(name: str, w: torch.Tensor, n: int, i: int, padded: bool) -> int:
    """The bytes of worker i's piece that come from the file (zero units are not read): the
    piece of an all-ones tensor counts them."""
    return int(expected(name, torch.ones_like(w), n, i, padded).count_nonzero()) * w.element_size()


def padded_layout(n: int) -> tuple:
    """The rule's padded layout at N: (heads, MLP blocks by size), ``check_padded_layout``'s."""
    sizes = (INTER, MOE_INTER * SHARED)
    return padded_heads(HEADS, HEADS, n), {size: padded_units(size, n) for size in sizes}


# ---- the checkpoints are what the rules above assume ---------------------------------------------


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_transformers_writes_mla_as_assumed(request, version):
    """The stored names and shapes the rules are written for: per-expert tensors, q_b_proj
    [heads x 24, q_lora] (V3) or q_proj [heads x 24, hidden] (V2), kv_b_proj [heads x 32,
    kv_lora], o_proj [hidden, heads x 16], kv_a_proj_with_mqa [kv_lora + rope, hidden]."""
    _, _, stored = request.getfixturevalue(version)
    shapes = {k: tuple(v.shape) for k, v in stored.items()}
    attn = "model.layers.0.self_attn."
    if version == "v3":
        assert shapes[attn + "q_a_proj.weight"] == (Q_LORA, HIDDEN)
        assert shapes[attn + "q_b_proj.weight"] == (HEADS * QK, Q_LORA)
        assert attn + "q_proj.weight" not in shapes
        assert shapes["model.layers.1.mlp.gate.e_score_correction_bias"] == (EXPERTS,)
    else:
        assert shapes[attn + "q_proj.weight"] == (HEADS * QK, HIDDEN)
        assert not any("q_a_proj" in k or "q_b_proj" in k for k in shapes)
    assert shapes[attn + "kv_a_proj_with_mqa.weight"] == (KV_LORA + ROPE, HIDDEN)
    assert shapes[attn + "kv_b_proj.weight"] == (HEADS * KV_B, KV_LORA)
    assert shapes[attn + "o_proj.weight"] == (HIDDEN, HEADS * V_DIM)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (INTER, HIDDEN)
    for e in range(EXPERTS):
        assert shapes[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] == (HIDDEN, MOE_INTER)
    assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (
        MOE_INTER * SHARED,
        HIDDEN,
    )
    assert not any(len(s) == 3 for s in shapes.values())  # no fused experts
    norms = [v for k, v in stored.items() if k.endswith("norm.weight")]
    assert norms and all(not torch.equal(v, torch.ones_like(v)) for v in norms)


# ---- A. tensor parallel: every worker, every tensor ----------------------------------------------


def check_tensor_parallel(folder, stored, n: int, session_class=ThreadedSession) -> None:
    with decided_load(folder, n, session_class=session_class) as (decision, sharded):
        padded = HEADS % n != 0
        assert decision.kind == ("padded" if padded else "unpadded"), n
        assert decision.shard_info().placement is None
        if padded:
            check_padded_layout(decision, *padded_layout(n))
        else:
            assert "tensor_parallel" not in decision.shard_info().metadata
        assert sorted(sharded.names) == sorted(stored)
        split = 0
        for i in range(n):
            worker = sharded.worker(i)
            assert sorted(worker) == sorted(stored)
            for name, w in stored.items():
                want = expected(name, w, n, i, padded)
                got = worker[name]
                assert got.dtype == want.dtype and got.shape == want.shape, (name, i, n)
                assert torch.equal(got, want), (name, i, n)
                split += want.shape != w.shape
            assert sharded.stats.bytes_per_worker[i] == sum(
                expected(k, w, n, i, padded).nbytes for k, w in stored.items()
            ), (i, n)
            assert sharded.stats.bytes_read_per_worker[i] == sum(
                read_bytes(k, w, n, i, padded) for k, w in stored.items()
            ), (i, n)
        if n > 1:  # every projection of attention, dense MLP, experts, shared experts
            assert split == n * sum(split_of(k) is not None for k in stored)


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_tensor_parallel_every_piece(request, version):
    """N = 1, 2, 4 (unpadded) and 3 (4 heads as [[0, 1], [2, 3], [zero, zero]]; 96 and 32 MLP
    rows as ``padded_units``): every worker's every tensor is exactly its piece by the MLA
    rules; the latent projections, their norms and the routers are whole on every worker; the
    bytes each worker keeps and reads are those of its pieces (zero padding is not read)."""
    folder, _, stored = request.getfixturevalue(version)
    for n in TP_SHARDS:
        check_tensor_parallel(folder, stored, n)


@pytest.mark.slow
def test_tensor_parallel_process_session(v3):
    """The padded N=3 load through worker processes gives the same pieces."""
    folder, _, stored = v3
    check_tensor_parallel(folder, stored, 3, session_class=ProcessSession)


# ---- B. forward: transformers' own MLA attention and MoE block on each worker's pieces -----------

MODELING = {
    "v3": (
        v3_modeling.DeepseekV3Attention,
        v3_modeling.DeepseekV3RotaryEmbedding,
        v3_modeling.DeepseekV3MoE,
        v3_modeling.DeepseekV3MLP,
    ),
    "v2": (
        v2_modeling.DeepseekV2Attention,
        v2_modeling.DeepseekV2RotaryEmbedding,
        v2_modeling.DeepseekV2Moe,
        v2_modeling.DeepseekV2MLP,
    ),
}
ATTENTION = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)


def attention_module(version: str, config, heads: int, get):
    """transformers' MLA attention of layer 0 with ``heads`` heads (one KV head each), eager,
    float32; ``get(module)`` gives that module's weight."""
    config = copy.deepcopy(config)
    config.num_attention_heads = config.num_key_value_heads = heads
    config._attn_implementation = "eager"
    module = MODELING[version][0](config, layer_idx=0).eval()
    state = {
        f"{m}.weight": get(m).float() for m in ATTENTION if getattr(module, m, None) is not None
    }
    module.load_state_dict(state, strict=True)
    return module


def run_attention(version: str, module, x, position_embeddings, mask):
    with torch.no_grad():
        if version == "v3":
            return module(x, position_embeddings=position_embeddings, attention_mask=mask)[0]
        return module(x, attention_mask=mask, position_embeddings=position_embeddings)[0]


def attention_inputs(version: str, config, hidden: int, seq: int = 7):
    """(x, the rotary embedding the model computes for positions 0..seq-1, a causal mask)."""
    torch.manual_seed(1)
    x = torch.randn(2, seq, hidden)
    positions = torch.arange(seq)[None].expand(2, -1)
    with torch.no_grad():
        position_embeddings = MODELING[version][1](config)(x, positions)
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    return x, position_embeddings, mask


@pytest.mark.parametrize("version,n", [("v3", 2), ("v3", 3), ("v2", 2), ("v2", 3)])
def test_mla_attention_forward_sums_to_whole(request, version, n):
    """Each worker runs transformers' own MLA attention (``DeepseekV3Attention`` /
    ``DeepseekV2Attention``) built for its head count, zero-padded heads included (at N=3 every
    worker has 2, worker 2 only zero heads), on its pieces of layer 0: the replicated latents and
    norms, its q_b_proj / q_proj heads, kv_b_proj heads, o_proj columns. The sum of the outputs
    is the whole attention's output, and the worker holding only zero heads outputs 0."""
    folder, config, stored = request.getfixturevalue(version)
    prefix = "model.layers.0.self_attn."
    x, position_embeddings, mask = attention_inputs(version, config, HIDDEN)
    whole = attention_module(version, config, HEADS, lambda m: stored[f"{prefix}{m}.weight"])
    want = run_attention(version, whole, x, position_embeddings, mask)
    zero_workers = 0
    with decided_load(folder, n) as (decision, sharded):
        got = torch.zeros_like(want)
        for i in range(n):
            piece = sharded.worker(i)
            heads = piece[prefix + "o_proj.weight"].shape[1] // V_DIM
            part = run_attention(
                version,
                attention_module(
                    version, config, heads, lambda m, piece=piece: piece[f"{prefix}{m}.weight"]
                ),
                x,
                position_embeddings,
                mask,
            )
            if decision.kind == "padded" and all(
                h == -1 for h in decision.shard_info().metadata["tensor_parallel"]["q_heads"][i]
            ):
                assert torch.equal(part, torch.zeros_like(part)), (version, n, i)
                zero_workers += 1
            got += part
    assert zero_workers == (n == 3)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def moe_module(version: str, config, experts: dict, shared: dict, router: dict):
    """transformers' MoE block (float32) with ``experts`` {e: (gate, up, down)}, every one the
    same width (a missing expert is zero), ``shared`` {gate/up/down: weight} and ``router``."""
    moe_cls, mlp_cls = MODELING[version][2], MODELING[version][3]
    width = next(iter(experts.values()))[0].shape[0]
    config = copy.deepcopy(config)
    config.moe_intermediate_size = width
    module = moe_cls(config).eval()
    module.shared_experts = mlp_cls(config=config, intermediate_size=shared["gate"].shape[0])
    zero = torch.zeros(width, HIDDEN)
    gate_up = [
        torch.cat(experts[e][:2]) if e in experts else torch.cat([zero, zero])
        for e in range(EXPERTS)
    ]
    down = [experts[e][2] if e in experts else zero.T for e in range(EXPERTS)]
    state = {
        "experts.gate_up_proj": torch.stack(gate_up),
        "experts.down_proj": torch.stack(down),
        **{f"shared_experts.{p}_proj.weight": shared[p] for p in ("gate", "up", "down")},
        **{f"gate.{k}": v for k, v in router.items()},
    }
    module.load_state_dict(state, strict=True)
    return module


MOE = "model.layers.1.mlp."


def moe_weights(get, held):
    """(routed experts, shared experts) of layer 1 from ``get(stored name)``, for the routed
    experts ``held``."""
    projections = ("gate", "up", "down")
    experts = {
        e: tuple(get(f"{MOE}experts.{e}.{p}_proj.weight") for p in projections) for e in held
    }
    shared = {p: get(f"{MOE}shared_experts.{p}_proj.weight") for p in projections}
    return experts, shared


@pytest.mark.parametrize("version,experts", [("v3", "tp"), ("v3", "ep"), ("v2", "tp")])
def test_moe_block_forward_sums_to_whole_at_2_workers(request, version, experts):
    """Each worker runs transformers' own MoE block of layer 1 (``DeepseekV3MoE`` /
    ``DeepseekV2Moe``) on its pieces with the same replicated router (so the same routing):
    tensor parallel, every expert and the shared expert 16 rows wide; expert parallel, its two
    whole experts (the other two zero) and half the shared expert. The sum is the whole block's
    output."""
    folder, config, stored = request.getfixturevalue(version)
    n = 2
    torch.manual_seed(2)
    x = torch.randn(3, 5, HIDDEN)
    routed, shared = moe_weights(stored.__getitem__, range(EXPERTS))
    router = {k[len(MOE + "gate.") :]: v for k, v in stored.items() if k.startswith(MOE + "gate.")}
    assert sorted(router) == (
        ["e_score_correction_bias", "weight"] if version == "v3" else ["weight"]
    )
    whole = moe_module(version, config, routed, shared, router)
    with torch.no_grad():
        want = whole(x)
        _, _, indices = whole.gate(x)
    assert indices.unique().numel() == EXPERTS  # every expert is used, on both workers
    with decided_load(folder, n, experts=experts) as (decision, sharded):
        slots = expert_slots(EXPERTS, n) if experts == "ep" else [range(EXPERTS)] * n
        got = torch.zeros_like(want)
        for i in range(n):
            routed_i, shared_i = moe_weights(lambda k, i=i: sharded.shard(k, i), slots[i])
            router_i = {k: sharded.shard(MOE + "gate." + k, i) for k in router}
            with torch.no_grad():
                got += moe_module(version, config, routed_i, shared_i, router_i)(x)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---- C. block FP8, written by transformers' own quantizer ----------------------------------------

FP8_QK, FP8_KV_B = FP8_NOPE + FP8_ROPE, FP8_NOPE + FP8_V  # 192 and 192 rows a head
FP8_SHARDS, FP8_PADDED = (1, 2, 4), (3, 8)


@pytest.fixture(scope="module")
def fp8_written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_v3_fp8")
    config = fp8_config()
    write_deepseek_fp8(folder, config)
    return folder, config


@pytest.fixture(scope="module", params=["transformers", "deepseek"])
def fp8(request, tmp_path_factory, fp8_written):
    """(folder, config, stored tensors): the checkpoint with transformers' quantization_config,
    and a copy with DeepSeek's own four fields (what deepseek-ai/DeepSeek-V3 ships)."""
    folder, config = fp8_written
    if request.param == "deepseek":
        copied = tmp_path_factory.mktemp("deepseek_v3_fp8_ds_config")
        for item in folder.iterdir():
            shutil.copy(item, copied / item.name)
        written = json.loads((copied / "config.json").read_text())
        written["quantization_config"] = dict(DEEPSEEK_QUANT_CONFIG)
        (copied / "config.json").write_text(json.dumps(written, indent=2) + "\n")
        folder = copied
    return folder, config, load_file(str(folder / "model.safetensors"))


def fp8_split(name: str):
    """(axis, logical size, units) of an FP8 checkpoint tensor's split (``weight`` and its
    ``weight_scale_inv`` alike), or None: replicated."""
    module = name.rsplit(".", 2)[-2]
    if module == "q_b_proj":
        return 0, FP8_HEADS * FP8_QK, FP8_HEADS
    if module == "kv_b_proj":
        return 0, FP8_HEADS * FP8_KV_B, FP8_HEADS
    if module == "o_proj":
        return 1, FP8_HEADS * FP8_V, FP8_HEADS
    if module in ("gate_proj", "up_proj", "down_proj"):
        rows = FP8_INTER if ".layers.0." in name else FP8_MOE_INTER
        return (1 if module == "down_proj" else 0), rows, rows
    return None


def fp8_expected(name: str, w: torch.Tensor, n: int, i: int) -> torch.Tensor:
    """Worker i's piece of a stored tensor, or of a whole dequantized weight: whole heads (an
    even split of rows, N dividing the heads) or MLP rows; of a ``weight_scale_inv``, the
    128-blocks of those rows, which must start and end on blocks."""
    split = fp8_split(name)
    if split is None:
        return w
    axis, size, units = split
    rows = rows_of(n, i, size, units, False)
    if name.endswith(".weight_scale_inv"):
        assert rows.start % BLOCK == 0 and rows.stop % BLOCK == 0, (name, n, i)
        return w.narrow(axis, rows.start // BLOCK, (rows.stop - rows.start) // BLOCK)
    return w.narrow(axis, rows.start, rows.stop - rows.start)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (float8 through its bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def test_fp8_checkpoint_straddles_blocks(fp8):
    """The premise: q_b_proj and kv_b_proj are 8 heads of 192 rows = 12 blocks of 128 (a head
    is 1.5 blocks, two heads three), stored float8 with a [12, K/128] scale grid; o_proj's
    128-column heads are whole blocks."""
    _, _, stored = fp8
    attn = "model.layers.0.self_attn."
    for module, k in (("q_b_proj", 256), ("kv_b_proj", 256)):
        assert stored[f"{attn}{module}.weight"].shape == (FP8_HEADS * 192, k)
        assert stored[f"{attn}{module}.weight"].dtype == torch.float8_e4m3fn
        assert stored[f"{attn}{module}.weight_scale_inv"].shape == (12, k // BLOCK)
    assert stored[attn + "o_proj.weight_scale_inv"].shape == (FP8_HIDDEN // BLOCK, 8)
    assert 192 % BLOCK and (2 * 192) % BLOCK == 0
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_fp8_every_piece_and_dequantized(fp8):
    """N = 1, 2, 4: every worker's every tensor is exactly its piece (float8 weights and float32
    scale grids alike, replicated ones whole), and transformers' block dequantizer of each
    worker's weight and scales is that worker's slice of the whole dequantized weight, for every
    quantized tensor of every worker."""
    folder, _, stored = fp8
    quantized = [k[: -len("_scale_inv")] for k in stored if k.endswith(".weight_scale_inv")]
    assert len(quantized) == 2 * 5 + 3 + 3 * (EXPERTS + 1)  # attention x2, dense, experts, shared
    whole = {k: dequantize(stored[k], stored[k + "_scale_inv"]) for k in quantized}
    for n in FP8_SHARDS:
        with decided_load(folder, n) as (decision, sharded):
            assert decision.kind == "unpadded", n
            split = 0
            for i in range(n):
                worker = sharded.worker(i)
                assert sorted(worker) == sorted(stored)
                for name, w in stored.items():
                    want = fp8_expected(name, w, n, i)
                    assert same(worker[name], want), (name, i, n)
                    split += want.shape != w.shape
                for name in quantized:
                    got = dequantize(worker[name], worker[name + "_scale_inv"])
                    assert torch.equal(got, fp8_expected(name, whole[name], n, i)), (name, i, n)
            if n > 1:
                assert split == n * sum(fp8_split(k) is not None for k in stored)


def test_fp8_attention_forward_sums_to_whole_at_4_workers(fp8):
    """At N=4 (each worker a pair of heads, 3 scale blocks of q_b_proj and kv_b_proj), each
    worker's dequantized layer-0 attention run by transformers' ``DeepseekV3Attention`` with 2
    heads sums to the whole dequantized attention's output."""
    folder, config, stored = fp8
    prefix = "model.layers.0.self_attn."

    def weights(get):
        def weight(m):
            name = f"{prefix}{m}.weight"
            w = get(name)
            return (
                dequantize(w, get(name + "_scale_inv"))
                if w.dtype == torch.float8_e4m3fn
                else w.float()
            )

        return weight

    x, position_embeddings, mask = attention_inputs("v3", config, FP8_HIDDEN)
    want = run_attention(
        "v3",
        attention_module("v3", config, FP8_HEADS, weights(stored.__getitem__)),
        x,
        position_embeddings,
        mask,
    )
    n = 4
    with decided_load(folder, n) as (_, sharded):
        got = torch.zeros_like(want)
        for i in range(n):
            module = attention_module(
                "v3", config, FP8_HEADS // n, weights(lambda k, i=i: sharded.shard(k, i))
            )
            got += run_attention("v3", module, x, position_embeddings, mask)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("experts", ["tp", "ep"])
def test_fp8_heads_straddling_blocks_pad_in_pairs_at_3_and_8(fp8, experts):
    """N=3 and N=8 split neither the 4 pairs of heads (two heads fill three whole blocks) nor,
    at 8, the MLPs' blocks: the pairs are zero-padded (``padded_head_runs``: the layout of 4
    heads twice as wide, each unfolded into its pair), the MLPs in whole blocks (expert
    parallel too: attention stays tensor-parallel). Every worker's block dequantization of
    every quantized tensor is its padded piece of the whole dequantized weight: its real
    heads' rows, zeros for zero heads and blocks."""
    folder, _, stored = fp8
    quantized = [k[: -len("_scale_inv")] for k in stored if k.endswith(".weight_scale_inv")]
    whole = {k: dequantize(stored[k], stored[k + "_scale_inv"]) for k in quantized}
    for n in FP8_PADDED:
        q_heads, _ = padded_head_runs(FP8_HEADS, FP8_HEADS, n, 2)
        with decided_load(folder, n, experts=experts) as (decision, sharded):
            assert decision.kind == "padded", n
            layout = decision.info.metadata["tensor_parallel"]
            assert layout["q_heads"] == q_heads, n
            checked = 0
            for i in range(n):
                worker = sharded.worker(i)
                for name in quantized:
                    split = fp8_split(name)
                    if split is None or (experts == "ep" and is_routed(name)):
                        continue
                    axis, size, units = split
                    if units == FP8_HEADS:
                        held, unit = q_heads[i], size // FP8_HEADS
                    else:
                        held, unit = padded_units(size // BLOCK, n)[i], BLOCK
                    want = torch.from_numpy(take(whole[name].numpy(), held, unit, axis))
                    got = dequantize(worker[name], worker[name + "_scale_inv"])
                    assert torch.equal(got, want), (name, i, n)
                    checked += 1
            assert checked >= n * 2 * 3, n  # q_b, kv_b and o_proj of 2 layers at least


def test_fp8_expert_parallel(fp8):
    """EP at N = 2 and 4 on block FP8: each routed expert's float8 ``weight`` and its
    ``weight_scale_inv`` are held whole, together, by the expert's one worker; everything
    else is its tensor-parallel piece."""
    folder, _, stored = fp8
    for n in (2, 4):
        slots = expert_slots(EXPERTS, n)
        owner = {e: w for w, held in enumerate(slots) for e in held if e >= 0}
        with decided_load(folder, n, experts="ep") as (decision, sharded):
            assert decision.kind == "unpadded"
            assert decision.shard_info().metadata["experts"]["experts_per_worker"] == {
                str(EXPERTS): slots
            }
            for i in range(n):
                worker = sharded.worker(i)
                assert sorted(worker) == sorted(
                    k for k in stored if not is_routed(k) or owner[expert_of(k)] == i
                )
                for name, piece in worker.items():
                    want = (
                        stored[name] if is_routed(name) else fp8_expected(name, stored[name], n, i)
                    )
                    assert same(piece, want), (name, i, n)


def test_fp8_one_block_of_k_columns(tmp_path_factory):
    """A block-FP8 layer whose input is one 128-block wide (kv_b_proj with kv_lora_rank=128,
    as the tool's own ``tiny_v3_config`` has) has a [N/128, 1] scale grid; it plans like any
    other block-FP8 layer."""
    folder = tmp_path_factory.mktemp("deepseek_v3_fp8_k128")
    config = fp8_config()
    config.kv_lora_rank = 128  # kv_a_proj_with_mqa: 128 + 128 rows; kv_b_proj K = 128
    write_deepseek_fp8(folder, config)
    stored = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    assert stored[name].shape == (12, 1)
    assert plan_decision(str(folder), 2).kind == "unpadded"
    with decided_load(folder, 2) as (_, sharded):  # whole heads: the grid's rows, halved
        for i in range(2):
            assert same(sharded.shard(name, i), stored[name][6 * i : 6 * (i + 1)])


# ---- D. expert parallel --------------------------------------------------------------------------


def check_expert_parallel(folder, stored, n: int, session_class=ThreadedSession) -> dict:
    """Every piece under EP at N; returns the bytes read per worker."""
    slots = expert_slots(EXPERTS, n)
    assert sorted(e for held in slots for e in held if e >= 0) == list(range(EXPERTS))
    owner = {e: w for w, held in enumerate(slots) for e in held if e >= 0}
    with decided_load(folder, n, experts="ep", session_class=session_class) as (decision, sharded):
        info = decision.shard_info()
        assert info.metadata["experts"] == {
            "mode": "ep",
            "num_shards": n,
            "experts_per_worker": {str(EXPERTS): slots},
        }
        padded = HEADS % n != 0  # 4 heads over 3 or 8: attention and MLPs padded as in TP
        assert decision.kind == ("padded" if padded else "unpadded"), n
        if padded:
            check_padded_layout(decision, *padded_layout(n))
        routed = [k for k in stored if is_routed(k)]
        assert len(routed) == 3 * EXPERTS
        assert info.placement is not None and info.placement.num_shards == n
        assert {k: tuple(v) for k, v in info.placement.params.items()} == {
            k: (owner[expert_of(k)],) for k in routed
        }
        for i in range(n):
            held = sorted(k for k in stored if not is_routed(k) or owner[expert_of(k)] == i)
            assert sorted(sharded.worker(i)) == held
            for name, w in stored.items():
                if is_routed(name):
                    mine = owner[expert_of(name)] == i
                    assert sharded.holds(name, i) == mine, (name, i, n)
                    if mine:
                        assert torch.equal(sharded.shard(name, i), w), (name, i, n)
                    else:
                        with pytest.raises(KeyError):
                            sharded.shard(name, i)
                    continue
                assert sharded.holds(name, i)
                assert torch.equal(sharded.shard(name, i), expected(name, w, n, i, padded)), (
                    name,
                    i,
                    n,
                )
            assert sharded.stats.bytes_per_worker[i] == sum(
                w.nbytes if is_routed(k) else expected(k, w, n, i, padded).nbytes
                for k, w in stored.items()
                if k in held
            ), (i, n)
            assert sharded.stats.bytes_read_per_worker[i] == sum(
                w.nbytes if is_routed(k) else read_bytes(k, w, n, i, padded)
                for k, w in stored.items()
                if k in held
            ), (i, n)
        return list(sharded.stats.bytes_read_per_worker)


def test_planner_experts(v3):
    """EP at N = 1, 2, 3, 4, 8 (4 experts: [[0..3]], [[0, 1], [2, 3]], [[0, 1], [2, -1],
    [3, -1]], one each, and four workers with none): every routed expert's tensors are on
    their one worker, whole, and nowhere else; everything else is its TP piece; bytes kept and
    read are those pieces'. Each routed byte is read once in all, so the workers together read
    what TP's read (padding rows of TP are not read); EP only moves where: at N=3 worker 0
    reads more than under TP (two whole experts against 4/3), at N=8 workers 4..7 read less."""
    folder, _, stored = v3
    for n in EP_SHARDS:
        ep = check_expert_parallel(folder, stored, n)
        with decided_load(folder, n) as (_, sharded):
            tp = list(sharded.stats.bytes_read_per_worker)
        assert sum(ep) == sum(tp), (n, ep, tp)
        if EXPERTS % n == 0:  # whole experts or slices: the same bytes per worker
            assert ep == tp, (n, ep, tp)


@pytest.mark.slow
def test_expert_parallel_process_session(v3):
    """The EP load at N=3 (uneven: 2, 1, 1 experts; padded attention) through worker processes:
    the same placement, pieces and KeyErrors."""
    folder, _, stored = v3
    check_expert_parallel(folder, stored, 3, session_class=ProcessSession)


# ---- E. command line -----------------------------------------------------------------------------


def test_cli_plan_and_load(v3):
    """``shardload plan --shards 2`` prints the TP plan (MLA heads split in their own widths)
    and a summary naming MLA; ``--experts ep`` the EP plan (whole experts placed on one worker
    each); ``shardload load --shards 3 --experts ep --json`` loads it: worker 0 holds its two
    experts' tensors more than the others."""
    folder, _, stored = v3
    result = invoke_ok("plan", "--shards", 2, folder)
    plan = json.loads(result.stdout)
    assert "MLA" in result.stderr and "4 MLA heads of 24 (values 16)" in result.stderr
    assert "valid for N in 1, 2, 4" in result.stderr
    for name in stored:
        assert (name in plan) == (split_of(name) is not None), name

    result = invoke_ok("plan", "--shards", 2, "--experts", "ep", folder)
    plan = json.loads(result.stdout)
    assert plan["__metadata__"]["experts"]["experts_per_worker"] == {
        str(EXPERTS): expert_slots(EXPERTS, 2)
    }
    assert "placed whole on one worker" in result.stderr and "MLA" in result.stderr
    for name in stored:
        assert (name in plan) == (split_of(name) is not None and not is_routed(name)), name

    report = json.loads(
        invoke_ok("load", "--shards", 3, "--experts", "ep", folder, "--json").stdout
    )
    assert report["num_shards"] == 3 and len(report["workers"]) == 3
    others = len(stored) - 3 * EXPERTS
    assert [w["tensors"] for w in report["workers"]] == [others + 6, others + 3, others + 3]
