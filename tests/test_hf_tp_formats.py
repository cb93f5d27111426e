"""``load_tp_model`` on the quantized formats ``test_hf_tp_model.py`` does not cover: DeepSeek block
FP8, ModelOpt NVFP4, GPTQ (v1, plain and act-order) and AWQ GEMM. The logits and greedy tokens of
the model split over N workers equal those of transformers' own unsharded model of the same
checkpoint, with each format's most independent reference:

* **DeepSeek block FP8** (``quant_method: fp8``, ``weight_scale_inv`` per 128x128 block): the
  checkpoint is written by transformers' own FP8 quantizer (``helpers.deepseek_fp8_tool``; the
  DeepSeek-V3 of ``helpers.deepseek_configs.fp8_config``, whose 192-row heads straddle the
  128-row blocks), and the reference is transformers' own ``from_pretrained`` of that folder:
  on a machine without a GPU it dequantizes the weights at load time (with one,
  ``FineGrainedFP8Config(dequantize=True)`` is asked for;
  ``test_transformers_fp8_load_is_the_exact_dequantization`` pins that both give exactly the
  float32 block dequantization, not bf16).
  The same tensors under DeepSeek's own four-field ``quantization_config`` too. N = 1..4; at
  N = 3 the 8 heads, which split in 4 pairs (two heads fill three whole blocks), are zero-padded
  to 6 pairs.
* **ModelOpt NVFP4** (Llama; Phi-3, fused ``qkv_proj`` / ``gate_up_proj``; Qwen3-MoE, experts
  one tensor each): exported by ModelOpt itself
  (``helpers.modelopt_tool.cached_modelopt_nvfp4``, the configs of ``helpers.modelopt_configs``,
  cached per machine); the reference is transformers' model of the export's config whose every
  quantized weight is ModelOpt's own ``NVFP4QTensor.dequantize`` of the stored tensors. N = 1..4
  (3 zero-pads the heads and MLP blocks; Qwen3-MoE's 32-row experts are zero-padded at 4 too).
* **GPTQ v1, 4-bit, group 32** (AutoGPTQ's ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``) and
  **AWQ GEMM, 4-bit, group 32**: a tiny random Llama (norms randomised, float tensors fp16 as
  those tools store them) whose linear weights are quantized by the project's independent
  reference codecs (``helpers.quant_refs``: numpy, no shardload code); the reference is that
  transformers model with every linear weight replaced by the same codecs' ``dequantize_gptq``
  / ``dequantize_awq``. GPTQ also with act-order (``desc_act``, a random ``perm`` per layer,
  so ``g_idx`` reorders rows) and asymmetric with biases on every linear (v1's ``z - 1``, row-
  parallel biases). N = 1, 2, 4, and 3, where the MLP's 8 groups zero-pad to 9 (the zero rows
  in zero-scaled groups of their own, act-order or not).
* **GPTQ written by GPTQModel** (``helpers.gptqmodel_tool``, in the environment
  ``scripts/quant-tools-env.sh`` makes): the same random Llama quantized by the tool people
  quantize with, trivial ``g_idx`` and act-order; the reference holds ``quant_refs``'
  ``dequantize_gptq`` of the tool's stored tensors. vLLM 0.32 refuses act-order GPTQ at every
  N with its own loader, so this is where act-order from a real tool is proven padded at N = 3.

Norms (and DeepSeek-V3's router bias) are randomised in every checkpoint (in the FP8 tool's
output and in a copy of ModelOpt's export, rewritten in their stored dtype, every quantized
tensor untouched), so that a norm taken from the wrong place would show. The check is
``test_hf_tp_model``'s: logits within 1e-3 (max abs difference over max abs of the reference,
float32) and the 16 greedy tokens identical, on a ``ThreadedSession``; the plan kind (unpadded /
padded) is asserted, and a refused N must raise ``PlanError`` naming its cause and listing the
N that work. ``ProcessSession`` at one N per format (slow). Run with ``-s`` for the parity
table.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers.deepseek_configs import fp8_config
from helpers.deepseek_fp8_tool import DEEPSEEK_QUANT_CONFIG, write_deepseek_fp8
from helpers.deepseek_fp8_tool import dequantize as fp8_dequantize
from helpers.hf_parity import (
    NEW_TOKENS,
    PROMPT,
    QUANT_SIZES,
    TOLERANCE,
    Reference,
    answers,
    randomise,
    relative,
)
from helpers.modelopt_configs import CONFIGS as MODELOPT_CONFIGS
from helpers.modelopt_tool import cached_modelopt_nvfp4
from helpers.modelopt_tool import dequantize as nvfp4_dequantize
from helpers.quant_refs.awq import dequantize_awq, quantize_awq
from helpers.quant_refs.gptq import dequantize_gptq, quantize_gptq
from safetensors.torch import load_file, save_file

from shardload import ProcessSession, ThreadedSession
from shardload.hf import TPModel, load_tp_model
from shardload.planners import plan_decision

pytestmark = pytest.mark.filterwarnings(
    "ignore:You passed `quantization_config`:UserWarning"
)  # dequantize=True over the config's

U, P = "unpadded", "padded"
#: case -> the plan kind at N = 1, 2, 3, 4
KINDS = {
    # 192-row heads in 128-row blocks: at 3 the 4 pairs of heads pad to 6 (two heads, three
    # whole blocks, per run)
    "deepseek_fp8": (U, U, P, U),
    "deepseek_fp8_ds_config": (U, U, P, U),
    "modelopt_nvfp4_llama": (U, U, P, U),
    "modelopt_nvfp4_phi3": (U, U, P, U),  # fused qkv_proj and gate_up_proj
    "modelopt_nvfp4_qwen3_moe": (U, U, P, P),  # 32-row experts: 2 groups of 16 over 4
    # zero rows of down_proj in zero-scaled groups of their own, act-order or not
    "gptq_g32": (U, U, P, U),
    "gptq_g32_act_order": (U, U, P, U),
    "gptq_g32_asym_bias": (U, U, P, U),
    "awq_g32": (U, U, P, U),
    # written by GPTQModel itself (vLLM 0.32 refuses desc_act=True at any N: this is its proof)
    "gptqmodel_g32": (U, U, P, U),
    "gptqmodel_g32_act_order": (U, U, P, U),
    # 32-row heads in groups of 64: o_proj and its g_idx split and pad in pairs of heads (N=4
    # gives each worker one pair, real or zero); the query heads then read their KV heads out
    # of transformers' regular pattern on some workers (each gets its own copy). Act-order
    # keeps every scale on every worker, so N=4 splits single heads unpadded; N=3 pads pairs
    "gptqmodel_g64": (U, U, P, P),
    "gptqmodel_g64_act_order": (U, U, P, U),
}
#: what a refused N's PlanError says, per case
GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: one N per format for ProcessSession (slow)
PROCESS_CASES = [
    ("deepseek_fp8", 2),
    ("modelopt_nvfp4_qwen3_moe", 3),
    ("gptq_g32_act_order", 2),
    ("awq_g32", 3),
]


# ---- checkpoints -------------------------------------------------------------------------------


def _rewrite(folder: Path, change) -> None:
    """``change(tensors)`` applied to ``folder/model.safetensors`` in place (metadata kept)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _randomise_stored(tensors: dict, seed: int) -> None:
    """Norm weights ~ N(1, 0.1) and DeepSeek-V3's router bias ~ N(0, 0.01), in their stored dtype
    (they are 1 and 0 in a fresh model; ``helpers.hf_parity.randomise`` on a stored file)."""
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        t = tensors[name]
        if "norm" in name and name.endswith(".weight"):
            values = 1.0 + 0.1 * torch.randn(t.shape, generator=generator)
        elif name.endswith("e_score_correction_bias"):
            values = 0.01 * torch.randn(t.shape, generator=generator)
        else:
            continue
        tensors[name] = values.to(t.dtype)


def _set_quant_config(folder: Path, quant: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quant
    path.write_text(json.dumps(config, indent=2) + "\n")


def _dense_reference(
    folder: Path, dense_folder: Path, dequantize_module, part: str = "weight_scale"
) -> tuple:
    """transformers' model of ``folder``'s config (its ``quantization_config`` dropped) holding
    ``dequantize_module(tensors, module)`` for every quantized module (the one whose parts
    include ``part``) and every other stored tensor as it is: a dense checkpoint written to
    ``dense_folder`` and loaded by transformers (which fuses per-expert weights its own way).
    Returns (model, the number of quantized modules)."""
    stored = load_file(str(folder / "model.safetensors"))
    modules = sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith("." + part)})
    dense = {}
    for module in modules:
        dense[f"{module}.weight"] = dequantize_module(stored, module).float().contiguous()
    for name, tensor in stored.items():
        if name.rsplit(".", 1)[0] not in modules:
            dense[name] = tensor
    dense_folder.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(dense_folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (dense_folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model = transformers.AutoModelForCausalLM.from_pretrained(dense_folder, dtype=torch.float32)
    return model.eval(), len(modules)


def transformers_fp8_load(folder: Path):
    """transformers' own float32 load of a block-FP8 folder. Without a GPU it dequantizes the
    weights itself (FP8 kernels need one); with one it is asked to (``dequantize=True``, the same
    weights: both pinned by ``test_transformers_fp8_load_is_the_exact_dequantization``)."""
    extra = (
        {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)}
        if torch.cuda.is_available()
        else {}
    )
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, **extra
    ).eval()


def make_deepseek_fp8(folder: Path, tmp: Path, ds_config: bool = False):
    """transformers' FP8 DeepSeek-V3 (norms and router bias randomised in the file), and
    transformers' own load of it; with ``ds_config`` DeepSeek's four-field quantization_config
    (the reference is then the load of the transformers-config folder: the same tensors)."""
    write_deepseek_fp8(folder, fp8_config())
    _rewrite(folder, lambda t: _randomise_stored(t, seed=3))
    model = transformers_fp8_load(folder)
    if ds_config:
        _set_quant_config(folder, dict(DEEPSEEK_QUANT_CONFIG))
    return model


def make_modelopt(folder: Path, tmp: Path, arch: str):
    """A copy of ModelOpt's (cached) export of ``helpers.modelopt_configs.CONFIGS[arch]``, norms
    randomised; the reference holds ModelOpt's own dequantization of every quantized module."""
    export = cached_modelopt_nvfp4(arch, MODELOPT_CONFIGS[arch]())
    for item in export.iterdir():
        shutil.copy(item, folder / item.name)
    _rewrite(folder, lambda t: _randomise_stored(t, seed=4))

    def module_weight(stored, module):
        return nvfp4_dequantize(
            stored[f"{module}.weight"],
            stored[f"{module}.weight_scale"],
            stored[f"{module}.weight_scale_2"],
        )

    model, count = _dense_reference(folder, tmp / "dense", module_weight)
    assert count == {"llama": 7, "phi3": 4, "qwen3_moe": 2 * (4 + 3 * 4)}[arch]
    return model


def _as_torch(x) -> torch.Tensor:
    return (
        x.detach().clone()
        if isinstance(x, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(x))
    )


def make_int4(
    folder: Path,
    tmp: Path,
    method: str,
    *,
    act_order: bool = False,
    sym: bool = True,
    biases: bool = False,
):
    """A random Llama of the quantized sizes ``QUANT_SIZES`` (norms and biases randomised, every
    float tensor rounded to fp16 and stored so), its 7 linears per layer quantized by
    ``quant_refs`` (GPTQ v1 group 32, with a random ``perm`` per linear for act-order; or AWQ
    GEMM group 32); the reference is the same model with each linear weight replaced by the
    codec's own dequantization of the stored tensors."""
    config = transformers.LlamaConfig(attention_bias=biases, mlp_bias=biases, **QUANT_SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise(model)
    rng = np.random.default_rng(5)
    stored = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(param.half().float())  # an fp16 checkpoint
            module, _, suffix = name.rpartition(".")
            if suffix != "weight" or module.rpartition(".")[2] not in LINEARS:
                stored[name] = param.detach().half().clone()
                continue
            w = param.detach().numpy()
            if method == "gptq":
                perm = rng.permutation(w.shape[1]) if act_order else None
                parts = quantize_gptq(w, 4, GROUP, sym=sym, version=1, perm=perm)
                dense = dequantize_gptq(parts, 4, 1)
            else:
                parts = quantize_awq(w, GROUP)
                dense = dequantize_awq(parts, GROUP)
            for part, tensor in parts.items():
                stored[f"{module}.{part}"] = _as_torch(tensor)
            param.copy_(torch.from_numpy(dense))
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if method == "gptq":
        quant = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    else:
        quant = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP,
            "version": "gemm",
            "zero_point": True,
        }
    _set_quant_config(folder, quant)
    return model.eval()


def make_gptqmodel(folder: Path, tmp: Path, *, act_order: bool, group: int = GROUP):
    """A random Llama of the quantized sizes ``QUANT_SIZES`` (norms randomised) quantized by
    GPTQModel (4-bit, ``group``); the reference is that config with every linear weight
    replaced by ``dequantize_gptq`` of the tensors GPTQModel stored."""
    from helpers.gptqmodel_tool import quantize

    config = transformers.LlamaConfig(**QUANT_SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise(model)
    model.to(torch.bfloat16).save_pretrained(tmp / "source")
    quantize(tmp / "source", folder, bits=4, group=group, desc_act=act_order)

    def module_weight(stored, module):
        parts = {
            p: stored[f"{module}.{p}"].numpy() for p in ("qweight", "qzeros", "scales", "g_idx")
        }
        return torch.from_numpy(dequantize_gptq(parts, 4, 1))

    model, count = _dense_reference(folder, tmp / "dense", module_weight, part="qweight")
    assert count == 2 * len(LINEARS)
    return model


MAKERS = {
    "deepseek_fp8": lambda d, t: make_deepseek_fp8(d, t),
    "deepseek_fp8_ds_config": lambda d, t: make_deepseek_fp8(d, t, ds_config=True),
    "modelopt_nvfp4_llama": lambda d, t: make_modelopt(d, t, "llama"),
    "modelopt_nvfp4_phi3": lambda d, t: make_modelopt(d, t, "phi3"),
    "modelopt_nvfp4_qwen3_moe": lambda d, t: make_modelopt(d, t, "qwen3_moe"),
    "gptq_g32": lambda d, t: make_int4(d, t, "gptq"),
    "gptq_g32_act_order": lambda d, t: make_int4(d, t, "gptq", act_order=True),
    "gptq_g32_asym_bias": lambda d, t: make_int4(d, t, "gptq", sym=False, biases=True),
    "awq_g32": lambda d, t: make_int4(d, t, "awq"),
    "gptqmodel_g32": lambda d, t: make_gptqmodel(d, t, act_order=False),
    "gptqmodel_g32_act_order": lambda d, t: make_gptqmodel(d, t, act_order=True),
    "gptqmodel_g64": lambda d, t: make_gptqmodel(d, t, act_order=False, group=64),
    "gptqmodel_g64_act_order": lambda d, t: make_gptqmodel(d, t, act_order=True, group=64),
}
assert MAKERS.keys() == KINDS.keys()


@pytest.fixture(scope="module")
def format_reference(tmp_path_factory):
    """``format_reference(case)``: the case's checkpoint folder and its format's reference's
    answers (each format's most independent one: see the module's docstring), made once per
    module."""
    made: dict[str, Reference] = {}

    def get(case: str) -> Reference:
        if case not in made:
            started = time.perf_counter()
            folder = tmp_path_factory.mktemp(case)
            model = MAKERS[case](folder, tmp_path_factory.mktemp(f"{case}_work"))
            made[case] = Reference(folder, model)
            print(f"\nREFERENCE {case} made in {time.perf_counter() - started:.2f} s")
        return made[case]

    return get


# ---- parity ------------------------------------------------------------------------------------


def check_parity(case: str, ref: Reference, n: int, session_class) -> None:
    kind = KINDS[case][n - 1]
    started = time.perf_counter()
    with session_class(n) as session:
        model = load_tp_model(str(ref.folder), session, dtype=torch.float32)
        try:
            assert isinstance(model, TPModel) and model.num_shards == n
            assert model.decision.kind == kind, (case, n, model.decision.kind)
            logits = model(torch.tensor(PROMPT))
            tokens = model.generate(
                torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, eos_token_id=None
            )  # as the reference: all 16 tokens
        finally:
            model.close()
    diff = relative(logits, ref.logits)
    same = torch.equal(tokens, ref.tokens)
    print(
        f"\nPARITY {case:26} {session_class.__name__:15} N={n} {kind:8} "
        f"rel={diff:.2e} tokens_equal={same} ({time.perf_counter() - started:.2f} s)"
    )
    assert logits.dtype == torch.float32 and logits.shape == ref.logits.shape
    assert diff < TOLERANCE, f"{case} at N={n}: logits differ by {diff:.2e} (relative)"
    assert tokens.tolist() == ref.tokens.tolist(), f"{case} at N={n}: greedy tokens differ"


def _cases(names) -> list:
    """``names`` as parameters, those GPTQModel writes marked ``quant_tools`` (its environment
    is made by a script: without it they skip before anything is made)."""
    return [
        pytest.param(c, marks=pytest.mark.quant_tools) if c.startswith("gptqmodel") else c
        for c in names
    ]


@pytest.mark.parametrize("n", (1, 2, 3, 4))
@pytest.mark.parametrize("case", _cases(KINDS))
def test_quantized_format_equals_reference(format_reference, case, n):
    check_parity(case, format_reference(case), n, ThreadedSession)


@pytest.mark.slow
@pytest.mark.parametrize("case, n", PROCESS_CASES)
def test_process_session_equals_reference(format_reference, case, n):
    check_parity(case, format_reference(case), n, ProcessSession)


# ---- what the cases rest on --------------------------------------------------------------------


def test_transformers_fp8_load_is_the_exact_dequantization(format_reference):
    """The FP8 reference, transformers' load of the block-FP8 folder (on CPU, plain; and with
    ``FineGrainedFP8Config(dequantize=True)``), holds exactly the float32 block dequantization
    (the tool's ``dequantize``: transformers' ``_dequantize_fp8_weight``; per-expert weights
    fused) of every quantized weight, not the bf16-rounded values its log message announces;
    and DeepSeek's own four-field config loads to the same model."""
    ref = format_reference("deepseek_fp8")
    stored = load_file(str(ref.folder / "model.safetensors"))
    quantized = [k[: -len("_scale_inv")] for k in stored if k.endswith(".weight_scale_inv")]
    experts = "model.layers.1.mlp.experts."
    plain = [k for k in quantized if not k.startswith(experts)]
    assert len(plain) == 2 * 5 + 3 + 3  # attention x2, the dense MLP, the shared expert

    def stacked(proj):
        return torch.stack(
            [
                fp8_dequantize(
                    stored[f"{experts}{e}.{proj}.weight"],
                    stored[f"{experts}{e}.{proj}.weight_scale_inv"],
                )
                for e in range(4)
            ]
        )

    loads = [{"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)}]
    if not torch.cuda.is_available():
        loads.append({})
    for extra in loads:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            ref.folder, dtype=torch.float32, **extra
        )
        state = model.state_dict()
        for name in plain:
            assert torch.equal(
                state[name], fp8_dequantize(stored[name], stored[name + "_scale_inv"])
            ), name
        assert torch.equal(
            state[experts + "gate_up_proj"],
            torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1),
        )
        assert torch.equal(state[experts + "down_proj"], stacked("down_proj"))
        assert not torch.equal(state[plain[0]], state[plain[0]].bfloat16().float())
    ds = format_reference("deepseek_fp8_ds_config")
    assert (
        json.loads((ds.folder / "config.json").read_text())["quantization_config"]
        == DEEPSEEK_QUANT_CONFIG
    )
    assert torch.equal(ds.logits, ref.logits)
    assert torch.equal(answers(transformers_fp8_load(ds.folder))[0], ref.logits)


@pytest.mark.parametrize(
    "case",
    _cases(
        [
            "gptq_g32",
            "gptq_g32_act_order",
            "gptq_g32_asym_bias",
            "awq_g32",
            "gptqmodel_g32",
            "gptqmodel_g32_act_order",
        ]
    ),
)
def test_int4_checkpoints_are_what_the_tools_write(format_reference, case):
    """The premise of the GPTQ / AWQ cases: AutoGPTQ's v1 and AutoAWQ's GEMM tensors, int32
    packed, fp16 scales; act-order ``g_idx`` really reorders rows; asymmetric zero points vary;
    the planner reads the format it should."""
    ref = format_reference(case)
    stored = load_file(str(ref.folder / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    down = "model.layers.0.mlp.down_proj"
    if case.startswith("gptq"):
        assert stored[f"{q}.qweight"].shape == (128 // 8, 128)
        assert stored[f"{q}.qzeros"].shape == (128 // GROUP, 128 // 8)
        assert stored[f"{down}.qweight"].shape == (256 // 8, 128)
        assert stored[f"{down}.scales"].shape == (256 // GROUP, 128)
        g_idx = stored[f"{down}.g_idx"].long()
        trivial = torch.equal(g_idx, torch.arange(256) // GROUP)
        assert trivial != case.endswith("act_order")
        zeros = stored[f"{q}.qzeros"]
        assert (zeros == 0x77777777).all() == (case != "gptq_g32_asym_bias")
        if case == "gptq_g32_asym_bias":
            assert f"{down}.bias" in stored and stored[f"{down}.bias"].std() > 0
    else:
        assert stored[f"{q}.qweight"].shape == (128, 128 // 8)
        assert stored[f"{q}.qzeros"].shape == (128 // GROUP, 128 // 8)
        assert stored[f"{down}.qweight"].shape == (256, 128 // 8)
        assert f"{q}.g_idx" not in stored
    assert stored[f"{q}.qweight"].dtype == torch.int32
    assert stored[f"{q}.scales"].dtype == torch.float16
    assert stored["model.norm.weight"].dtype == (
        torch.bfloat16 if "gptqmodel" in case else torch.float16
    )
    assert stored["model.norm.weight"].float().std() > 0
    summary = str(plan_decision(str(ref.folder), 2).summary)
    method = "awq" if case.startswith("awq") else "gptq"
    assert f"{method} 4-bit group {GROUP}" in summary, summary
