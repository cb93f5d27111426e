"""``--load-format shardload`` under pipeline parallelism (``--pipeline-parallel-size``).

Each stage reads, keeps and reports only the tensors its model holds (``shardload/vllm/
stages.py``): its decoder layers, the embeddings on the first stage, the final norm and
``lm_head`` on the last. The unit tests at the top need no vLLM: they build module trees the
way vLLM builds a stage's model (a placeholder for every module another stage holds) and check
which checkpoint names each stage takes. The engine test runs two stages of a GPTQ Llama
through shardload (verify on), then vLLM's default loader and shardload again in the same
engine, and compares parameters and tokens bitwise; each stage's statistics against the
checkpoint's header, read here.

vLLM runs from the environment ``scripts/vllm-env.sh`` makes (as ``tests/test_vllm.py``):
without it the engine test skips, unless ``SHARDLOAD_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import REPO
from helpers.subprocesses import subprocess_env
from torch import nn

from shardload import REPLICATE, ArrayCheckpoint
from shardload.frontdoor import resolve_plan
from shardload.readplan import read_plan_for
from shardload.vllm.stages import Stage, layer_range, placeholders

# ---- without vLLM: which checkpoint tensors a stage holds ----------------------------------------


class Missing(nn.Identity):
    """Stands for vLLM's ``PPMissingLayer``: a module another stage holds."""


class _Layer(nn.Module):
    """A decoder layer as vLLM builds it: fused ``qkv_proj`` and ``gate_up_proj``."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = nn.Linear(4, 12)
        self.self_attn.o_proj = nn.Linear(4, 4)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = nn.Linear(4, 16)
        self.mlp.down_proj = nn.Linear(8, 4)
        self.input_layernorm = nn.LayerNorm(4)
        self.post_attention_layernorm = nn.LayerNorm(4)


def _bounds(layers: int, stages: int, stage: int) -> tuple[int, int]:
    per = layers // stages
    return stage * per, layers if stage == stages - 1 else (stage + 1) * per


def _stage_model(
    stage: int, stages: int, layers: int, tied: bool = False, keep_range: bool = True
) -> nn.Module:
    """Stage ``stage`` of ``stages`` of a Llama as vLLM's ``LlamaForCausalLM`` builds it."""
    first, last = stage == 0, stage == stages - 1
    start, end = _bounds(layers, stages, stage)
    top = nn.Module()
    top.model = nn.Module()
    top.model.embed_tokens = nn.Embedding(8, 4) if first or (tied and last) else Missing()
    top.model.layers = nn.ModuleList(
        _Layer() if start <= i < end else Missing() for i in range(layers)
    )
    if keep_range:
        top.model.start_layer, top.model.end_layer = start, end
    top.model.norm = nn.LayerNorm(4) if last else Missing()
    top.lm_head = (top.model.embed_tokens if tied else nn.Linear(4, 8)) if last else Missing()
    return top


def _checkpoint_names(layers: int, tied: bool = False) -> list[str]:
    """A GPTQ Llama's tensor names, in Hugging Face's naming."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    names += [] if tied else ["lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            names += [f"{p}{proj}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")]
    return names


def _stage(model: nn.Module, stage: int, stages: int, rename=None) -> Stage:
    kinds = (Missing,)
    return Stage(
        stage, stages, placeholders(model.named_modules(), kinds), layer_range(model, kinds), rename
    )


def _expected(name: str, stages: int, layers: int, tied: bool) -> set[int]:
    """The stages that need checkpoint tensor ``name``, from its name alone."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        return {
            s
            for s in range(stages)
            if _bounds(layers, stages, s)[0] <= layer < _bounds(layers, stages, s)[1]
        }
    if name.startswith("model.embed_tokens."):
        return {0, stages - 1} if tied else {0}
    return {stages - 1}  # the final norm, lm_head


@pytest.mark.parametrize(
    "stages, layers, tied",
    [(2, 2, False), (2, 12, False), (3, 12, False), (4, 13, True), (2, 12, True)],
)
def test_each_stage_holds_its_layers_and_the_ends_of_the_model(stages, layers, tied):
    # 12 layers: model.layers.1. must not take model.layers.11's tensors
    names = _checkpoint_names(layers, tied)
    held = {
        s: _stage(_stage_model(s, stages, layers, tied), s, stages).names(names)
        for s in range(stages)
    }
    for name in names:
        assert {s for s in range(stages) if name in held[s]} == _expected(
            name, stages, layers, tied
        ), name
    # every tensor on some stage; a tensor two stages need (tied embeddings) on both
    assert sum(len(h) for h in held.values()) == len(names) + (tied and stages > 1)
    for s in range(stages):
        assert held[s] == [n for n in names if n in held[s]]  # in the checkpoint's order


def test_the_layer_range_is_the_models_own_or_read_from_its_layer_list():
    for stage, want in [(0, (0, 6)), (1, (6, 12))]:
        assert _stage(_stage_model(stage, 2, 12), stage, 2).describe() == {
            "pp_rank": stage,
            "pp_size": 2,
            "layers": list(want),
        }
        # a model without start_layer / end_layer: the members of its list of layers
        assert layer_range(_stage_model(stage, 2, 12, keep_range=False), (Missing,)) == want
    assert layer_range(nn.Linear(2, 2), (Missing,)) is None


def test_a_renamed_checkpoint_is_judged_by_vllms_names():
    # a model whose hf_to_vllm_mapper moves the language model under "language_model."
    model = nn.Module()
    model.language_model = _stage_model(1, 2, 4)
    stage = _stage(model, 1, 2, rename=lambda n: "language_model." + n)
    assert stage.missing[0] == "language_model.model.embed_tokens."
    assert stage.names(_checkpoint_names(4)) == [
        n for n in _checkpoint_names(4) if _expected(n, 2, 4, False) == {1}
    ]
    dropped = _stage(model, 1, 2, rename=lambda n: None)  # what vLLM ignores: as written
    assert dropped.holds("model.norm.weight") and dropped.holds("model.embed_tokens.weight")


def test_restrict_keeps_only_the_stages_pieces_of_a_read_plan():
    rng = np.random.default_rng(0)
    names = _checkpoint_names(2)
    ckpt = ArrayCheckpoint({n: rng.standard_normal(8).astype(np.float32) for n in names})
    stage = _stage(_stage_model(0, 2, 2), 0, 2)
    plan = read_plan_for(resolve_plan(ckpt, 2, REPLICATE).validated, ckpt, 1)
    mine = stage.restrict(plan)
    assert [p.name for p in mine.pieces] == stage.names(names)
    assert mine.pieces == tuple(p for p in plan.pieces if stage.holds(p.name))
    assert (mine.rank, mine.num_shards, mine.sources) == (plan.rank, 2, plan.sources)
    assert mine.nbytes == mine.bytes_read == 8 * 4 * len(stage.names(names)) < plan.nbytes
    assert Stage(0, 1, ()).restrict(plan) is plan  # a stage holding everything


# ---- in vLLM -------------------------------------------------------------------------------------


def _header(model: Path) -> dict[str, int]:
    """{name: bytes} of every tensor, from the safetensors header, read here."""
    sizes: dict[str, int] = {}
    for file in sorted(model.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        header.pop("__metadata__", None)
        sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()})
    return sizes


@functools.cache
def _engine(name: str, tp: int, pp: int) -> tuple[dict, list, str]:
    from helpers import vllm_engine, vllm_models

    return vllm_engine.launch(
        str(vllm_models.path(name)),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--load-format",
        "shardload",
        "--verify",
        "--compare-default",
        env=subprocess_env(VLLM_CPU_KVCACHE_SPACE="1"),
        cwd=REPO,
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(
    "tp",
    [
        # two stages of one rank by default (~35 s on 2 cores); two stages of two ranks, four
        # worker processes (~80 s), under -m extended
        1,
        pytest.param(2, marks=pytest.mark.extended),
    ],
)
def test_each_stage_reads_only_its_layers_and_loads_what_vllms_default_loader_loads(tp):
    """Two stages: shardload's load (verified), then vLLM's default loader and shardload again
    reloading in place, in one engine. Tokens are compared too: vLLM 0.32's CPU runner cannot
    generate under pipeline parallelism in eager mode, with its own loader too (a later
    stage's first step fails, ``assert self.intermediate_tensors is not None``), so the
    engine helper gives later stages the activation buffers vLLM's skipped warm-up would
    (``devtools.vllm_engine._pipeline_buffers``). With them, two stages generate what one does
    (checked by hand on ``llama_bf16`` with vLLM's own loader: the same tokens and
    log-probabilities)."""
    from helpers import vllm_models
    from helpers.vllm_engine import int4_kernel_missing

    # GPTQ in stages; where vLLM's CPU build has no int4 kernel (a CPU without AVX-512), bf16,
    # so that the stages are checked on every machine
    pp, name = 2, "llama_gptq" if int4_kernel_missing() is None else "llama_bf16"
    model = vllm_models.path(name)
    config = json.loads((model / "config.json").read_text())
    layers, tied = config["num_hidden_layers"], config.get("tie_word_embeddings", False)
    report, stats, log = _engine(name, tp, pp)
    assert "outputs" in report, log[-6000:]
    assert report["outputs"] == report["default_outputs"]  # tokens and top-5 logprobs
    assert report["digests"] == report["default_digests"]  # every parameter, bitwise
    assert report["reload_outputs"] == report["outputs"]
    assert report["reload_digests"] == report["digests"]
    # vLLM's own placement: the first stage has the embeddings, the last lm_head
    first_ranks, last_ranks = report["digests"][:tp], report["digests"][-tp:]
    assert all("model.embed_tokens.weight" in d and "lm_head.weight" not in d for d in first_ranks)
    assert all("lm_head.weight" in d and "model.embed_tokens.weight" not in d for d in last_ranks)

    sizes = _header(model)
    total = sum(sizes.values())
    held = {s: [n for n in sizes if s in _expected(n, pp, layers, tied)] for s in range(pp)}
    assert sum(len(h) for h in held.values()) == len(sizes)  # each tensor once
    for reload in (False, True):
        lines = sorted(
            (s for s in stats if s["reload"] is reload), key=lambda s: (s["pp_rank"], s["rank"])
        )
        assert [(s["pp_rank"], s["rank"]) for s in lines] == [
            (p, r) for p in range(pp) for r in range(tp)
        ], log[-6000:]
        for p in range(pp):
            ranks = [s for s in lines if s["pp_rank"] == p]
            assert {s["pp_size"] for s in ranks} == {pp}
            assert [s["layers"] for s in ranks] == [list(_bounds(layers, pp, p))] * tp
            # each stage's ranks: the tensors of its own modules, none of another stage's
            assert [s["tensors"] for s in ranks] == [len(held[p])] * tp
            # the stage's split tensors' pieces add up to the whole, its replicated ones are
            # whole on each rank: the stage's bytes in the header, counted here
            replicated = {s["bytes_replicated"] for s in ranks}
            assert len(replicated) == 1
            assert sum(
                s["bytes_kept"] - s["bytes_replicated"] for s in ranks
            ) + replicated.pop() == sum(sizes[n] for n in held[p])
            for s in ranks:
                assert s["bytes_read"] <= 0.6 * total and s["bytes_kept"] <= 0.6 * total
                assert s["bytes_read"] <= 1.05 * s["bytes_kept"]
                assert s["verified"] is not reload
                assert not reload or s["bytes_read_in_place"] > 0
