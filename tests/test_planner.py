"""The planner, proven on every format: for each format, bit width, split axis and N in
{1, 2, 3, 4, 8} that the model allows, every worker's shard dequantizes to exactly its slice of
the dequantized full weight, ``dequant(shard_i(Q)) == shard_i(dequant(Q))``, bit for bit.

The checkpoints are tiny Llama/Mixtral models written by ``helpers.quantized_models`` with the
reference codecs in ``helpers.quant_refs`` (written from the formats' definitions, independently
of shardload); which N are valid is worked out here from head counts and block sizes,
independently of the planner.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers.quant_refs.compressed_tensors import dequantize_fp8, quantize_fp8
from helpers.quantized_models import (
    GPTQ,
    GQA,
    MQA,
    OTHERS,
    PLAIN,
    THREE,
    WIDE,
    Geometry,
    Model,
    awq,
    ct_act_order,
    fp8,
    gptq,
    pack_quantized,
    write_model,
)
from helpers.tp_reference import padded_head_runs, padded_units, rows_of, take
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shardload import PlanError, ThreadedSession, load_sharded, open_checkpoint
from shardload.planners import plan_decision, plan_for, valid_num_shards

NS = (1, 2, 3, 4, 8)


# ---- what each worker must hold ------------------------------------------------------------------


def expected_piece(model: Model, module: str, n: int, i: int) -> np.ndarray:
    g, w = model.geometry, model.full[module]
    role = module.rsplit(".", 1)[1]
    if role in ("o_proj", "down_proj", "w2"):
        return np.split(w, n, axis=1)[i]
    if role in ("q_proj",):
        segments = [(g.q, g.heads, False)]
    elif role in ("k_proj", "v_proj"):
        segments = [(g.kv, g.kv_heads, True)]
    elif role == "qkv_proj":
        segments = [(g.q, g.heads, False), (g.kv, g.kv_heads, True), (g.kv, g.kv_heads, True)]
    elif role == "gate_up_proj":
        segments = [(g.inter, g.inter, False)] * 2
    else:  # gate_proj, up_proj, w1, w3
        segments = [(g.inter, g.inter, False)]
    pieces, start = [], 0
    for size, units, replicable in segments:
        rows = rows_of(n, i, size, units, replicable)
        pieces.append(w[start : start + size][rows])
        start += size
    return np.concatenate(pieces)


def expected_valid(model: Model) -> list[int]:
    """The N (of NS) this model allows, from its heads and the format's block sizes."""
    g, f = model.geometry, model.fmt
    valid = []
    for n in NS:
        ok = g.heads % n == 0 and (g.kv_heads % n == 0 or n % g.kv_heads == 0)
        kv_rows = g.kv // min(n, g.kv_heads)
        inter = g.inter
        ok = ok and inter % n == 0
        # column pieces keep the format's N blocks whole; row pieces its K blocks
        ok = ok and (g.q // n) % f.n_align == 0 and kv_rows % f.n_align == 0
        ok = ok and (inter // n) % f.n_align == 0
        ok = ok and (g.q // n) % f.k_align == 0 and (inter // n) % f.k_align == 0
        if ok:
            valid.append(n)
    return valid


def check_model(model: Model, sessions=(ThreadedSession,)) -> list[int]:
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt)
        valid = [n for n in valid_num_shards(info, ckpt, limit=8) if n in NS]
        assert valid == expected_valid(model), model.fmt.name
        for n in valid:
            for session in sessions:
                with session(n) as sess:
                    result = load_sharded(ckpt, info, sess, progress=False)
                    shards = [result.worker(i) for i in range(n)]
                check_shards(model, shards, n)
    return valid


def check_shards(model: Model, shards: list[dict], n: int) -> None:
    for module in model.shapes:
        prefix = f"model.layers.0.{module}."
        for i in range(n):
            stored = {
                name[len(prefix) :]: _as_numpy(t)
                for name, t in shards[i].items()
                if name.startswith(prefix)
            }
            got = model.fmt.dequantize(stored)
            want = expected_piece(model, module, n, i)
            assert got.shape == want.shape, (module, i, n)
            assert np.array_equal(got, want), f"{model.fmt.name} {module} worker {i} of {n}"
    for i in range(n):  # replicated, bit for bit
        assert "model.norm.weight" in shards[i] and "model.embed_tokens.weight" in shards[i]


def _as_numpy(t: torch.Tensor):
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        return t  # the reference codecs take torch for dtypes numpy lacks
    return t.numpy()


# ---- the proofs ----------------------------------------------------------------------------------


def _format_geometry_cases():
    """Every format on both geometries (GQA: N 1, 2, 4, 8 with KV heads replicated at 4 and 8;
    THREE: N 1 and 3, odd sizes): which N each format allows depends on its alignments
    (n_align, k_align) against each geometry's sizes. Except, on THREE, the formats whose
    alignments and planner path are another's: bf16 (fp16's; the dtype only) and the GPTQ v2
    zero points (v1's; the version changes only how zero points are stored, checked on GQA)."""
    same_as_another = {"bf16", "gptq4-g32-v2", "gptq8-g32-v2"}
    fmts = PLAIN + GPTQ + OTHERS
    assert same_as_another <= {f.name for f in fmts}
    return [pytest.param(f, GQA, id=f"8q2kv-{f.name}") for f in fmts] + [
        pytest.param(f, THREE, id=f"12q3kv-{f.name}") for f in fmts if f.name not in same_as_another
    ]


@pytest.mark.parametrize("fmt, geometry", _format_geometry_cases())
def test_every_shard_dequantizes_to_its_slice(tmp_path, fmt, geometry):
    model = write_model(str(tmp_path), geometry, fmt)
    valid = check_model(model)
    assert valid, "every format must allow some N > 0"


@pytest.mark.parametrize(
    "fmt", [PLAIN[0], gptq(4, 32), awq(32), pack_quantized(4, 32, False)], ids=lambda f: f.name
)
def test_mqa_replicates_the_one_kv_head(tmp_path, fmt):
    model = write_model(str(tmp_path), MQA, fmt)
    assert check_model(model) == [1, 2, 4, 8]


@pytest.mark.parametrize("fmt", [fp8("block"), fp8("channel"), gptq(4, 128)], ids=lambda f: f.name)
def test_wide_heads(tmp_path, fmt):
    model = write_model(str(tmp_path), WIDE, fmt)
    check_model(model)


@pytest.mark.parametrize(
    "fmt",
    [PLAIN[0], gptq(4, 32), gptq(3, 32), awq(32), pack_quantized(4, 32, False), fp8("channel")],
    ids=lambda f: f.name,
)
def test_fused_qkv_and_gate_up(tmp_path, fmt):
    model = write_model(str(tmp_path), GQA, fmt, fused=True)
    assert check_model(model) == expected_valid(model)


@pytest.mark.parametrize("fmt", [PLAIN[0], gptq(4, 32)], ids=lambda f: f.name)
def test_mixtral_experts(tmp_path, fmt):
    model = write_model(str(tmp_path), GQA, fmt, experts=2)
    check_model(model)
    with open_checkpoint(model.folder) as ckpt:
        plan = plan_for(ckpt).to_dict()
    assert "model.layers.0.block_sparse_moe.gate.weight" not in plan  # the router: replicated
    assert "model.layers.0.block_sparse_moe.experts.1.w2.qweight" in plan or fmt.name == "fp16"


@pytest.mark.slow
def test_process_session_gives_the_same_shards(tmp_path):
    from shardload import ProcessSession

    model = write_model(str(tmp_path), GQA, gptq(4, 32))
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt)
        with ProcessSession(4) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
            shards = [result.worker(i) for i in range(4)]
    check_shards(model, shards, 4)


# ---- plans and refusals --------------------------------------------------------------------------


def test_plan_is_symbolic_and_names_the_valid_n(tmp_path):
    model = write_model(str(tmp_path), THREE, gptq(4, 32))
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt, num_shards=3)
        assert info.is_symbolic
        with pytest.raises(PlanError) as err:
            plan_for(ckpt, num_shards=2, pad=False)  # padded, 2 works too
    message = str(err.value)
    assert "cannot be split over 2 workers" in message and "N that work" in message
    assert "1, 3" in message and "k_proj" in message


def test_act_order_replicates_scales_on_row_parallel_layers(tmp_path):
    model = write_model(str(tmp_path), GQA, gptq(4, 32, act_order=True))
    with open_checkpoint(model.folder) as ckpt:
        plan = plan_for(ckpt).to_dict()
    layer = "model.layers.0."
    assert layer + "self_attn.o_proj.scales" not in plan  # replicated
    assert layer + "self_attn.o_proj.qzeros" not in plan
    assert plan[layer + "self_attn.o_proj.g_idx"][0][0] == "shardload.split"  # not rebased
    assert layer + "self_attn.q_proj.g_idx" not in plan  # column: whole g_idx


def test_trivial_g_idx_is_rebased(tmp_path):
    model = write_model(str(tmp_path), GQA, gptq(4, 32))
    with open_checkpoint(model.folder) as ckpt:
        plan = plan_for(ckpt).to_dict()
    assert plan["model.layers.0.mlp.down_proj.g_idx"][0][0] == "shardload.split_rebase"
    assert plan["model.layers.0.mlp.down_proj.scales"][0][0] == "shardload.split"


def test_vocab_parallel_embeddings(tmp_path):
    model = write_model(str(tmp_path), GQA, PLAIN[0])
    with open_checkpoint(model.folder) as ckpt:
        assert "model.embed_tokens.weight" not in plan_for(ckpt).to_dict()
        info = plan_for(ckpt, vocab_parallel=True)
        with ThreadedSession(4) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
        full = ckpt.read("lm_head.weight")
    for i in range(4):
        assert torch.equal(result.shard("lm_head.weight", i), full.chunk(4)[i])


def test_bitsandbytes_is_refused(tmp_path):
    model = write_model(str(tmp_path), GQA, PLAIN[0])
    config = json.load(open(os.path.join(model.folder, "config.json")))
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    json.dump(config, open(os.path.join(model.folder, "config.json"), "w"))
    with pytest.raises(PlanError, match="bitsandbytes checkpoints are not supported"):
        plan_for(model.folder)


@pytest.mark.parametrize(
    "quant, phrase",
    [
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
            "tile-permuted",
        ),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "GEMM"),
        ({"quant_method": "hqq"}, "not supported"),
    ],
)
def test_layouts_that_cannot_be_sliced_are_refused(tmp_path, quant, phrase):
    model = write_model(str(tmp_path), GQA, PLAIN[0])
    config = json.load(open(os.path.join(model.folder, "config.json")))
    config["quantization_config"] = quant
    json.dump(config, open(os.path.join(model.folder, "config.json"), "w"))
    with pytest.raises(PlanError, match=phrase):
        plan_for(model.folder)


def test_fp8_blocks_straddling_kv_heads_go_in_pairs(tmp_path):
    # 64-row KV heads inside 128-row scale blocks: a KV head cannot be split off exactly, a
    # pair can: N = 1 as it is (it was refused, N = 1 too), other N zero-padded in pairs
    model = write_model(
        str(tmp_path),
        Geometry(hidden=512, heads=8, kv_heads=2, head_dim=64, inter=1024),
        fp8("block"),
    )
    decision = plan_decision(model.folder)
    assert list(decision.valid) == [1]
    assert "KV heads" in str(plan_decision(model.folder, 2, pad=False).error)
    for n in (2, 3):
        check_padded(model, n, run=2)


def test_partial_fp8_blocks_load_whole_at_one_worker(tmp_path):
    """SmolLM2's geometry (9 query, 3 KV heads of 64) in 128x128 FP8 blocks: its k/v
    projections (192 rows) end in a partial block, so no split is exact. The plan fits N = 1
    (it was refused at every N) and names the partial block for other N."""
    smollm2 = Geometry(hidden=512, heads=9, kv_heads=3, head_dim=64, inter=1024)
    model = write_model(str(tmp_path), smollm2, fp8("block"))
    with open_checkpoint(model.folder) as ckpt:
        decision = plan_decision(ckpt, 1)
        assert decision.kind == "unpadded" and list(decision.valid) == [1]
        with ThreadedSession(1) as sess:
            shards = load_sharded(ckpt, decision.shard_info(), sess, progress=False).worker(0)
    for module, w in model.full.items():
        prefix = f"model.layers.0.{module}."
        stored = {k[len(prefix) :]: _as_numpy(t) for k, t in shards.items() if k.startswith(prefix)}
        assert np.array_equal(model.fmt.dequantize(stored), w), module
    err = str(plan_decision(model.folder, 2, pad=False).error)
    assert (
        "the 3 KV heads ('num_key_value_heads' = 3), whose 192 elements end in a partial "
        "128-element block"
    ) in err and "N that work (up to 64): 1" in err


def test_unsupported_architecture_is_refused(tmp_path):
    model = write_model(str(tmp_path), GQA, PLAIN[0])
    config = json.load(open(os.path.join(model.folder, "config.json")))
    config["model_type"] = "gpt2"
    json.dump(config, open(os.path.join(model.folder, "config.json"), "w"))
    with pytest.raises(PlanError, match="model_type 'gpt2' is not supported"):
        plan_for(model.folder)


def test_fp8_fused_qkv_with_a_scale_per_part_becomes_per_channel(tmp_path):
    # q, k and v quantized each with its own per-tensor scale, stored fused: weight [q+2kv, K],
    # weight_scale [3]. Each worker's rows mix the parts, so the plan expands the three scales
    # to one per row (exact) and splits them like the weight.
    g = GQA
    rng = np.random.default_rng(3)
    parts = [
        quantize_fp8((rng.standard_normal((rows, g.hidden)) * 0.05).astype(np.float32), "tensor")
        for rows in (g.q, g.kv, g.kv)
    ]
    weight = torch.cat([p["weight"] for p in parts])
    scales = np.concatenate([np.asarray(p["weight_scale"]).reshape(1) for p in parts])
    full = np.concatenate([dequantize_fp8(p, "tensor") for p in parts])
    fmt = fp8("tensor")
    model = write_model(str(tmp_path), g, PLAIN[0], fused=True)
    from safetensors.torch import load_file

    stored = load_file(os.path.join(model.folder, "model.safetensors"))
    stored["model.layers.0.self_attn.qkv_proj.weight"] = weight
    stored["model.layers.0.self_attn.qkv_proj.weight_scale"] = torch.from_numpy(scales)
    save_file(stored, os.path.join(model.folder, "model.safetensors"))
    config = json.load(open(os.path.join(model.folder, "config.json")))
    config["quantization_config"] = fmt.quant_config
    json.dump(config, open(os.path.join(model.folder, "config.json"), "w"))
    model.full["self_attn.qkv_proj"] = full
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt)
        steps = info.to_dict()["model.layers.0.self_attn.qkv_proj.weight_scale"]
        assert [s[0] for s in steps] == ["shardload.repeat_segments", "shardload.split_segments"]
        for n in (1, 2, 4, 8):
            with ThreadedSession(n) as sess:
                result = load_sharded(ckpt, info, sess, progress=False)
            for i in range(n):
                piece = {
                    "weight": result.shard("model.layers.0.self_attn.qkv_proj.weight", i),
                    "weight_scale": result.shard(
                        "model.layers.0.self_attn.qkv_proj.weight_scale", i
                    ).numpy(),
                }
                got = dequantize_fp8(piece, "channel")
                assert np.array_equal(got, expected_piece(model, "self_attn.qkv_proj", n, i))


def test_qwen_biases_and_per_head_norms(tmp_path):
    # Qwen2 has q/k/v biases (split like the rows they add to); Qwen3 has per-head q/k norms
    # (replicated: every head uses the same vector)
    model = write_model(str(tmp_path), GQA, PLAIN[0])
    from safetensors.torch import load_file

    stored = load_file(os.path.join(model.folder, "model.safetensors"))
    rng = np.random.default_rng(5)
    for proj, rows in (("q_proj", GQA.q), ("k_proj", GQA.kv), ("v_proj", GQA.kv)):
        stored[f"model.layers.0.self_attn.{proj}.bias"] = torch.from_numpy(
            rng.standard_normal(rows).astype(np.float16)
        )
    stored["model.layers.0.self_attn.q_norm.weight"] = torch.ones(GQA.head_dim)
    save_file(stored, os.path.join(model.folder, "model.safetensors"))
    config = json.load(open(os.path.join(model.folder, "config.json")))
    config["model_type"] = "qwen3"
    json.dump(config, open(os.path.join(model.folder, "config.json"), "w"))
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt)
        assert "model.layers.0.self_attn.q_norm.weight" not in info.to_dict()
        with ThreadedSession(4) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.0.self_attn.{proj}.bias"
            full = ckpt.read(name).numpy()[:, None]
            model.full[f"self_attn.{proj}"] = full  # rows are what matters here
            for i in range(4):
                want = expected_piece(model, f"self_attn.{proj}", 4, i)[:, 0]
                assert np.array_equal(result.shard(name, i).numpy(), want)


# ---- random geometries ---------------------------------------------------------------------------


@st.composite
def gptq_models(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([32, 64]))
    inter = draw(st.sampled_from([96, 192, 256, 384]))
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    group = draw(st.sampled_from([32, -1]))
    act = draw(st.booleans()) and group != -1
    return Geometry(
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        inter=inter,
        vocab=32,
    ), gptq(bits, group, act_order=act)


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=gptq_models())
def test_random_gptq_models(tmp_path_factory, case):
    geometry, fmt = case
    folder = str(tmp_path_factory.mktemp("random"))
    model = write_model(folder, geometry, fmt)
    check_model(model)


# ---- zero padding --------------------------------------------------------------------------------

#: which units of a layer each padded layout entry moves: (layout key, head or block, axis)
_PADDED_UNITS = {
    "q_proj": ("q_heads", 0),
    "k_proj": ("kv_heads", 0),
    "v_proj": ("kv_heads", 0),
    "o_proj": ("q_heads", 1),
    "gate_proj": ("mlp", 0),
    "up_proj": ("mlp", 0),
    "down_proj": ("mlp", 1),
    "w1": ("mlp", 0),
    "w3": ("mlp", 0),
    "w2": ("mlp", 1),
}


def check_padded(model: Model, n: int, run: int = 1) -> dict:
    """Load ``model`` padded onto n workers; every worker's every layer must dequantize (by the
    format's own reference) to its units of the dense weight, zeros for padded units, in the
    layout of the independent rule (``helpers.tp_reference``; heads in aligned runs of ``run``).
    Returns the layout."""
    g, fmt = model.geometry, model.fmt
    with open_checkpoint(model.folder) as ckpt:
        info = plan_for(ckpt, num_shards=n)
        layout = info.metadata["tensor_parallel"]
        with ThreadedSession(n) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
            shards = [result.worker(i) for i in range(n)]
    hd, block = layout["head_dim"], layout["mlp_block"]
    assert (layout["q_heads"], layout["kv_heads"]) == padded_head_runs(g.heads, g.kv_heads, n, run)
    mlp = layout["mlp_blocks"][str(g.inter)]
    assert mlp == padded_units(g.inter // block, n)
    units = {
        "q_heads": (layout["q_heads"], hd),
        "kv_heads": (layout["kv_heads"], hd),
        "mlp": (mlp, block),
    }
    for module, w in model.full.items():
        key, axis = _PADDED_UNITS[module.rsplit(".", 1)[1]]
        worker_units, size = units[key]
        prefix = f"model.layers.0.{module}."
        for i in range(n):
            stored = {
                k[len(prefix) :]: _as_numpy(t) for k, t in shards[i].items() if k.startswith(prefix)
            }
            assert np.array_equal(fmt.dequantize(stored), take(w, worker_units[i], size, axis)), (
                f"{fmt.name} {module} worker {i} of {n}"
            )
    return layout


@st.composite
def narrow_head_models(draw):
    """Heads as wide as, narrower than, or straddling the groups and packed blocks they are
    stored in (the geometries where the padded planner broke before)."""
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    inter = draw(st.sampled_from([256, 384, 640]))
    fmt = draw(
        st.sampled_from(
            [
                gptq(4, 64),
                gptq(4, 128),
                gptq(3, 32),
                awq(64),
                awq(128),
                gptq(4, 64, act_order=True),
                ct_act_order(),
                gptq(8, 128, version=2, act_order=True),
                pack_quantized(4, 128, True),
            ]
        )
    )
    config = fmt.quant_config
    group = config.get("group_size") or config["config_groups"]["group_0"]["weights"]["group_size"]
    assume(heads * head_dim % group == 0)  # quantizers (ours, GPTQ's) need whole groups
    # and packed rows: a 3-bit GPTQ packs 32 output rows together
    assume(kv_heads * head_dim % fmt.n_align == 0)
    return Geometry(
        hidden=512, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter, vocab=32
    ), fmt


@pytest.mark.slow
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=narrow_head_models())
def test_random_narrow_heads_pad_exactly_or_are_refused(tmp_path_factory, case):
    """Every N is decided, never raised: unpadded, refused with its reason, or padded such that
    each real query head is held once, each real KV head at least once, and every worker's
    layers dequantize to exactly the units its layout names (zeros for zero units)."""
    geometry, fmt = case
    model = write_model(str(tmp_path_factory.mktemp("narrow")), geometry, fmt)
    with open_checkpoint(model.folder) as ckpt:
        for n in (3, 5):
            decision = plan_decision(ckpt, n)
            if decision.kind == "refused":
                assert "cannot be split over" in str(decision.error)
                continue
            info = decision.shard_info()
            with ThreadedSession(n) as sess:
                result = load_sharded(ckpt, info, sess, progress=False)
                shards = [result.worker(i) for i in range(n)]
            layout = info.metadata.get("tensor_parallel")
            if layout is None:
                continue  # unpadded: the exact splits are test_random_gptq_models' concern
            q = sorted(h for worker in layout["q_heads"] for h in worker if h >= 0)
            assert q == list(range(geometry.heads))
            assert {h for w in layout["kv_heads"] for h in w if h >= 0} == set(
                range(geometry.kv_heads)
            )
            units = {
                "q_heads": (layout["q_heads"], layout["head_dim"]),
                "kv_heads": (layout["kv_heads"], layout["head_dim"]),
                "mlp": (layout["mlp_blocks"][str(geometry.inter)], layout["mlp_block"]),
            }
            for module, w in model.full.items():
                key, axis = _PADDED_UNITS[module.rsplit(".", 1)[1]]
                prefix = f"model.layers.0.{module}."
                for i in range(n):
                    stored = {
                        k[len(prefix) :]: _as_numpy(t)
                        for k, t in shards[i].items()
                        if k.startswith(prefix)
                    }
                    want = take(w, units[key][0][i], units[key][1], axis)
                    assert np.array_equal(fmt.dequantize(stored), want), (module, n, i)


@pytest.mark.parametrize(
    "fmt",
    [
        PLAIN[0],
        awq(32),
        pack_quantized(4, 32, False),
        fp8("channel"),
        gptq(4, 32),
        gptq(3, 32, version=2, act_order=True),
        gptq(4, 32, act_order=True),
        ct_act_order(),
    ],
    ids=lambda f: f.name,
)
@pytest.mark.parametrize("n", [2, 5, 8])
def test_zero_padding_for_n_the_heads_do_not_divide(tmp_path, fmt, n):
    check_padded(write_model(str(tmp_path), THREE, fmt), n)  # 12 query, 3 KV heads, 768


@pytest.mark.parametrize(
    "fmt, experts",
    [(fp8("block"), 0), (fp8("block"), 4), (gptq(4, 32, act_order=True), 4), (awq(32), 4)],
    ids=["fp8-block", "fp8-block-experts", "gptq-act-experts", "awq-experts"],
)
def test_zero_padding_keeps_blocks_and_experts_whole(tmp_path, fmt, experts):
    """FP8's 128x128 scale blocks and every expert's MLP: padded in whole blocks (and groups),
    zero blocks and zero-scaled groups dequantizing to exact zeros, at N=3 (4 heads over 2 KV
    heads of 128, an MLP of 8 blocks of 128)."""
    layout = check_padded(write_model(str(tmp_path), WIDE, fmt, experts=experts), 3)
    assert layout["mlp_block"] == (128 if fmt.name.startswith("fp8") else 32)


@pytest.mark.parametrize(
    "fmt",
    [gptq(4, 64), gptq(4, 64, act_order=True), gptq(8, 64, version=2, act_order=True)],
    ids=lambda f: f.name,
)
@pytest.mark.parametrize("n", [3, 5])
def test_zero_padding_heads_narrower_than_a_group(tmp_path, fmt, n):
    """Heads of 16 rows in groups of 64 rows (as 32-dim heads in GPTQ's usual 128): o_proj's
    rows, its g_idx among them, pad in runs of 4 heads, whole zero groups (not one head, which
    would cut a group: the planner once wrote a plan its own validation refused)."""
    narrow = Geometry(hidden=256, heads=8, kv_heads=4, head_dim=16, inter=512)
    model = write_model(str(tmp_path), narrow, fmt)
    if n == 5 and fmt.name.endswith("act"):  # 2 runs of heads over 5 workers: 2.5x the heads
        assert "would more than double" in str(plan_decision(model.folder, n).error)
        return
    check_padded(model, n, run=4)


@pytest.mark.parametrize("fmt", [gptq(3, 32), gptq(3, 32, act_order=True)], ids=lambda f: f.name)
def test_kv_heads_narrower_than_a_packed_block(tmp_path, fmt):
    """3-bit GPTQ packs qzeros' columns 32 to a block of 3 words: KV heads of 16 columns go in
    pairs, whole blocks (the planner once refused every N, N = 1 too). Unpadded where N
    divides the 2 pairs of KV heads, zero-padded in runs of two heads elsewhere, exactly."""
    narrow = Geometry(hidden=256, heads=8, kv_heads=4, head_dim=16, inter=512)
    model = write_model(str(tmp_path), narrow, fmt)
    with open_checkpoint(model.folder) as ckpt:
        decision = plan_decision(ckpt)
        assert list(decision.valid) == list(valid_num_shards(decision.shard_info(), ckpt))
        assert list(decision.valid) == [1, 2]
        assert plan_decision(ckpt, 2).kind == "unpadded"
    for n in (3, 4):
        check_padded(model, n, run=2)


def test_act_order_padding_past_twice_the_heads_is_refused(tmp_path):
    """Act-order keeps all of o_proj's group scales on every worker, plus zero groups for its
    zero rows: 2 query heads padded to 8 over 8 workers would hold 4x the layer's scales on
    each, past what the loader allocates for a stored tensor. Refused with the reason (a
    returned refusal, not the plan's own validation raising); without act-order it pads."""
    two_heads = Geometry(hidden=512, heads=2, kv_heads=1, head_dim=128, inter=1024)
    act = write_model(str(tmp_path / "act"), two_heads, gptq(4, 32, act_order=True))
    decision = plan_decision(act.folder, 8)
    assert decision.kind == "refused"
    assert (
        "act-order keeps every group's scales on every worker, and 2 query heads "
        "zero-padded to 8 over 8 workers"
    ) in str(decision.error)
    assert plan_decision(act.folder, 3).kind == "padded"  # 2 heads to 3: within twice
    check_padded(write_model(str(tmp_path / "plain"), two_heads, gptq(4, 32)), 8)


@pytest.mark.parametrize(
    "fmt",
    [gptq(4, -1), gptq(3, -1, sym=True), pack_quantized(4, None, False)],
    ids=lambda f: f.name,
)
def test_zero_padding_is_refused_for_a_per_channel_layer_without_one_zero_code(tmp_path, fmt):
    # asymmetric: each column's zero point is its own, so no one code pads every column with
    # zeros, and there is no group to zero; 3-bit codes straddle words (no one word repeats)
    model = write_model(str(tmp_path), THREE, fmt)
    with pytest.raises(PlanError, match="per channel") as err:
        plan_for(model.folder, num_shards=2)
    assert "no one stored element is a zero weight in every column" in str(err.value)
    assert "N that work (up to 64): 1, 3" in str(err.value)


@pytest.mark.parametrize(
    "fmt",
    [
        gptq(4, -1, sym=True),
        gptq(4, -1, act_order=True, sym=True),
        gptq(8, -1, version=2, sym=True),
        gptq(2, -1, sym=True),
        pack_quantized(4, None, True),
        pack_quantized(8, None, True),
    ],
    ids=lambda f: f.name,
)
@pytest.mark.parametrize("n", [2, 5])
def test_per_channel_symmetric_rows_pad_with_the_zero_code(tmp_path, fmt, n):
    """A per-channel row-parallel layer whose columns share one zero code (symmetric GPTQ, as
    TheBloke's Mixtral GPTQ; compressed-tensors' offset ints): padded rows hold that code in
    every field, so they dequantize to zeros under the column's one scale."""
    check_padded(write_model(str(tmp_path), THREE, fmt), n)


@pytest.mark.parametrize("act_order", [False, True])
def test_padded_gptq_rows_are_zero_groups_of_their_own(tmp_path, act_order):
    """Row-parallel zero rows point at groups whose scales are 0: the worker's own (no
    act-order) or ones appended after every real group (act-order, scales replicated)."""
    model = write_model(str(tmp_path), THREE, gptq(4, 32, act_order=act_order))
    n, groups = 5, THREE.inter // 32  # 24 groups: 5 per worker, 1 padded
    with open_checkpoint(model.folder) as ckpt, ThreadedSession(n) as sess:
        info = plan_for(ckpt, num_shards=n)
        shards = [load_sharded(ckpt, info, sess, progress=False).worker(i) for i in range(n)]
    last = shards[-1]
    prefix = "model.layers.0.mlp.down_proj."
    g_idx, scales = last[prefix + "g_idx"].numpy(), last[prefix + "scales"].numpy()
    padded_rows = slice(4 * 32, 5 * 32)  # worker 4 holds groups 20..23, then 0s
    if act_order:
        assert scales.shape[0] == n * 5  # every real group, then zero groups
        assert (g_idx[padded_rows] == groups).all()
        assert not scales[groups:].any()
    else:
        assert scales.shape[0] == 5
        assert (g_idx == np.arange(5 * 32) // 32).all()
        assert not scales[4].any()
