"""The architectures beyond Llama the planner knows (``planners.architectures.ARCHITECTURES``):
Gemma 2, Gemma 3 (text, and multimodal with its language model under ``text_config``),
Phi-3 / Phi-4, OLMo-2 and Granite, each as transformers saves it.

Each test saves a tiny random model with transformers (``save_pretrained`` of a config of
``helpers.architecture_configs``), plans and loads it
over N workers, and compares every worker's every tensor with a reference written here from the
rules (``helpers.tp_reference``: vLLM's GQA layout, and the zero-padding rule), not from the
planner: which module is column- or row-parallel, where a fused tensor's segments lie (read
from transformers' modeling code), which norms are replicated and which split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from click.testing import CliRunner
from helpers.architecture_configs import CONFIGS, HEADS, HIDDEN, INTER, KV_HEADS, VOCAB
from helpers.compressed_tensors_tool import compress_w4a16, dequant
from helpers.loads import plan_and_load
from helpers.tp_reference import layer_piece, padded_heads, padded_units, rows_of, take
from safetensors.torch import load_file, save_file

from shardload import FormatError, PlanError
from shardload.cli import cli
from shardload.planners import plan_for
from shardload.planners.architectures import ARCHITECTURES
from shardload.planners.naming import HF
from shardload.planners.roles import ROLES
from shardload.planners.spec import spec_from_hf

UNPADDED = (1, 2, 4)  # 4 workers replicate each of the 2 KV heads to 2 of them
PADDED = 3  # 4 query heads over 3 workers: zero-padded
#: the language model's tensors in a multimodal Gemma 3 checkpoint: as the hub's checkpoints
#: (and transformers 5) name them, and as transformers 4.52 to 4.57 saved them
GEMMA3_LM = ("language_model.", "model.language_model.", "lm_head.")


def save_model(folder: Path, arch: str, rename_v4: bool = False):
    """A tiny random ``arch`` model saved by transformers; returns its config."""
    config = CONFIGS[arch]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if rename_v4:  # transformers 4.52-4.57: model.language_model.*, model.vision_tower.*
        path = str(folder / "model.safetensors")
        stored = load_file(path)
        renamed = {
            (
                "model.language_model." + k[len("language_model.model.") :]
                if k.startswith("language_model.model.")
                else "model." + k
                if not k.startswith("lm_head.")
                else k
            ): v
            for k, v in stored.items()
        }
        save_file(renamed, path, metadata={"format": "pt"})
    return config


# ---- the reference: which rows and columns worker i holds, from the rules ----------------------


class Geometry:
    """The sizes of the language model, from the config transformers wrote."""

    def __init__(self, config):
        text = getattr(config, "text_config", None) or config
        self.heads, self.kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.heads
        self.inter = text.intermediate_size
        self.q, self.kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.model_type = config.model_type


def role_of(name: str, g: Geometry):
    """(module kind, how it splits) for a tensor, or None: replicated."""
    if g.model_type == "gemma3" and not name.startswith(GEMMA3_LM):
        return None  # vision tower, projector: replicated
    module = name.rsplit(".", 2)[-2]
    if module in ("q_norm", "k_norm") and g.model_type != "olmo2":
        return None  # Gemma 3's per-head norms (head_dim wide): every head uses them all
    return (
        module
        if module
        in (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "qkv_proj",
            "gate_up_proj",
            "q_norm",
            "k_norm",
        )
        else None
    )


def segments(module: str, g: Geometry):
    """[(rows, units, replicable, kind)] along the split axis; kind: q, kv or mlp."""
    q, kv = (g.q, g.heads, False, "q"), (g.kv, g.kv_heads, True, "kv")
    mlp = (g.inter, g.inter, False, "mlp")
    return {
        "q_proj": [q],
        "o_proj": [q],
        "q_norm": [q],
        "k_proj": [kv],
        "v_proj": [kv],
        "k_norm": [kv],
        "qkv_proj": [q, kv, kv],
        "gate_proj": [mlp],
        "up_proj": [mlp],
        "down_proj": [mlp],
        "gate_up_proj": [mlp, mlp],
    }[module]


def expected(name: str, w: torch.Tensor, n: int, i: int, g: Geometry, padded=None) -> torch.Tensor:
    """Worker i's piece of the dense tensor ``name``; ``padded``: (q heads, KV heads, MLP
    rows) per worker, for a zero-padded N."""
    module = role_of(name, g)
    if module is None:
        return w
    axis = 1 if module in ("o_proj", "down_proj") else 0
    return layer_piece(w, axis, segments(module, g), n, i, g.head_dim, padded)


def check_every_shard(folder: Path, config, n: int) -> None:
    g = Geometry(config)
    dense = load_file(str(folder / "model.safetensors"))
    info, sharded = plan_and_load(folder, n)
    padded = None
    if n == PADDED:
        layout = info.metadata["tensor_parallel"]
        q_heads, kv_heads = padded_heads(g.heads, g.kv_heads, n)
        assert (layout["q_heads"], layout["kv_heads"]) == (q_heads, kv_heads)
        padded = q_heads, kv_heads, padded_units(g.inter, n)
    else:
        assert "tensor_parallel" not in info.metadata
    assert sorted(sharded.names) == sorted(dense)
    split = 0
    for i in range(n):
        worker = sharded.worker(i)
        for name, w in dense.items():
            want = expected(name, w, n, i, g, padded)
            assert torch.equal(worker[name], want), (name, i, n)
            split += want.shape != w.shape
    if n > 1:  # every projection and, for OLMo-2, its q/k norms were split
        projections = sum(1 for name in dense if role_of(name, g) is not None)
        assert split >= projections


# ---- every architecture, every worker, every tensor ----------------------------------------------


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_shard_is_its_slice(tmp_path, arch):
    config = save_model(tmp_path, arch)
    for n in (*UNPADDED, PADDED):
        check_every_shard(tmp_path, config, n)


def test_gemma3_multimodal_with_transformers_4_names(tmp_path):
    # transformers 4.52-4.57 saved Gemma3ForConditionalGeneration as model.language_model.*,
    # model.vision_tower.*, model.multi_modal_projector.*
    config = save_model(tmp_path, "gemma3", rename_v4=True)
    names = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("model.language_model.layers.") for k in names)
    assert any(k.startswith("model.vision_tower.") for k in names)
    for n in (2, PADDED):
        check_every_shard(tmp_path, config, n)


def test_vision_tower_is_replicated(tmp_path):
    save_model(tmp_path, "gemma3")
    steps = plan_for(str(tmp_path), 2).steps
    assert steps and all(k.startswith("language_model.model.layers.") for k in steps)


def test_gemma3_text_config_sizes_default_as_in_transformers(tmp_path):
    # gemma-3-4b-it's config.json leaves num_attention_heads, num_key_value_heads, head_dim
    # and vocab_size out of text_config: Gemma3TextConfig's defaults apply
    spec = spec_from_hf(
        {
            "model_type": "gemma3",
            "text_config": {
                "hidden_size": 2560,
                "intermediate_size": 10240,
                "model_type": "gemma3_text",
                "num_hidden_layers": 34,
            },
        },
        "config.json",
    )
    defaults = transformers.Gemma3TextConfig()
    assert (
        (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size)
        == (
            defaults.num_attention_heads,
            defaults.num_key_value_heads,
            defaults.head_dim,
            defaults.vocab_size,
        )
        == (8, 4, 256, 262208)
    )
    assert spec.explain("num_heads") == (
        "'text_config.num_attention_heads' (absent, so its default 8) = 8"
    )
    # a default the tensors contradict is refused, naming the key
    save_model(tmp_path, "gemma3")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["text_config"]["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        FormatError,
        match=r"'text_config.num_attention_heads' \(absent, so its "
        r"default 8\)",
    ):
        plan_for(str(tmp_path))


def test_text_config_fields_are_typed(tmp_path):
    save_model(tmp_path, "gemma3")
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["num_key_value_heads"] = "2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="key 'text_config.num_key_value_heads' is '2'"):
        plan_for(str(tmp_path))


def test_roles_agree_with_transformers_tp_plans():
    # the planner keeps its own table (transformers is not a dependency); transformers' own
    # base_model_tp_plan must not contradict it: colwise modules are column-parallel, rowwise
    # row-parallel, replicated ones never split
    for model_type in ARCHITECTURES:
        cls = transformers.AutoConfig.for_model(model_type).__class__
        plan = cls.base_model_tp_plan
        if plan is None:  # multimodal: the language model's config says
            plan = cls.sub_configs["text_config"].base_model_tp_plan
        assert plan, model_type
        arch = ARCHITECTURES[model_type]
        split_norms = arch.split_norms
        for pattern, style in plan.items():
            if ".experts" in pattern:  # transformers 5 fuses experts in memory only: it saves
                continue  # them per expert (w1/w2/w3, gate/up/down_proj)
            last = pattern.rsplit(".", 1)[-1]
            role = arch.roles.get(last) or HF.base_role(last) or split_norms.get(last)
            if style.startswith("colwise"):
                assert ROLES[role].column or (role in ("q", "k") and last in split_norms), (
                    model_type,
                    pattern,
                )
            elif style.startswith("rowwise"):
                assert not ROLES[role].column, (model_type, pattern)
            elif style == "embedding_rowwise":  # vocab-parallel, where asked for
                assert role == "embed", (model_type, pattern)
            else:
                # mla_kv_a_proj: the latent projection's weight is replicated (the style only
                # averages the rope part's gradient)
                assert (style.startswith("replicated") or style == "mla_kv_a_proj") and (
                    role is None
                ), (model_type, pattern)


# ---- Phi-3: fused layers, compressed by compressed-tensors itself ------------------------------


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_phi3_w4a16_shards_dequantize_to_their_slice(tmp_path, symmetric):
    config = transformers.Phi3Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    args = compress_w4a16(tmp_path, config, symmetric)
    stored = load_file(str(tmp_path / "model.safetensors"))
    layers = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_packed")})
    assert [layer.rsplit(".", 1)[1] for layer in layers] == [
        "down_proj",
        "gate_up_proj",
        "o_proj",
        "qkv_proj",
    ]
    g = Geometry(config)
    for n in (*UNPADDED, PADDED):
        info, sharded = plan_and_load(tmp_path, n)
        padded = None
        if n == PADDED:  # the MLP pads in whole groups: down_proj's K, groups of 32
            block = info.metadata["tensor_parallel"]["mlp_block"]
            assert block == 32
            mlp = [
                [
                    r
                    for u in units
                    for r in (range(u * block, (u + 1) * block) if u >= 0 else [-1] * block)
                ]
                for units in padded_units(g.inter // block, n)
            ]
            padded = (*padded_heads(g.heads, g.kv_heads, n), mlp)
        for layer in layers:
            full = dequant(stored, layer, args)
            for i in range(n):
                piece = {k: sharded.shard(k, i) for k in stored if k.startswith(layer + ".")}
                assert torch.equal(
                    dequant(piece, layer, args), expected(layer + ".weight", full, n, i, g, padded)
                ), (layer, i, n)


# ---- the shards compute the model ----------------------------------------------------------------


def _worker_config(config, n: int):
    """The config of one worker's share of a layer: heads, KV heads and MLP divided by n."""
    text = config.to_dict()
    text.update(
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,
        intermediate_size=config.intermediate_size // n,
        head_dim=config.hidden_size // config.num_attention_heads,
    )
    return type(config)(**text)


def test_phi3_layers_forward_equal_at_2_workers(tmp_path):
    # each worker runs transformers' own Phi3Attention and Phi3MLP on its shards alone (fused
    # qkv sliced as [q_i, k_i, v_i], gate_up as [gate_i, up_i]); their outputs summed (the
    # all-reduce after the row-parallel o_proj and down_proj) are the full layer's
    from transformers.models.phi3 import modeling_phi3 as phi3

    n = 2
    config = save_model(tmp_path, "phi3")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    _, sharded = plan_and_load(tmp_path, n)
    part = _worker_config(model.config, n)
    part._attn_implementation = "eager"  # the same attention code as the whole model's
    torch.manual_seed(1)
    x = torch.randn(1, 5, config.hidden_size)
    rope = model.model.rotary_emb(x, torch.arange(5)[None])
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            prefix = f"model.layers.{layer}."
            attn = block.self_attn(x, position_embeddings=rope, attention_mask=None)[0]
            mlp = block.mlp(x)
            got_attn, got_mlp = torch.zeros_like(attn), torch.zeros_like(mlp)
            for i in range(n):
                w = {
                    k[len(prefix) :]: v
                    for k, v in sharded.worker(i).items()
                    if k.startswith(prefix)
                }
                a = phi3.Phi3Attention(part, layer)
                a.load_state_dict(
                    {
                        "qkv_proj.weight": w["self_attn.qkv_proj.weight"],
                        "o_proj.weight": w["self_attn.o_proj.weight"],
                    }
                )
                m = phi3.Phi3MLP(part)
                m.load_state_dict(
                    {
                        "gate_up_proj.weight": w["mlp.gate_up_proj.weight"],
                        "down_proj.weight": w["mlp.down_proj.weight"],
                    }
                )
                got_attn += a(x, position_embeddings=rope, attention_mask=None)[0]
                got_mlp += m(x)
            torch.testing.assert_close(got_attn, attn, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_mlp, mlp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 4, PADDED])
def test_olmo2_split_norms_compute_the_whole_projection_norm(tmp_path, n):
    # OLMo-2 normalises the whole q (k) projection. Worker i holds its q (k) rows and the norm
    # weights of those rows; the engine sums the squares of its rows over the workers (each KV
    # head counted once where KV heads are replicated; padded rows are zero and add nothing),
    # divides by the projection's real width, and scales its own rows: exactly the full norm's
    # rows of that worker, zeros for padded heads.
    config = save_model(tmp_path, "olmo2")
    g = Geometry(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    info, sharded = plan_and_load(tmp_path, n)
    if n == PADDED:
        q_heads, kv_heads = padded_heads(g.heads, g.kv_heads, n)
        assert info.metadata["tensor_parallel"]["projection_norms"] == {
            "q_norm": g.q,
            "k_norm": g.kv,
        }
    else:

        def heads(rows: slice):
            return list(range(rows.start // g.head_dim, rows.stop // g.head_dim))

        q_heads = [heads(rows_of(n, i, g.q, g.heads, False)) for i in range(n)]
        kv_heads = [heads(rows_of(n, i, g.kv, g.kv_heads, True)) for i in range(n)]
    torch.manual_seed(1)
    x = torch.randn(1, 5, config.hidden_size)
    attn = model.model.layers[0].self_attn
    prefix = "model.layers.0.self_attn."
    with torch.no_grad():
        for proj, norm, worker_heads, width in (
            ("q_proj", "q_norm", q_heads, g.q),
            ("k_proj", "k_norm", kv_heads, g.kv),
        ):
            full = getattr(attn, norm)(getattr(attn, proj)(x))
            local = [x @ sharded.shard(prefix + proj + ".weight", i).T for i in range(n)]
            seen, squares = set(), torch.zeros(x.shape[:-1])
            for i, heads in enumerate(worker_heads):
                for slot, head in enumerate(heads):
                    if head >= 0 and head not in seen:
                        seen.add(head)
                        rows = local[i][..., slot * g.head_dim : (slot + 1) * g.head_dim]
                        squares += rows.pow(2).sum(-1)
            scale = torch.rsqrt(squares / width + config.rms_norm_eps)[..., None]
            for i, heads in enumerate(worker_heads):
                got = local[i] * scale * sharded.shard(prefix + norm + ".weight", i)
                want = torch.from_numpy(take(full.numpy(), heads, g.head_dim, -1))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_cli_plans_and_loads(tmp_path, arch):
    folder = tmp_path / "model"
    save_model(folder, arch)
    plan = tmp_path / "plan.json"
    runner = CliRunner()
    result = runner.invoke(cli, ["plan", "--shards", "2", str(folder), "-o", str(plan)])
    assert result.exit_code == 0, result.output
    assert plan.exists()
    for args in (["--shards", "2", "--shard-info", str(plan)], ["--shards", str(PADDED)]):
        result = runner.invoke(cli, ["load", *args, "--json", str(folder)])
        assert result.exit_code == 0, result.output


def test_plan_help_lists_every_architecture():
    text = CliRunner().invoke(cli, ["plan", "--help"], terminal_width=200).output
    for model_type in ARCHITECTURES:
        assert model_type in text, model_type


def test_unknown_model_type_names_the_known_ones(tmp_path):
    save_model(tmp_path, "granite")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        PlanError,
        match="'gpt_neox' is not supported.*gemma2, gemma3, gemma3_text, gpt_oss, granite, llama",
    ):
        plan_for(str(tmp_path))


def test_padded_layouts_are_checked_by_an_independent_rule():
    # the reference padding rule itself, on the shapes tested above
    assert padded_heads(HEADS, KV_HEADS, PADDED) == ([[0, 1], [2, 3], [-1, -1]], [[0], [1], [-1]])
    assert [len(u) for u in padded_units(INTER, PADDED)] == [43, 43, 43]
    assert np.array_equal(take(np.arange(6).reshape(1, 6), [2, -1], 2, 1), [[4, 5, 0, 0]])


def test_olmo2_norm_of_the_wrong_shape_is_refused(tmp_path):
    save_model(tmp_path, "olmo2")
    path = str(tmp_path / "model.safetensors")
    stored = load_file(path)
    stored["model.layers.0.self_attn.q_norm.weight"] = torch.ones(HIDDEN // 2, 2)
    save_file(stored, path, metadata={"format": "pt"})
    with pytest.raises(
        FormatError,
        match=r"q_norm weight is one vector over the projection's "
        r"64 rows",
    ):
        plan_for(str(tmp_path))


def test_gemma3_without_a_language_model_is_refused(tmp_path):
    # model_type gemma3 with its tensors named as a text-only model's: nothing would be split
    save_model(tmp_path, "gemma3_text")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": config})
    )
    with pytest.raises(PlanError, match="no projection or embedding there"):
        plan_for(str(tmp_path))
