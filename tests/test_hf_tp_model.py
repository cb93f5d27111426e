"""``load_tp_model`` gives transformers' own answers: logits and greedy tokens of the model split
over N workers equal those of the same checkpoint loaded unsharded by transformers itself.

The oracle is transformers, never shardload: each tiny checkpoint is a random model made by
transformers (``from_config`` under ``torch.manual_seed(0)``, biases and norms randomised, since
they start at 0 / 1 and a mis-sharded one would not show) and saved with ``save_pretrained``; the
quantized ones are compressed by compressed-tensors itself (``helpers.compressed_tensors_tool``)
or written in openai/gpt-oss-20b's MXFP4 layout (``helpers.gpt_oss_tool``). The reference is
``AutoModelForCausalLM.from_pretrained`` of that folder in float32 (compressed-tensors
checkpoints with ``CompressedTensorsConfig(dequantize=True)``: compressed-tensors decompresses
the weights at load time; gpt-oss with ``Mxfp4Config(dequantize=True)``), and its own
``generate(ids, max_new_tokens=16, do_sample=False)``.

For every case and every N in 1..4 on a ``ThreadedSession`` (3 zero-pads the 4 query heads, and
the MLP where it does not divide; compressed-tensors' FP8 block checkpoint, an MLP of 3 blocks
of 128 rows, pads at 2, 3 and 4: the padded plan is asserted to be the one used), the logits
must be within 1e-3 of the reference (max abs difference over max abs of the reference, float32)
and the 16 greedy tokens identical. ``ProcessSession`` (a gloo group of worker processes) is
checked at one N per family (slow). Run with ``-s`` to see the parity table.

Where the literal reference differs on purpose (not a sharding question): compressed-tensors
decompresses NVFP4 in bfloat16 (``unpack_fp4_from_uint8``'s default dtype), shardload in float32,
so the NVFP4 case's tight reference is transformers' model holding compressed-tensors' own
``dequantize`` computed in float32, and ``test_nvfp4_transformers_rounds_to_bfloat16`` pins the
bf16 difference of the plain load. And a plain (``dequantize=False``) load of a W8A8 checkpoint
also quantizes the activations (dynamic int8 per token), which a dense TP model does not.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import transformers
from helpers.architecture_configs import CONFIGS as ARCH_CONFIGS
from helpers.architecture_configs import SMALL
from helpers.compressed_tensors_tool import compress_preset, compress_w4a16
from helpers.deepseek_configs import tiny_config as deepseek_config
from helpers.gpt_oss_tool import load_with_transformers, write_gpt_oss_mxfp4
from helpers.gpt_oss_tool import tiny_config as gpt_oss_config
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
from helpers.moe_configs import CONFIGS as MOE_CONFIGS
from safetensors.torch import load_file

from shardload import ProcessSession, ShardloadError, ThreadedSession, WorkerError
from shardload.hf import TPModel, load_tp_model

pytestmark = pytest.mark.filterwarnings(
    "ignore:You passed `quantization_config`:UserWarning"
)  # dequantize=True over the config's

SHARDS = (1, 2, 3, 4)
PADDED = 3  # 4 query heads (and the MLPs) over 3 workers: zero-padded
#: cases zero-padded at more N than PADDED: gpt-oss MXFP4's experts hold 64 rows, two 32-groups
#: of down_proj's inputs, which 4 workers cannot share evenly
ALSO_PADDED = {"gpt_oss_mxfp4": {4}, "ct_fp8_block_llama": {2, 4}}

#: the float checkpoints: config makers (the tiny configs of the planner's own tests)
FLOAT = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    # o_proj / down_proj biases: row-parallel, added once after the sum, not once per worker
    "llama_biases": lambda: transformers.LlamaConfig(attention_bias=True, mlp_bias=True, **SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(head_dim=24, **SMALL),  # per-head q/k norms
    "gemma2": ARCH_CONFIGS["gemma2"],
    "gemma3_text": ARCH_CONFIGS["gemma3_text"],
    "gemma3": ARCH_CONFIGS["gemma3"],  # multimodal: the language model under text_config
    "phi3": ARCH_CONFIGS["phi3"],
    "granite": ARCH_CONFIGS["granite"],
    # q/k norms over the whole projection: a sum of squares reduced over the workers
    "olmo2": ARCH_CONFIGS["olmo2"],
    "mixtral": MOE_CONFIGS["mixtral"],
    "qwen2_moe": MOE_CONFIGS["qwen2_moe"],
    "qwen3_moe": MOE_CONFIGS["qwen3_moe"],
    "gpt_oss": gpt_oss_config,  # sinks, biases, MoE
    "deepseek_v2": lambda: deepseek_config("v2"),  # MLA, no q_lora
    "deepseek_v3": lambda: deepseek_config("v3"),  # MLA, q_lora, router bias
    # 8 heads of 32 in a hidden size of 256: at N = 3 each worker holds 3 query heads (one of
    # them zero-padded), which the hidden size does not divide; transformers' config checks
    # refuse such sizes, so the worker's are set on the config after it is built
    "llama_8_heads": lambda: transformers.LlamaConfig(**EIGHT_HEADS),
}

#: a hidden size the padded heads of N = 3 do not divide (8 heads: 3 per worker)
EIGHT_HEADS = dict(QUANT_SIZES, hidden_size=256, num_attention_heads=8)


def _quant_llama():
    return transformers.LlamaConfig(**QUANT_SIZES)


def _quant_phi3():
    return transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **QUANT_SIZES)


#: case -> writes the checkpoint into a folder (compressed-tensors' tools, and gpt-oss's)
QUANTIZED = {
    "ct_w4a16_llama": lambda d: compress_w4a16(d, _quant_llama(), symmetric=True, group=32),
    "ct_w4a16_phi3": lambda d: compress_w4a16(d, _quant_phi3(), symmetric=True, group=32),
    "ct_w4a16_llama_8_heads": lambda d: compress_w4a16(
        d, transformers.LlamaConfig(**EIGHT_HEADS), symmetric=True, group=32
    ),
    "ct_w8a8_llama": lambda d: compress_preset(d, _quant_llama(), "W8A8"),
    "ct_nvfp4a16_llama": lambda d: compress_preset(d, _quant_llama(), "NVFP4A16"),
    "ct_mxfp4a16_llama": lambda d: compress_preset(d, _quant_llama(), "MXFP4A16"),
    # 128x128 blocks: heads of 128 rows, an MLP of 3 blocks (padded at 2, 3 and 4)
    "ct_fp8_block_llama": lambda d: compress_preset(
        d,
        transformers.LlamaConfig(**{**QUANT_SIZES, "hidden_size": 512, "intermediate_size": 384}),
        "FP8_BLOCK",
    ),
    "gpt_oss_mxfp4": lambda d: write_gpt_oss_mxfp4(d, gpt_oss_config()),
}

#: one N per family for ProcessSession (slow); the dense one is OLMo-2, whose q/k norms add a
#: reduction of their own over the gloo group
PROCESS_CASES = [
    ("olmo2", 3),
    ("qwen2_moe", 2),
    ("gpt_oss", 2),
    ("deepseek_v3", 3),
    ("ct_w4a16_llama", 2),
    ("gpt_oss_mxfp4", 3),
    ("ct_w4a16_llama_8_heads", 3),
]


# ---- the checkpoints and transformers' answers -------------------------------------------------


def write_float(folder, case: str) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FLOAT[case]())
    randomise(model)
    model.save_pretrained(folder)


def nvfp4_float32_reference(folder):
    """transformers' model of the NVFP4 checkpoint whose quantized weights are compressed-tensors'
    own ``dequantize`` computed in float32 (the library's load computes them in bfloat16)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    model = reference_model(folder, "ct_nvfp4a16_llama")
    stored = load_file(str(folder / "model.safetensors"))
    replaced = 0
    with torch.no_grad():
        for name, packed in stored.items():
            if not name.endswith(".weight_packed"):
                continue
            prefix = name[: -len(".weight_packed")]
            codes = unpack_fp4_from_uint8(
                packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32
            )
            weight = dequantize(
                x_q=codes,
                scale=stored[f"{prefix}.weight_scale"].float(),
                args=args,
                global_scale=stored[f"{prefix}.weight_global_scale"],
                dtype=torch.float32,
            )
            model.get_parameter(f"{prefix}.weight").copy_(weight)
            replaced += 1
    assert replaced == 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head ignored
    return model


def reference_model(folder, case: str):
    """The checkpoint loaded unsharded by transformers itself, float32."""
    if case == "gpt_oss_mxfp4":
        model = load_with_transformers(folder)
    elif case.startswith("ct_"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch.float32,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def transformers_reference(tmp_path_factory):
    """``transformers_reference(case)``: the case's checkpoint folder and the answers of
    transformers' own unsharded model of it, made once per module."""
    made: dict[str, Reference] = {}

    def get(case: str) -> Reference:
        if case not in made:
            folder = tmp_path_factory.mktemp(case)
            if case in FLOAT:
                write_float(folder, case)
            else:
                QUANTIZED[case](folder)
            model = (
                nvfp4_float32_reference(folder)
                if case == "ct_nvfp4a16_llama"
                else reference_model(folder, case)
            )
            made[case] = Reference(folder, model)
        return made[case]

    return get


def check_parity(case: str, ref: Reference, n: int, session_class) -> None:
    started = time.perf_counter()
    with session_class(n) as session:
        model = load_tp_model(str(ref.folder), session, dtype=torch.float32)
        try:
            assert isinstance(model, TPModel) and model.num_shards == n
            padded = n == PADDED or n in ALSO_PADDED.get(case, ())
            assert model.decision.kind == ("padded" if padded else "unpadded")
            logits = model(torch.tensor(PROMPT))
            tokens = model.generate(
                torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, eos_token_id=None
            )  # as the reference: all 16 tokens
        finally:
            model.close()
    diff = relative(logits, ref.logits)
    same = torch.equal(tokens, ref.tokens)
    print(
        f"\nPARITY {case:18} {session_class.__name__:15} N={n} {model.decision.kind:8} "
        f"rel={diff:.2e} tokens_equal={same} ({time.perf_counter() - started:.2f} s)"
    )
    assert logits.dtype == torch.float32 and logits.shape == ref.logits.shape
    assert diff < TOLERANCE, f"{case} at N={n}: logits differ by {diff:.2e} (relative)"
    assert tokens.tolist() == ref.tokens.tolist(), f"{case} at N={n}: greedy tokens differ"


# ---- the parity: every case, every N, threads --------------------------------------------------


@pytest.mark.parametrize("n", SHARDS)
@pytest.mark.parametrize("case", sorted(FLOAT))
def test_float_checkpoint_equals_transformers(transformers_reference, case, n):
    check_parity(case, transformers_reference(case), n, ThreadedSession)


@pytest.mark.parametrize("n", SHARDS)
@pytest.mark.parametrize("case", sorted(QUANTIZED))
def test_quantized_checkpoint_equals_transformers(transformers_reference, case, n):
    check_parity(case, transformers_reference(case), n, ThreadedSession)


@pytest.mark.slow
@pytest.mark.parametrize("case, n", PROCESS_CASES)
def test_process_session_equals_transformers(transformers_reference, case, n):
    check_parity(case, transformers_reference(case), n, ProcessSession)


# ---- what the cases rest on ----------------------------------------------------------------------


def test_randomised_checkpoints_have_no_constant_bias_or_norm(transformers_reference):
    """The checkpoints really hold random biases and norms (row-parallel biases included)."""
    for case in ("llama_biases", "qwen2", "gpt_oss", "gemma2", "olmo2", "deepseek_v3"):
        stored = load_file(str(transformers_reference(case).folder / "model.safetensors"))
        picked = {
            name: t for name, t in stored.items() if name.endswith(("bias", "norm.weight", "sinks"))
        }
        assert picked, case
        for name, t in picked.items():
            assert t.numel() == 1 or t.float().std() > 0, f"{case}: {name} is constant"
    llama = load_file(str(transformers_reference("llama_biases").folder / "model.safetensors"))
    assert "model.layers.0.self_attn.o_proj.bias" in llama
    assert "model.layers.0.mlp.down_proj.bias" in llama


def test_nvfp4_transformers_rounds_to_bfloat16(transformers_reference):
    """transformers' own load of the NVFP4 checkpoint (compressed-tensors' decompression) gives
    bf16-rounded weights: the TP model (float32 dequantization) is within 1e-2 of it, not 1e-3,
    at every N alike (the decompression's precision, not the sharding), with the same tokens."""
    ref = transformers_reference("ct_nvfp4a16_llama")
    plain = reference_model(ref.folder, "ct_nvfp4a16_llama")
    weight = plain.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(weight, weight.bfloat16().float())
    want, want_tokens = answers(plain)
    diffs = []
    for n in (1, 2):
        with ThreadedSession(n) as session, load_tp_model(str(ref.folder), session) as model:
            diffs.append(relative(model(PROMPT), want))
            assert (
                model.generate(PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=None).tolist()
                == want_tokens.tolist()
            )
    print(f"\nNVFP4 against transformers' bf16 decompression: rel={diffs}")
    assert all(d < 1e-2 for d in diffs)
    assert abs(diffs[0] - diffs[1]) < 1e-4


def test_sampling_is_the_same_at_every_n(transformers_reference):
    """Sampled decoding: worker 0 samples from ``seed`` and broadcasts, so the tokens depend on
    the seed, not on N (gpt-oss: biases, sinks, MoE)."""
    ref = transformers_reference("gpt_oss")
    sampled = {}
    for n in (1, 3):
        with ThreadedSession(n) as session, load_tp_model(str(ref.folder), session) as model:
            sampled[n] = [
                model.generate(
                    PROMPT,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=True,
                    seed=seed,
                    temperature=0.8,
                    top_k=20,
                    eos_token_id=None,
                ).tolist()
                for seed in (7, 7, 8)
            ]
    assert sampled[1] == sampled[3]
    first, again, other = sampled[1]
    assert first == again and first != other
    assert len(first[0]) == len(PROMPT[0]) + NEW_TOKENS


def test_batch_and_closed_model(transformers_reference):
    """Two prompts at once: transformers' logits for both, the first one's greedy tokens; a
    closed model is gone from its workers (the session stays open)."""
    ref = transformers_reference("qwen2")
    prompts = [PROMPT[0], [9, 8, 7, 6, 5, 4, 3, 2]]
    full = transformers.AutoModelForCausalLM.from_pretrained(ref.folder, dtype=torch.float32)
    with torch.no_grad():
        want = full.eval()(torch.tensor(prompts)).logits
    with ThreadedSession(3) as session:
        model = load_tp_model(str(ref.folder), session)
        assert relative(model(prompts), want) < TOLERANCE
        assert (
            model.generate(prompts, max_new_tokens=4, eos_token_id=None)[0].tolist()
            == ref.tokens[0, :12].tolist()
        )
        model.close()
        with pytest.raises(WorkerError, match="no model"):
            model(PROMPT)
        model.close()  # twice: nothing more to free


def test_unsupported_dtype_is_refused(transformers_reference):
    with ThreadedSession(1) as session:
        with pytest.raises(ShardloadError, match="dtype"):
            load_tp_model(str(transformers_reference("llama").folder), session, dtype=torch.float64)


# ---- expert parallelism: whole experts per worker, same answers --------------------------------

EP_CASES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "gpt_oss_mxfp4")


@pytest.mark.parametrize("n", (2, 3, 8))
@pytest.mark.parametrize("case", EP_CASES)
def test_expert_parallel_equals_transformers(transformers_reference, case, n):
    """``experts="ep"``: each worker holds whole routed experts (placed per expert, or its slots
    of gpt-oss's stacked experts), the others' are zero stand-ins in transformers' MoE block,
    shared experts and attention stay tensor-parallel (DeepSeek's shared experts zero-padded to
    their configured width); the sum over workers is transformers' whole model. 8 workers on 4
    experts: half the workers hold none."""
    ref = transformers_reference(case)
    with ThreadedSession(n) as session:
        with load_tp_model(str(ref.folder), session, experts="ep") as model:
            held = model.decision.shard_info().metadata["experts"]["experts_per_worker"]
            assert all(len(slots) == n for slots in held.values())
            logits = model(torch.tensor(PROMPT))
            tokens = model.generate(
                torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, eos_token_id=None
            )
    assert relative(logits, ref.logits) < TOLERANCE
    assert tokens.tolist() == ref.tokens.tolist()
