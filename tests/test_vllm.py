"""``--load-format shardload`` in a real vLLM engine (vLLM's CPU build, in its own environment).

Each engine test starts one engine with ``load_format="shardload"`` and ``verify`` on, generates
(greedy tokens, top-5 logprobs), takes a digest of every parameter after vLLM's processing, then
reloads every weight with vLLM's own default loader in the same engine (vLLM's in-place reload,
which processes them again) and generates again, then reloads with shardload again (its reload:
views of the mapped file, no verify) and generates again: the tokens, the logprobs and every
parameter must be equal, so only the loader differs. Where vLLM's in-place reload is not
faithful (its fused MoE, its CPU int8 kernel), two engines' first loads are compared. The
per-rank statistics from vLLM's log say each rank read no more than it kept.

vLLM runs from the environment ``scripts/vllm-env.sh`` makes (``SHARDLOAD_VLLM_PYTHON``, or
``~/.cache/shardload/vllm-venv``): without it these tests skip, unless
``SHARDLOAD_REQUIRE_VLLM=1`` (CI), where they fail. The unit tests at the top need no vLLM.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.objectservers import scheme_params
from helpers.paths import REPO
from helpers.subprocesses import subprocess_env
from helpers.vllm_checks import check_same_as_default, run_engine
from helpers.vllm_engine import int4_kernel_missing
from safetensors.numpy import save_file

from shardload import open_checkpoint
from shardload.errors import PlanError
from shardload.frontdoor import resolve_plan
from shardload.pieces.reads import read_runs
from shardload.readplan import read_plan_for
from shardload.vllm.holding import Holding, holds_even_rows
from shardload.vllm.options import LoaderOptions, OptionsError
from shardload.vllm.padding import vllm_overrides
from shardload.vllm.standins import stand_in_reads
from shardload.vllm.verify import VerifyError, poison, verified_load

# ---- without vLLM: options, stand-ins, padding, verify ------------------------------------------


def test_options_refuse_unknown_keys_naming_the_known_ones():
    assert LoaderOptions.from_extra_config({}) == LoaderOptions()
    opts = LoaderOptions.from_extra_config(
        {
            "verify": True,
            "plan": "p.json",
            "timeout": 30,
            "staging": {"buffers": 2, "buffer_mib": 4},
        }
    )
    assert (opts.verify, opts.plan, opts.timeout, opts.staging.buffers) == (True, "p.json", 30, 2)
    assert LoaderOptions.from_extra_config({"checkpoint": "s3://b/m/"}).checkpoint == "s3://b/m/"
    with pytest.raises(OptionsError, match=r"no option 'verfy'; its options are plan: .*verify"):
        LoaderOptions.from_extra_config({"verfy": True})
    for bad, msg in [
        ({"verify": "yes"}, "verify must be true or false"),
        ({"timeout": 0}, "timeout must be"),
        ({"plan": 3}, "plan must be a path"),
        ({"checkpoint": ""}, "checkpoint must be a path or an s3://, gs:// or az:// URL"),
        ({"staging": {"buffer": 2}}, "staging takes buffers and buffer_mib"),
        ({"staging": {"buffers": 0}}, "staging"),
        ([], "must be a JSON object"),
    ]:
        with pytest.raises(OptionsError, match=msg):
            LoaderOptions.from_extra_config(bad)


def _llama_folder(tmp_path: Path, heads=8, kv=2, head_dim=4, hidden=16, inter=32) -> Path:
    rng = np.random.default_rng(0)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((64, hidden)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(hidden).astype(np.float32),
        "lm_head.weight": rng.standard_normal((64, hidden)).astype(np.float32),
    }
    p = "model.layers.0."
    t[p + "input_layernorm.weight"] = rng.standard_normal(hidden).astype(np.float32)
    t[p + "post_attention_layernorm.weight"] = rng.standard_normal(hidden).astype(np.float32)
    for name, shape in [
        ("self_attn.q_proj", (heads * head_dim, hidden)),
        ("self_attn.k_proj", (kv * head_dim, hidden)),
        ("self_attn.v_proj", (kv * head_dim, hidden)),
        ("self_attn.o_proj", (hidden, heads * head_dim)),
        ("mlp.gate_proj", (inter, hidden)),
        ("mlp.up_proj", (inter, hidden)),
        ("mlp.down_proj", (hidden, inter)),
    ]:
        t[p + name + ".weight"] = rng.standard_normal(shape).astype(np.float32)
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": 1,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "head_dim": head_dim,
                "vocab_size": 64,
                "torch_dtype": "float32",
            }
        )
    )
    return tmp_path


def _padded64(size: int) -> int:
    return -(-size // 64) * 64


def _vllm_vocab_rows(vocab: int, n: int, rank: int) -> tuple[int, int]:
    """The checkpoint rows vLLM's ``VocabParallelEmbedding`` keeps on ``rank``, written from its
    definition: the vocabulary padded to a multiple of 64, cut in N equal parts, the padding
    dropped."""
    per = _padded64(vocab) // n
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def _vllm_parts_are_equal(vocab: int, n: int) -> bool:
    """Whether the N parts ``_vllm_vocab_rows`` gives are all ``vocab / N`` rows."""
    return {end - begin for begin, end in (_vllm_vocab_rows(vocab, n, r) for r in range(n))} == {
        vocab / n
    }


def _vllm_narrow(full: torch.Tensor, name: str, n: int, rank: int) -> torch.Tensor:
    """What vLLM's weight loaders keep of a full tensor, written from their rule: column-parallel
    layers narrow dim 0, row-parallel ones dim 1, into N equal chunks; the embeddings and
    lm_head their vocabulary rows; the rest whole."""
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return full.chunk(n, 0)[rank]
    if any(k in name for k in ("o_proj", "down_proj")):
        return full.chunk(n, 1)[rank]
    if any(k in name for k in ("embed_tokens", "lm_head")):
        begin, end = _vllm_vocab_rows(full.shape[0], n, rank)
        return full[begin:end]
    return full


def _vllm_embedding(vocab: int, n: int, rank: int, added: int = 0) -> SimpleNamespace:
    """A ``VocabParallelEmbedding``'s attributes as vLLM sets them (its definition), for
    ``holds_even_rows``."""
    org_padded = _padded64(vocab)
    begin, end = _vllm_vocab_rows(vocab, n, rank)
    return SimpleNamespace(
        org_vocab_size=vocab,
        num_added_embeddings=added,
        num_embeddings_padded=_padded64(org_padded + added),
        tp_size=n,
        tp_rank=rank,
        shard_indices=SimpleNamespace(org_vocab_start_index=begin, org_vocab_end_index=end),
    )


@pytest.mark.parametrize(
    "vocab, n, added, even",
    [
        (512, 2, 0, True),
        (128256, 8, 0, True),  # Llama 3
        (151936, 4, 0, True),  # Qwen2.5
        (50257, 2, 0, False),  # GPT-2's: padded to 50304, rank 1 keeps fewer rows
        (49152, 2, 64, False),  # added tokens
        (32001, 2, 0, False),  # a token added to Llama 2's in the checkpoint: padded to 32064
    ],
)
def test_the_vocabulary_is_split_where_vllm_keeps_equal_parts(vocab, n, added, even):
    """Each rank's answer agrees with vLLM's rows written independently: equal parts exactly
    where the planner's even split is what vLLM keeps."""
    answers = [holds_even_rows(_vllm_embedding(vocab, n, r, added), n) for r in range(n)]
    assert answers == [even] * n
    assert (_vllm_parts_are_equal(vocab, n) and added == 0) is even


def test_a_plan_made_from_the_config_follows_how_vllm_holds_the_model():
    split, experts = Holding(False, True), Holding(True, True)
    assert split.planner_options(False, None) == {"vocab_parallel": True}
    assert experts.planner_options(False, None) == {"experts": "ep", "vocab_parallel": True}
    # a plan beside the checkpoint is used as it is: no split asked of it (whole experts are,
    # and refused there, naming the flag); a plan given is asked nothing
    assert split.planner_options(False, "shard_info.json") == {}
    assert experts.planner_options(False, "shard_info.json") == {"experts": "ep"}
    assert experts.planner_options(True, None) == {}
    assert Holding(False, False).planner_options(False, None) == {}


@pytest.mark.parametrize("n, vocab_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_stand_ins_hold_each_ranks_bytes_where_vllm_narrows_them(tmp_path, n, vocab_parallel):
    ckpt = open_checkpoint(str(_llama_folder(tmp_path)))
    validated = resolve_plan(ckpt, n, vocab_parallel=vocab_parallel).validated
    for rank in range(n):
        ins = stand_in_reads(read_plan_for(validated, ckpt, rank), validated, ckpt)
        for piece in ins.plan.pieces:
            meta = validated.params[piece.name].meta
            assert piece.shape == meta.shape
            standin = read_runs(ckpt, piece.runs, piece.shape, piece.dtype, False, piece.name)
            poison(standin, ins.mine[piece.name], 0xFF)  # NaN wherever the rank read nothing
            full = ckpt.read(piece.name)
            torch.testing.assert_close(
                _vllm_narrow(standin, piece.name, n, rank),
                _vllm_narrow(full, piece.name, n, rank),
                rtol=0,
                atol=0,
            )
        assert ins.kept == validated.bytes_per_worker(rank) and ins.padded == ()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_read_pieces_are_views_of_the_mapped_file_holding_each_ranks_bytes(tmp_path, n):
    ckpt = open_checkpoint(str(_llama_folder(tmp_path)))
    validated = resolve_plan(ckpt, n).validated
    mapping = ckpt.source_bytes(0).untyped_storage().data_ptr()
    for rank in range(n):
        plan = read_plan_for(validated, ckpt, rank)
        before = ckpt.bytes_read
        ins = stand_in_reads(plan, validated, ckpt, ckpt.view)
        assert ckpt.bytes_read == before  # a view copies nothing
        assert ins.plan.pieces == ()  # nothing left to read: every piece is a view
        assert ins.order == tuple(p.name for p in plan.pieces) == tuple(ins.views)
        for name, view in ins.views.items():
            assert view.untyped_storage().data_ptr() == mapping  # in place, not a copy
            full = ckpt.read(name)
            assert torch.equal(_vllm_narrow(view, name, n, rank), _vllm_narrow(full, name, n, rank))
        # what vLLM's narrowing copies out of the views: this rank's bytes, as a read would
        assert ins.viewed == ins.kept == validated.bytes_per_worker(rank)


def test_padded_stand_ins_are_the_padded_whole_with_this_ranks_chunk(tmp_path):
    # SmolLM2's 9 query / 3 KV heads at N=4: zero-padded to 12 / 4, 3 query heads and one KV
    # head per rank, the last rank's all zero
    ckpt = open_checkpoint(str(_llama_folder(tmp_path, heads=9, kv=3, hidden=36, inter=36)))
    validated = resolve_plan(ckpt, 4).validated
    assert vllm_overrides(ckpt, 4) == {
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 4,
    }
    heads = ckpt.read("model.layers.0.self_attn.q_proj.weight").reshape(9, 4, 36)
    expect = [heads[0:3], heads[3:6], heads[6:9], torch.zeros(3, 4, 36)]
    for rank in range(4):
        ins = stand_in_reads(read_plan_for(validated, ckpt, rank), validated, ckpt)
        piece = next(p for p in ins.plan.pieces if p.name.endswith("q_proj.weight"))
        assert piece.shape == (12 * 4, 36) and piece.zeros
        assert piece.name in ins.padded
        standin = read_runs(ckpt, piece.runs, piece.shape, piece.dtype, True, piece.name)
        poison(standin, ins.mine[piece.name], 0xFF)
        # what vLLM's QKV loader keeps of the padded whole: rank r's 3 heads
        assert torch.equal(standin.reshape(4, 3, 4, 36)[rank], expect[rank])
        # with views, a padded tensor is still read (its padded whole is not in the file)
        viewed = stand_in_reads(read_plan_for(validated, ckpt, rank), validated, ckpt, ckpt.view)
        assert set(viewed.padded) == set(ins.padded) == {p.name for p in viewed.plan.pieces}
        assert "model.norm.weight" in viewed.views and piece.name not in viewed.views


def test_overrides_refuse_a_layout_vllm_cannot_hold_naming_the_n_that_work(tmp_path):
    ckpt = str(_llama_folder(tmp_path, heads=9, kv=3, head_dim=4, hidden=36, inter=36))
    assert vllm_overrides(ckpt, 3) == {}
    assert vllm_overrides(ckpt, 4)["num_attention_heads"] == 12
    # N=2: the fewest heads (5 a rank over 2 KV heads, one on both ranks) is not a layout vLLM
    # holds; the planner takes the smallest regular one, 12 query and 4 KV heads
    assert vllm_overrides(ckpt, 2) == {
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 4,
    }
    # N=7: the regular layout would take 21 heads, over twice 9: the fewest are planned, for
    # shardload's own model, and vLLM is refused
    with pytest.raises(
        PlanError,
        match=r"for N=7: rank 0's query heads read KV heads "
        r".*N that work: 1, 2 \(padded\), 3, 4 \(padded\)",
    ) as err:
        vllm_overrides(ckpt, 7)
    assert str(err.value).count("N that work") == 1


def test_a_refusal_without_the_n_that_work_computed_names_vllms_n_once(tmp_path, monkeypatch):
    # a hand-written symbolic plan too large to validate for each N: its refusal cannot list
    # the N that work, and vLLM's refusal names its own list, once, after the constraint
    import shardload.plan.shards as shards
    from shardload.planners import plan_for
    from shardload.vllm.padding import validated_for_vllm

    ckpt = open_checkpoint(str(_llama_folder(tmp_path, heads=9, kv=3, hidden=36, inter=36)))
    plan = plan_for(ckpt)
    monkeypatch.setattr(shards, "MAX_VALIDATION_WORK", 1)
    with pytest.raises(PlanError) as err:
        validated_for_vllm(ckpt, 7, plan)
    text = str(err.value)
    assert "not computed" not in text and text.count("N that work") == 1, text
    assert "equal shards; N that work: 1, 2 (padded), 3, 4 (padded)," in text, text
    # the plan's own refusal: the N that work as data, beside the constraint
    with pytest.raises(PlanError, match="the N that work were not computed") as given:
        shards.check_plan_fits(plan, ckpt, 2)
    assert given.value.working is not None and given.value.working.tried == 0
    assert "not computed" not in given.value.constraint


def test_verify_passes_a_true_narrowing_and_names_the_parameter_poison_reaches():
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    from shardload.vllm.standins import Block

    mine = (Block(0, 4 * 4 * 4),)  # rank 0 of 2 read rows 0..3
    standin = full.clone()
    for offset_rows, name in [(0, None), (1, "layer.weight")]:
        params = {"layer.weight": torch.empty(4, 4), "made.from.config": torch.ones(2)}

        def load(bad, offset_rows=offset_rows, params=params):
            poison(standin, mine, bad)
            params["layer.weight"].copy_(standin[offset_rows : offset_rows + 4])

        if name is None:
            assert verified_load(params, load, 0) == ["made.from.config"]
            assert torch.equal(params["layer.weight"], full[:4])
            assert torch.equal(params["made.from.config"], torch.ones(2))
        else:
            with pytest.raises(
                VerifyError,
                match=r"rank 0: 1 vLLM parameter.*layer\.weight "
                r"\(16 of 64 bytes\)",
            ):
                verified_load(params, load, 0)


# ---- in vLLM ------------------------------------------------------------------------------------


def models():
    from helpers import vllm_models

    return vllm_models


FORMATS = ["llama_bf16", "llama_w8a8", "llama_w4a16", "llama_gptq", "llama_awq"]
#: the formats vLLM's CPU build runs with its int4 kernel, which needs an AVX-512 CPU
INT4 = {"llama_w4a16", "llama_gptq", "llama_awq", "W4A16", "GPTQ"}


def _case(*values, extended: bool = False, marks=()):
    """A parameter set of a test that generates with the format ``values[0]``: an int4 one
    marked ``int4_kernel``, and ``extended`` where it runs only under ``-m extended``."""
    marks = [
        *marks,
        *([pytest.mark.int4_kernel] if values[0] in INT4 else []),
        *([pytest.mark.extended] if extended else []),
    ]
    return pytest.param(*values, marks=marks)


def _header_bytes(model: str, tp: int) -> tuple[int, int]:
    """(all tensor bytes, bytes of the tensors every rank holds whole) of a bf16 Llama at
    ``tp``, counted from the safetensors header by name, independently of shardload's plan.
    The embeddings and lm_head are split where vLLM's rule splits the vocabulary evenly: padded
    to a multiple of 64, cut in ``tp`` equal parts."""
    from safetensors import safe_open

    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    vocab_split = tp > 1 and _vllm_parts_are_equal(vocab, tp)
    whole = ("norm",) if vocab_split else ("embed_tokens", "lm_head", "norm")
    total = replicated = 0
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        for name in f.keys():
            nbytes = f.get_slice(name).get_shape()
            size = int(np.prod(nbytes)) * 2
            total += size
            replicated += size if any(w in name for w in whole) else 0
    return total, replicated


#: vLLM's CPU int8 kernel (W8A8) keeps state its in-place reload does not rebuild: reloaded,
#: even by vLLM's own default loader, it generates token 0 throughout though every parameter is
#: bitwise the same (seen on an AVX-512 AMD EPYC). Those checkpoints compare two first loads.
RELOAD_UNFAITHFUL = {"llama_w8a8", "W8A8"}


@functools.cache  # the bf16 engine at TP=2 serves the object-storage test too
def compare_with_default(name: str, model: str, tp: int, *args: str) -> tuple[dict, list, str]:
    """shardload (verify on) against vLLM's default loader, on one checkpoint: in one engine
    (the default loader and shardload again reloading in place), or two where vLLM's reload
    is not faithful."""
    if name in RELOAD_UNFAITHFUL:
        return _two_engines(model, tp, *args)
    return run_engine(
        model, tp, "--load-format", "shardload", "--verify", "--compare-default", *args
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(
    "name, tp",
    [
        # every format sharded (TP=2) by default but GPTQ (test_vllm_padding.py runs it padded at
        # TP=2, and test_vllm_pipeline.py at PP=2, by default); unsharded (TP=1) under -m extended
        *(
            (name, 2) if name != "llama_gptq" else pytest.param(name, 2, marks=pytest.mark.extended)
            for name in FORMATS
        ),
        *(pytest.param(name, 1, marks=pytest.mark.extended) for name in FORMATS),
    ],
)
def test_shardload_loads_what_vllms_default_loader_loads(name, tp):
    # where vLLM's CPU build has no int4 kernel (no AVX-512), an int4 format is loaded and its
    # parameters compared bitwise, but nothing generated: vLLM's own loader could not either
    tokens = ("--tokens", "0") if name in INT4 and int4_kernel_missing() else ()
    report, stats, log = compare_with_default(name, str(models().path(name)), tp, *tokens)
    check_same_as_default(report, stats, log, tp)
    # one plan per job: rank 0 plans, the other ranks receive its plan (each load and reload)
    assert [s["plan_from"] for s in stats] == [
        "planned" if s["rank"] == 0 else "rank 0" for s in stats
    ]
    if name == "llama_bf16":  # an independent count: each rank reads 1/N of what is split
        total, replicated = _header_bytes(str(models().path(name)), tp)
        for s in stats:
            # the 512-row vocabulary is split at TP=2, as vLLM splits it (verify proved it)
            assert s["vocab_parallel"] is (tp == 2)
            assert s["bytes_replicated"] == replicated
            assert s["bytes_read"] - replicated == (total - replicated) // tp


@pytest.mark.slow
@pytest.mark.vllm
# every scheme under -m extended: the plugin's path is the same for every scheme, and
# tests/test_objects.py runs every scheme's client by default; by default, a refit from S3
# reads through the same per-rank read at TP=2, its bytes counted the same way
# (tests/test_vllm_refit.py)
@pytest.mark.parametrize("scheme", scheme_params("s3", "gs", "az", marks=(pytest.mark.extended,)))
def test_weights_from_object_storage_load_what_the_local_folder_loads(
    tmp_path, monkeypatch, scheme
):
    # vLLM refuses an object-storage model for every load format but its own streamers, so
    # the model is a local folder with the configs and the weights come through the checkpoint
    # option; each rank fetches only its read plan's byte ranges from a real server of the
    # scheme (moto, fake-gcs-server, Azurite), through obstore
    from helpers import objectservers

    model = models().path("llama_bf16")
    local, local_stats, log = compare_with_default("llama_bf16", str(model), 2)
    assert "outputs" in local, log[-6000:]
    configs = tmp_path / "configs"
    configs.mkdir()
    for f in model.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (configs / f.name).write_bytes(f.read_bytes())
    with objectservers.make_server(scheme) as server:  # skips without the emulator
        server.make_bucket("models")
        for f in model.iterdir():
            if f.is_file():
                server.put("models", f"bf16/{f.name}", f.read_bytes())
        # the engine's only cloud settings: the server's
        objectservers.use_env(monkeypatch, server.env())
        server.reset_counts()
        # no gap read through (the rule's over-read on a model this small is most of it)
        report, stats, log = run_engine(
            str(configs),
            2,
            "--load-format",
            "shardload",
            "--digests",
            "--extra",
            json.dumps({"checkpoint": server.url("models", "bf16/")}),
            env={"SHARDLOAD_OBJECT_MAX_GAP_KB": "0"},
        )
        sent = server.bytes_sent("bf16/model.safetensors")
    assert "outputs" in report, log[-6000:]
    assert report["outputs"] == local["outputs"]  # tokens and top-5 logprobs, exactly
    assert report["digests"] == local["digests"]  # every parameter, bitwise
    first = [s for s in local_stats if not s["reload"]]
    assert [s["bytes_kept"] for s in stats] == [s["bytes_kept"] for s in first]
    # what the ranks keep (each rank, a process of its own, fetches the replicated tensors
    # and the header for itself), not a copy of the file per rank
    with open(model / "model.safetensors", "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    assert sent <= sum(s["bytes_kept"] for s in stats) + 2 * header


def _two_engines(model: str, tp: int, *args: str, verify: bool = True) -> tuple[dict, list, str]:
    """shardload's engine and the default loader's, as one report: vLLM's in-place reload is
    not faithful for its fused MoE layers on the CPU (its own default loader, reloaded, gives
    other expert weights than its first load), so a MoE compares two first loads."""
    mine, stats, log = run_engine(
        model,
        tp,
        "--load-format",
        "shardload",
        "--digests",
        *(["--verify"] if verify else []),
        *args,
    )
    assert "outputs" in mine, log[-6000:]
    theirs, _, their_log = run_engine(model, tp, "--load-format", "auto", "--digests", *args)
    assert "outputs" in theirs, their_log[-6000:]
    mine.update(default_outputs=theirs["outputs"], default_digests=theirs["digests"])
    return mine, stats, log


@pytest.mark.slow
@pytest.mark.vllm
# TP=2 under -m extended too: test_vllm_padding.py runs a MoE at the padded TP=3 by default
@pytest.mark.parametrize(
    "tp", [pytest.param(1, marks=pytest.mark.extended), pytest.param(2, marks=pytest.mark.extended)]
)
def test_shardload_loads_a_moe_as_vllms_default_loader_does(tp):
    report, stats, log = _two_engines(str(models().path("qwen2_moe_bf16")), tp)
    check_same_as_default(report, stats, log, tp)


@pytest.mark.slow
@pytest.mark.vllm
# -m extended: by default tests/test_vllm_padding.py's expert-parallel engine (TP=3) checks each
# rank's experts, verify on, which proves them what vLLM's narrowing takes; this adds vLLM's own
# loader's parameters and the in-place views, at TP=2
@pytest.mark.extended
def test_under_expert_parallelism_each_rank_reads_only_its_experts():
    """vLLM places experts 0-3 on rank 0 and 4-7 on rank 1; shardload's ranks read only
    those. (vLLM's CPU MoE kernels crash generating under expert parallelism, with its own
    loader too, so this compares the loaded parameters only.) Without verify: the stand-ins
    are views of the mapped file, of which vLLM copies only its experts."""
    report, stats, log = _two_engines(
        str(models().path("qwen2_moe_bf16")), 2, "--ep", "--tokens", "0", verify=False
    )
    check_same_as_default(report, stats, log, 2, verified=False)
    assert all(s["bytes_read_in_place"] == s["bytes_read"] for s in stats)
    assert [s["experts"] for s in stats] == ["ep", "ep"]
    import re

    names = list(open_checkpoint(str(models().path("qwen2_moe_bf16"))).metadata())
    expert = [int(m.group(1)) for n in names if (m := re.search(r"\.experts\.(\d+)\.", n))]
    for rank, s in enumerate(stats):  # vLLM's linear placement: 4 experts per rank
        others = sum(1 for e in expert if e // 4 != rank)
        assert s["tensors"] == len(names) - others


# ---- real weights: SmolLM2-135M ------------------------------------------------------------------


def _real(name: str) -> str:
    from helpers import vllm_real

    if name == "GPTQ":
        return str(vllm_real.smollm2_gptqmodel())
    return str(vllm_real.smollm2_hf() if name == "hf" else vllm_real.smollm2_quantized(name))


@functools.cache
def _smollm2_engine(name: str, tp: int) -> tuple[dict, list, str]:
    """SmolLM2 through shardload, compared with the default loader in the same engine: one
    engine per (name, tp) for the whole run (the padded test takes TP=1's tokens from it)."""
    from helpers.vllm_real import PROMPT

    return compare_with_default(name, _real(name), tp, "--text", PROMPT)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.real_model
@pytest.mark.parametrize(
    "name, tp",
    [
        # by default SmolLM2 runs through vLLM at the padded N=4 (the test below); these under
        # -m extended, with the README's TP=3 block
        pytest.param("hf", 3, marks=pytest.mark.extended),
        pytest.param("W8A8", 1, marks=pytest.mark.extended),
        pytest.param("hf", 1, marks=pytest.mark.extended),
        _case("W4A16", 1, extended=True),
    ],
)
def test_smollm2_answers_paris_through_vllm_with_shardload(name, tp):
    report, stats, log = _smollm2_engine(name, tp)
    check_same_as_default(report, stats, log, tp)
    assert report["outputs"][0]["text"].lstrip().startswith("Paris")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.real_model
@pytest.mark.parametrize(
    "name, tp",
    [
        ("hf", 2),
        pytest.param("hf", 4, marks=pytest.mark.extended),
        _case("W4A16", 2, extended=True),
        _case("GPTQ", 2, extended=True, marks=[pytest.mark.quant_tools]),
    ],
)
def test_smollm2_at_a_padded_n_is_the_exactly_padded_model_with_tp1s_tokens(name, tp):
    """vLLM refuses N=2 and 4 for 9 heads; shardload pads them to 12 query and 4 KV heads (at
    N=2 the smallest exact padding, 5 query heads a rank over 2 KV heads one of which two
    ranks share, is not a layout vLLM's attention holds: the planner takes the regular one),
    exact in vLLM's model, so with its --hf-overrides the engine gives the tokens of N=1; the
    same weights quantized W4A16 by compressed-tensors and GPTQ by GPTQModel (groups of 64:
    o_proj's 9 groups pad to 12, 6 a rank) too."""
    from helpers.vllm_real import PROMPT

    model = _real(name)
    overrides = vllm_overrides(model, tp)
    assert overrides == {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
    padded, stats, log = run_engine(
        model,
        tp,
        "--load-format",
        "shardload",
        "--verify",
        "--reload",
        "--hf-overrides",
        json.dumps(overrides),
        "--text",
        PROMPT,
    )
    assert "outputs" in padded, log[-6000:]
    padded_tensors = {s["padded_tensors"] for s in stats}  # q, k, v, o of 30 layers
    assert (
        padded_tensors == {120}
        if name == "hf"
        else len(padded_tensors) == 1 and min(padded_tensors) >= 120
    )
    # shardload's reload: the padded tensors read, the rest views of the file
    assert padded["reload_outputs"] == padded["outputs"]
    assert padded["reload_digests"] == padded["digests"]
    again = [s for s in stats if s["reload"]]
    assert len(again) == tp and all(s["bytes_read_in_place"] > 0 for s in again)
    # the ranks holding real heads read them into padded stand-ins; at N=4 rank 3's padded
    # heads are all zeros
    holding = [True] * tp if tp == 2 else [True] * 3 + [False]
    assert [s["bytes_read"] > s["bytes_read_in_place"] for s in again] == holding
    assert padded["outputs"][0]["text"].lstrip().startswith("Paris")
    if name != "hf":
        # vLLM's CPU int4 kernel quantizes activations over each rank's slice, so its tokens
        # depend on N with its own loader too (SmolLM2 W4A16: TP=3 leaves TP=1's tokens at the
        # 6th, " Paris" at logprob -0.61 against -1.21): the shards' exactness is the planner's
        # tests', and here vLLM runs the padded model and answers
        return
    one, _, log1 = _smollm2_engine(name, 1)  # vLLM's default loader's tokens at TP=1
    assert name not in RELOAD_UNFAITHFUL  # (so they come from its in-place reload)
    assert "default_outputs" in one, log1[-6000:]
    assert padded["outputs"][0]["tokens"] == one["default_outputs"][0]["tokens"]


@pytest.mark.real_model
def test_smollm2_overrides_name_every_padded_n():
    # the W8A8 checkpoint the README's example makes too: its heads are the bf16 model's
    proc = subprocess.run(
        [os.sys.executable, "-m", "shardload", "vllm-overrides", "--shards", "2", _real("W8A8")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
    }


# ---- verify catches a plan that is not vLLM's slice --------------------------------------------


@pytest.mark.slow
@pytest.mark.vllm
def test_verify_fails_naming_the_parameter_when_the_plan_is_not_vllms_slice(tmp_path):
    """A plan that gives each rank the other rank's query heads: vLLM would load wrong weights
    silently; verify names the fused parameter the poison reached."""
    model = str(models().path("llama_bf16"))
    plan = json.loads(
        subprocess.run(
            [os.sys.executable, "-m", "shardload", "plan", "--shards", "2", model],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=subprocess_env(),
            check=True,
        ).stdout
    )
    name = "model.layers.1.self_attn.q_proj.weight"
    assert plan[name][0][0] == "shardload.split_segments", plan[name]  # 8 heads of 32 rows
    plan[name] = [
        ["shardload.take_units", [[2, 128, 256], "bfloat16"], 0, 32, 4, 5, 6, 7, 0, 1, 2, 3]
    ]
    (tmp_path / "swapped.json").write_text(json.dumps(plan))
    report, stats, log = run_engine(
        model,
        2,
        "--load-format",
        "shardload",
        "--verify",
        "--extra",
        json.dumps({"plan": str(tmp_path / "swapped.json")}),
    )
    assert report.get("returncode"), "the engine should have failed"
    assert "VerifyError: verify failed on rank 0" in log
    assert "model.layers.1.self_attn.qkv_proj.weight (" in log
