"""``load_tp_model`` on GGUF files of every architecture the planner knows (``planners.model.
GGUF_ARCHITECTURES``) that transformers can read from GGUF: llama, qwen2, qwen3, qwen2moe,
qwen3moe, phi3, gemma2, gemma3. ``tests/test_hf_gguf.py`` does it for the published SmolLM2
(llama); this does it for tiny files of the others, with the parity of
``tests/test_hf_tp_model.py``: logits within 1e-3 (max abs difference over max abs of the
reference, float32) and the same 16 greedy tokens, at N = 1, 2, 3 (zero-padded: 4 query heads over
3 workers) and 4 on a ``ThreadedSession``.

The files. Each is a random model made by transformers (``from_config`` under
``torch.manual_seed(0)``, norms and biases randomised by ``helpers.hf_parity.randomise``),
converted to GGUF here the way llama.cpp's ``convert_hf_to_gguf.py`` converts it, written with
gguf-py's ``GGUFWriter``: tensor names from gguf-py's ``TensorNameMap`` for the architecture;
llama's q/k rows permuted (``LlamaModel.permute``, which transformers' ``LlamaTensorProcessor``
reverses); Gemma's zero-centred norms stored as ``w + 1`` (``Gemma2TensorProcessor`` subtracts
it); the experts' fused ``gate_up_proj`` [E, 2I, H] stored as ``ffn_gate_exps`` and
``ffn_up_exps`` [E, I, H] (``Qwen2MoeTensorProcessor`` concatenates them again); every tensor
squeezed (Qwen2-MoE's ``shared_expert_gate`` [1, H] is stored as [H]); 2-D and 3-D weights in
Q4_0 or Q8_0 (``gguf.quants.quantize``), embeddings and lm_head Q8_0, vectors and routers F32;
the key-values transformers reads (``integrations/ggml.py``'s ``GGUF_CONFIG_MAPPING``), with
``key_length`` where llama.cpp writes it (an explicit head_dim: Gemma, Qwen3) and
``rope.dimension_count`` for llama; and a minimal tokenizer (a token list: transformers takes
the vocabulary size from it; bos / eos / pad ids within the vocabulary). That the conversion is
the one transformers' loader undoes is checked, not assumed: the same model written in F32 reads
back exactly, Gemma's w + 1 norms within an ulp (``test_f32_conversion_reads_back_exactly``).

The reference is transformers reading the whole quantized file itself
(``from_pretrained(folder, gguf_file=..., dtype=torch.float32)``) and its own ``generate``, never
the HF model (the quantization differs) and never shardload.

Sizes: hidden 128, 4 query heads, 2 KV heads, head_dim 32, MLP 256, 64 tokens, 2 layers, so a
32-element block never straddles a head at N <= 4. Where transformers reads no key for a size
it takes the config class's default, and the tiny model must have that size for the whole file
to be readable at all: Qwen3's head_dim is 128 (``qwen3`` maps no ``key_length``), the experts of
Qwen2-MoE are 1408 wide with a 5632-wide shared expert and those of Qwen3-MoE 768 (no key maps
to ``moe_intermediate_size`` / ``shared_expert_intermediate_size``).

Architectures the planner knows that transformers (5.24) cannot read from GGUF, so left out
(``test_transformers_cannot_read`` pins each):

* ``mistral``: a file whose ``general.architecture`` is ``mistral`` (what the planner takes
  for Mistral) makes transformers build a MistralForCausalLM and look for a ``mistral``
  tensor-name map in gguf-py, which has none (``NotImplementedError: Unknown gguf model_type:
  mistral in gguf-py``); no converter writes one either (gguf-py has no ``mistral``
  architecture). llama.cpp writes Mistral as ``llama``: that is the llama case (transformers
  reads it as Llama, unless ``general.name`` is exactly "mistral", which fails as above);
* ``olmo2`` and ``granite``: not in ``GGUF_CONFIG_MAPPING`` (``ValueError: GGUF model with
  architecture ... is not supported yet``);
* ``gpt-oss``: transformers keys its tensor processor by ``gpt_oss``, so llama.cpp's ``gpt-oss``
  files get the plain one, which maps none of the experts (``ffn_*_exps``), their biases or the
  sinks, and its ``rope.scaling`` parsing fails on llama.cpp's key-values (``TypeError``).

Each worker builds its model as transformers' GGUF loader would from its own pieces
(``shardload.hf.from_gguf``: transformers' config of the whole file, its tensor names, its
tensor processors), with its sizes set on the config. transformers reads no head size for
qwen2, qwen2moe and phi3 (it would take hidden_size // the worker's heads) and no expert widths
for qwen2moe and qwen3moe (the class defaults), so the worker sets those too.
``test_worker_sizes_*`` are the cases that showed it, when each worker wrote a GGUF of its
pieces for transformers to read (they failed, with a size mismatch, before). The config and
the tokenizer are checked to be transformers' own (``test_config_and_tokenizer_are_*``), and
the architectures transformers cannot read are refused before anything is loaded.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf.constants import MODEL_ARCH_NAMES
from gguf.quants import quantize
from helpers.hf_parity import randomise, relative

from shardload import ThreadedSession
from shardload.hf import load_tp_model
from shardload.planners.architectures import GGUF_ARCHITECTURES

PROMPT = [[3, 17, 42, 5, 33, 11, 60, 29]]  # token ids < VOCAB
NEW_TOKENS = 16
SHARDS = (1, 2, 3, 4)
PADDED = 3  # 4 query heads over 3 workers: zero-padded
TOLERANCE = 1e-3  # max |TP - reference| / max |reference|, float32
VOCAB = 64
SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])


@dataclass(frozen=True)
class Case:
    config: Callable[[], transformers.PretrainedConfig]
    qtype: T  # the linear layers' (and experts') GGUF type


CASES = {
    "llama": Case(lambda: transformers.LlamaConfig(**SIZES), T.Q4_0),  # permuted q/k rows
    "qwen2": Case(lambda: transformers.Qwen2Config(**SIZES), T.Q8_0),  # q/k/v biases
    # per-head q/k norms; head_dim 128: transformers reads no key_length for qwen3
    "qwen3": Case(lambda: transformers.Qwen3Config(head_dim=128, **SIZES), T.Q8_0),
    # shared expert and its sigmoid gate; transformers reads no expert widths: its defaults
    "qwen2moe": Case(
        lambda: transformers.Qwen2MoeConfig(
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632, **EXPERTS, **SIZES
        ),
        T.Q8_0,
    ),
    # transformers sets norm_topk_prob for a GGUF qwen3moe (llama.cpp's routing)
    "qwen3moe": Case(
        lambda: transformers.Qwen3MoeConfig(
            head_dim=32, moe_intermediate_size=768, norm_topk_prob=True, **EXPERTS, **SIZES
        ),
        T.Q8_0,
    ),
    "phi3": Case(lambda: transformers.Phi3Config(**SIZES), T.Q8_0),  # fused qkv, gate_up
    # w + 1 norms, explicit head_dim, tied embeddings; gemma3: per-head q/k norms too
    "gemma2": Case(lambda: transformers.Gemma2Config(head_dim=32, **SIZES), T.Q4_0),
    "gemma3": Case(lambda: transformers.Gemma3TextConfig(head_dim=32, **SIZES), T.Q8_0),
}
#: the planner's GGUF architectures transformers cannot read (see the module docstring)
UNREADABLE = {
    "mistral": "transformers builds Mistral, gguf-py has no 'mistral' names for it",
    "olmo2": "not in transformers' GGUF_CONFIG_MAPPING",
    "granite": "not in transformers' GGUF_CONFIG_MAPPING",
    "gpt-oss": "experts, their biases and sinks not mapped; rope.scaling not parsed",
}
#: cases whose worker GGUFs lose a size transformers takes from no key (see the docstring)
LOST_SIZES = {
    "qwen2": "head_dim (hidden_size // local heads)",
    "phi3": "head_dim (hidden_size // local heads)",
    "qwen2moe": "head_dim and the expert widths (class defaults)",
    "qwen3moe": "the expert widths (class defaults)",
}


# ---- the converter: an HF model to the GGUF llama.cpp would write ------------------------------


def hf_model(case: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CASES[case].config())
    randomise(model)
    return model.eval()


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q (``heads`` query heads) or k (KV heads) rows:
    within each head, the two rotary halves interleaved."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _arch_enum(arch: str) -> gguf.MODEL_ARCH:
    return next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)


def write_gguf(
    model, arch: str, path: str, qtype: T, name: str = "", tensor_names: str = ""
) -> None:
    """``model`` as llama.cpp's converter writes it for ``arch`` (the module docstring lists
    what that means here); linear weights in ``qtype`` (F32: unquantized); tensors named as
    gguf-py names them for ``tensor_names`` (default: ``arch``)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    names = gguf.get_tensor_name_map(_arch_enum(tensor_names or arch), cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name or arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch in ("llama", "granite"):
        writer.add_rope_dimension_count(head_dim)
    if getattr(cfg, "head_dim", None) and arch not in ("llama", "granite"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "num_experts", None):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    tied = cfg.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp: no output tensor
        values = tensor.detach().float().numpy()
        module, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):  # fused experts: parameters, no .weight
            module, suffix = hf_name, "weight"
        parts = [(module, values)]
        if module.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            stem = module[: -len("gate_up_proj")]
            gate, up = np.split(values, 2, axis=1)
            parts = [(stem + "gate_proj", gate), (stem + "up_proj", up)]
        for hf_module, array in parts:
            base = names.get_name(hf_module)
            assert base is not None, f"gguf-py has no {arch} name for {hf_module}"
            if arch in ("llama", "granite") and hf_module.endswith("q_proj"):
                array = _permute(array, heads)
            elif arch in ("llama", "granite") and hf_module.endswith("k_proj"):
                array = _permute(array, kv_heads)
            if arch.startswith("gemma") and hf_module.endswith("norm"):
                array = array + 1
            array = np.ascontiguousarray(array.squeeze(), dtype=np.float32)
            gguf_name = f"{base}.{suffix}"
            kind = (
                T.F32
                if array.ndim == 1 or base.endswith("ffn_gate_inp")
                else T.Q8_0
                if base in ("token_embd", "output") and qtype != T.F32
                else qtype
            )
            if kind == T.F32:
                writer.add_tensor(gguf_name, array)
            else:
                writer.add_tensor(gguf_name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_with_transformers(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # all 16 tokens, as TPModel.generate
    return model.eval()


def answers(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits.float()
        tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return logits, tokens


class Reference:
    def __init__(self, path: str):
        self.path = path
        started = time.perf_counter()
        self.logits, self.tokens = answers(read_with_transformers(path))
        self.seconds = time.perf_counter() - started
        assert self.tokens.shape == (1, len(PROMPT[0]) + NEW_TOKENS)


@pytest.fixture(scope="module")
def gguf_reference(tmp_path_factory):
    """``gguf_reference(case)``: the case's quantized GGUF and transformers' answers, made once."""
    made: dict[str, Reference] = {}

    def get(case: str) -> Reference:
        if case not in made:
            spec = CASES[case]
            path = str(tmp_path_factory.mktemp(case) / f"{case}.gguf")
            write_gguf(hf_model(case), case, path, spec.qtype)
            made[case] = Reference(path)
        return made[case]

    return get


# ---- the parity ----------------------------------------------------------------------------------


def _params():
    for case in CASES:
        for n in SHARDS:
            yield pytest.param(case, n, id=f"{case}-N{n}")


@pytest.mark.parametrize("case, n", list(_params()))
def test_sharded_gguf_matches_transformers(gguf_reference, case, n):
    ref = gguf_reference(case)
    started = time.perf_counter()
    with ThreadedSession(n) as session, load_tp_model(ref.path, session) as model:
        assert model.num_shards == n
        assert model.decision.kind == ("padded" if n == PADDED else "unpadded")
        logits = model(PROMPT)
        tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    diff = relative(logits, ref.logits)
    same = torch.equal(tokens, ref.tokens)
    print(
        f"\nPARITY {case:9} {CASES[case].qtype.name} N={n} {model.decision.kind:8} "
        f"rel={diff:.2e} tokens_equal={same} ({time.perf_counter() - started:.2f} s; "
        f"reference {ref.seconds:.2f} s)"
    )
    assert logits.dtype == torch.float32 and logits.shape == ref.logits.shape
    assert diff < TOLERANCE, f"{case} at N={n}: logits differ by {diff:.2e} (relative)"
    assert tokens.tolist() == ref.tokens.tolist(), f"{case} at N={n}: greedy tokens differ"


@pytest.mark.parametrize("case", list(CASES))
def test_config_and_tokenizer_are_transformers_own(gguf_reference, case):
    """What each worker builds from: the config ``from_gguf.config_dict`` reads from
    shardload's reader is the one transformers' GGUF loader makes of the file, and so is the
    tokenizer ``shardload run`` builds (its class and its tokenizer)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from shardload import open_checkpoint
    from shardload.hf.from_gguf import config_dict
    from shardload.hf.text import tokenizer

    path = gguf_reference(case).path
    with open_checkpoint(path) as ckpt:
        assert config_dict(ckpt) == load_gguf_checkpoint(path, return_tensors=False)["config"]
    ours = tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()


@pytest.mark.parametrize(
    "arch, name",
    [("mistral", ""), ("mistral", "mistral"), ("olmo2", ""), ("granite", ""), ("gpt-oss", "")],
)
def test_unreadable_architectures_are_refused_before_loading(tmp_path, monkeypatch, arch, name):
    """A GGUF the planner plans but transformers cannot read (``UNREADABLE``) is refused with
    a ``FormatError`` naming the file, before any piece is loaded."""
    import shardload.hf.model
    from shardload.errors import FormatError

    def never(*args, **kwargs):
        raise AssertionError("loaded before refusing")

    monkeypatch.setattr(shardload.hf.model, "load_validated", never)
    path = _unreadable_file(tmp_path, arch, name)
    with ThreadedSession(2) as session, pytest.raises(FormatError) as info:
        load_tp_model(path, session)
    assert path in str(info.value) and "transformers cannot build a model" in str(info.value)


# ---- what the cases rest on ----------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_f32_conversion_reads_back_exactly(tmp_path, case):
    """The converter is what transformers' GGUF loader undoes (names, llama's q/k permutation,
    Gemma's w + 1 norms, the split experts, the squeezed gate): the model written in F32 is read
    back by transformers with every parameter equal to the model's (Gemma's norms within an
    ulp), so with the same logits."""
    model = hf_model(case)
    path = str(tmp_path / f"{case}.gguf")
    write_gguf(model, case, path, T.F32)
    read = read_with_transformers(path)
    assert type(read) is type(model)
    want, got = model.state_dict(), read.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        # Gemma's norms went through w + 1 - 1 in float32: within an ulp of 1
        ulp = 2**-23 if case.startswith("gemma") and "norm" in name else 0.0
        assert torch.allclose(got[name], tensor, rtol=0, atol=ulp), f"{case}: {name} differs"
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        assert relative(read(ids).logits, model(ids).logits) < 1e-6
    assert all(T(t.tensor_type) == T.F32 for t in gguf.GGUFReader(path).tensors)


def test_quantized_files_hold_quantized_weights(gguf_reference):
    """The parity runs on quantized files: every matrix in its case's type (embeddings Q8_0),
    only vectors and routers F32."""
    for case, spec in CASES.items():
        tensors = gguf.GGUFReader(gguf_reference(case).path).tensors
        for t in tensors:
            kind = T(t.tensor_type)
            if len(t.shape) == 1 or t.name.rpartition(".")[0].endswith("ffn_gate_inp"):
                assert kind == T.F32, (case, t.name)
            elif t.name.startswith(("token_embd.", "output.")):
                assert kind == T.Q8_0, (case, t.name)
            else:
                assert kind == spec.qtype, (case, t.name)
        if case.endswith("moe"):
            assert any(t.name == "blk.0.ffn_gate_exps.weight" for t in tensors)


def test_cases_are_the_planners_architectures_transformers_reads():
    """Every GGUF architecture the planner knows is either a case here or one transformers
    cannot read; every case is one transformers lists."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    assert set(CASES) | set(UNREADABLE) == set(GGUF_ARCHITECTURES)
    assert not set(CASES) & set(UNREADABLE)
    hf_names = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
    for case in CASES:
        assert hf_names.get(case, case) in GGUF_SUPPORTED_ARCHITECTURES, case


def _unreadable_file(folder, arch: str, name: str = "") -> str:
    """A tiny GGUF of ``arch`` as llama.cpp writes it (gpt-oss: helpers.gpt_oss_gguf's; mistral:
    Llama's tensors under ``general.architecture`` ``mistral``, or ``llama`` named ``name``)."""
    path = str(folder / f"{arch}{name}.gguf")
    if arch == "gpt-oss":
        from helpers.gpt_oss_gguf import write_gpt_oss

        write_gpt_oss(path)
        return path
    config = {
        "mistral": transformers.MistralConfig,
        "olmo2": transformers.Olmo2Config,
        "granite": transformers.GraniteConfig,
    }[arch](**SIZES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if arch == "mistral":
        write_gguf(
            model, "llama" if name else "mistral", path, T.Q8_0, name=name, tensor_names="llama"
        )
    else:
        write_gguf(model, arch, path, T.Q8_0)
    return path


@pytest.mark.parametrize(
    "arch, name",
    [("mistral", ""), ("mistral", "mistral"), ("olmo2", ""), ("granite", ""), ("gpt-oss", "")],
)
def test_transformers_cannot_read(tmp_path, arch, name):
    """Why the planner's other GGUF architectures are not cases: transformers refuses them (if
    one starts to load, it becomes a case)."""
    path = _unreadable_file(tmp_path, arch, name)
    errors = {
        "mistral": (NotImplementedError, "Unknown gguf model_type: mistral"),
        "olmo2": (ValueError, "architecture olmo2 is not supported"),
        "granite": (ValueError, "architecture granite is not supported"),
        # the rope.scaling key-values (TypeError); without them, the experts are missing
        "gpt-oss": ((TypeError, RuntimeError), None),
    }
    kind, match = errors[arch]
    with pytest.raises(kind, match=match):
        read_with_transformers(path)


def test_llama_cpp_mistral_is_the_llama_case(tmp_path):
    """llama.cpp's Mistral (``general.architecture`` ``llama``, named for the model) is read by
    transformers as Llama, and planned by shardload as llama: the llama case covers it."""
    path = _unreadable_file(tmp_path, "mistral", "Mistral 7B Instruct")
    assert type(read_with_transformers(path)) is transformers.LlamaForCausalLM
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "llama"


# ---- the bug, minimal ------------------------------------------------------------------------


def _transformers_sizes(case: str) -> set[str]:
    """The config attributes transformers takes from a GGUF key, for ``case``."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    hf = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(case, case)
    return {v for v in GGUF_CONFIG_MAPPING[hf].values() if v}


def test_transformers_reads_no_key_for_the_lost_sizes():
    """Why ``LOST_SIZES``: the sizes a worker changes and transformers reads from no key."""
    assert "head_dim" in _transformers_sizes("llama")  # rope.dimension_count
    assert "head_dim" in _transformers_sizes("gemma2")  # attention.key_length
    assert "head_dim" in _transformers_sizes("qwen3moe")
    for case in ("qwen2", "phi3", "qwen2moe"):
        assert "head_dim" not in _transformers_sizes(case), case
    for case in ("qwen2moe", "qwen3moe"):
        assert "moe_intermediate_size" not in _transformers_sizes(case), case
    assert "shared_expert_intermediate_size" not in _transformers_sizes("qwen2moe")


def test_worker_sizes_qwen2_gguf_at_two_workers(gguf_reference):
    """Minimal reproduction: a Qwen2 GGUF transformers reads whole, over 2 workers. Each worker's
    file says 2 query heads and hidden 128; transformers makes head_dim 64 (not 32) and refuses
    the 64-row q_proj (``ignore_mismatched_sizes``)."""
    ref = gguf_reference("qwen2")
    with ThreadedSession(2) as session, load_tp_model(ref.path, session) as model:
        assert relative(model(PROMPT), ref.logits) < TOLERANCE


def test_worker_sizes_qwen3moe_gguf_at_two_workers(gguf_reference):
    """Minimal reproduction: a Qwen3-MoE GGUF (experts 768 wide: transformers' default, so it
    reads the whole file) over 2 workers: each worker's experts are 384 wide, its file says so
    (``expert_feed_forward_length``), transformers reads 768 and refuses them."""
    path = gguf_reference("qwen3moe").path
    with ThreadedSession(2) as session, load_tp_model(path, session) as model:
        assert relative(model(PROMPT), gguf_reference("qwen3moe").logits) < TOLERANCE
