"""Tiny random-weight checkpoints for the vLLM engine tests, made once into a cache outside the
repository (``$SHARDLOAD_CACHE/vllm-models/<name>``, default ``~/.cache/shardload``).

    python tests/helpers/vllm_models.py [NAME...]     # makes them (default: all), prints folders

``path(name)`` gives a model's folder, making it on first use; ``MODELS`` names them. All are
vocabulary 512, 2 layers, 256 positions, untied embeddings, no tokenizer (the engine tests
prompt with token ids). The bf16 ones are transformers' own random initialisation (seed 0)
saved by ``save_pretrained``; the quantized ones are ``llama_bf16``'s weights:

* ``llama_w8a8``, ``llama_w4a16``: quantized and compressed by compressed-tensors itself
  (``helpers.compressed_tensors_tool``, as llm-compressor does), from the same seed and config,
  so the same weights before quantization;
* ``llama_gptq``, ``llama_awq``: written here from the formats' definitions, round-to-nearest
  per group of 32 input rows, from ``llama_bf16``'s saved weights; embeddings, norms and
  ``lm_head`` unquantized in fp16;
* ``llama160_gptqmodel``, ``llama160_gptqmodel_act``: ``llama160_bf16`` quantized by GPTQModel
  itself (``helpers.gptqmodel_tool``, in the environment ``scripts/quant-tools-env.sh`` makes),
  as the GPTQ checkpoints people serve are: a trivial ``g_idx``, and act-order.

Deterministic (fixed seeds; GPTQModel's calibration data are seeded random token ids) and
atomic: each is made in a temporary folder beside its final one, marked complete, then renamed
into place; a folder with the marker is reused as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["AWQ_ORDER", "GROUP", "MODELS", "main", "path", "root"]

_DONE = ".complete"
GROUP = 32
#: AWQ's GEMM packing: nibble i (bits 4*i) of a word holds column 8*word + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

MODELS: dict[str, str] = {
    "llama_bf16": "LlamaForCausalLM, hidden 256, 8 heads, 2 KV heads (head_dim 32), "
    "intermediate 512; bf16",
    "llama9_bf16": "LlamaForCausalLM with SmolLM2-135M's attention shape: hidden 576, 9 heads, "
    "3 KV heads (head_dim 64), intermediate 1536; bf16",
    "qwen2_moe_bf16": "Qwen2MoeForCausalLM, hidden 256, 8 heads, 2 KV heads, 8 experts top-2 "
    "(moe_intermediate 128), shared expert 256, intermediate 512; bf16",
    "llama_w8a8": "llama_bf16 by compressed-tensors preset W8A8 (int-quantized: int8 weights "
    "per channel, dynamic per-token int8 activations); lm_head unquantized",
    "llama_w4a16": "llama_bf16 by compressed-tensors W4A16 (pack-quantized: symmetric int4 "
    "weights in groups of 32); lm_head unquantized",
    "llama_gptq": "llama_bf16 in GPTQ v1 layout: 4-bit symmetric, group 32, desc_act false, "
    "round-to-nearest; fp16",
    "llama_awq": "llama_bf16 in AWQ GEMM layout: 4-bit with zero points, group 32, "
    "round-to-nearest; fp16",
    # an MLP of 5 groups of 32: no TP > 1 splits it into whole groups of 32 rows per rank
    "llama160_bf16": "llama_bf16's shape but intermediate 160 (5 groups of 32); bf16",
    "llama160_gptq": "llama160_bf16 in GPTQ v1 layout as llama_gptq (trivial g_idx); fp16",
    "llama160_gptqmodel": "llama160_bf16 quantized by GPTQModel: 4-bit symmetric, group 32, "
    "desc_act false (a trivial g_idx); bf16 elsewhere",
    "llama160_gptqmodel_act": "llama160_bf16 quantized by GPTQModel with act-order (desc_act "
    "true: a g_idx that permutes the groups); bf16 elsewhere",
    "llama160_w4a16": "llama160_bf16's config by compressed-tensors W4A16 (symmetric int4, "
    "groups of 32), as llama_w4a16",
    # a second checkpoint of the same model, for refits: another seed, as a step of training
    # gives other weights of the same tensors
    "llama_bf16_seed1": "llama_bf16's config, torch seed 1; bf16",
    "llama9_bf16_seed1": "llama9_bf16's config, torch seed 1; bf16",
    "llama_w8a8_seed1": "llama_w8a8 from torch seed 1",
    "llama_w4a16_seed1": "llama_w4a16 from torch seed 1",
    "llama_gptq_seed1": "llama_gptq of llama_bf16_seed1's weights",
    "llama_awq_seed1": "llama_awq of llama_bf16_seed1's weights",
    "qwen2_moe576_bf16": "Qwen2MoeForCausalLM, hidden 384, 12 heads, 3 KV heads, 8 experts "
    "top-2 (moe_intermediate 128), shared expert 256, vocabulary 576 "
    "(vLLM's 64-row padding then divides by 3): at TP=3 the experts of "
    "128 rows and the shared expert of 256 pad, the heads do not; bf16",
}

_COMMON = dict(
    vocab_size=512,
    num_hidden_layers=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    dtype="bfloat16",
)


def root() -> Path:
    """``$SHARDLOAD_CACHE/vllm-models`` (default ``~/.cache/shardload/vllm-models``)."""
    from devtools.environments import cache_root

    return cache_root() / "vllm-models"


def path(name: str) -> Path:
    """The folder of model ``name`` (one of ``MODELS``), made on first use."""
    if name not in MODELS:
        raise KeyError(f"no test model {name!r}; the models are {', '.join(MODELS)}")
    folder = root() / name
    if (folder / _DONE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's is 0700
        _MAKERS[name](tmp)
        (tmp / _DONE).write_text(MODELS[name] + "\n")
        if folder.exists() and not (folder / _DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a partial one, of older code
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / _DONE).exists():  # not another process's, made meanwhile
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ---- configs -------------------------------------------------------------------------------------


def _llama_config(hidden=256, heads=8, kv=2, head_dim=32, inter=512):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        **_COMMON,
    )


def _qwen2_moe_config(**sizes):
    import transformers

    return transformers.Qwen2MoeConfig(
        **{
            **dict(
                hidden_size=256,
                num_attention_heads=8,
                num_key_value_heads=2,
                intermediate_size=512,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=256,
                **_COMMON,
            ),
            **sizes,
        }
    )


# ---- bf16: transformers' own random initialisation -----------------------------------------------


def _random(config, folder: Path, seed: int = 0) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)  # compressed_tensors_tool seeds the same way: the same weights
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.dtype == torch.bfloat16, model.dtype
    model.save_pretrained(folder)


def _make_llama_bf16(folder: Path) -> None:
    _random(_llama_config(), folder)


def _llama9_config():
    return _llama_config(hidden=576, heads=9, kv=3, head_dim=64, inter=1536)


def _make_llama9_bf16(folder: Path) -> None:
    _random(_llama9_config(), folder)


def _make_llama160_bf16(folder: Path) -> None:
    _random(_llama_config(inter=160), folder)


def _make_qwen2_moe_bf16(folder: Path) -> None:
    _random(_qwen2_moe_config(), folder)


def _make_qwen2_moe576_bf16(folder: Path) -> None:
    _random(
        _qwen2_moe_config(
            vocab_size=576, hidden_size=384, num_attention_heads=12, num_key_value_heads=3
        ),
        folder,
    )


# ---- compressed-tensors, by the library itself ---------------------------------------------------


def _make_llama_w8a8(folder: Path, seed: int = 0) -> None:
    from helpers.compressed_tensors_tool import compress_preset

    _scheme, fmt = compress_preset(folder, _llama_config(), "W8A8", seed=seed)
    assert fmt == "int-quantized", fmt


def _make_llama_w4a16(folder: Path, seed: int = 0) -> None:
    from helpers.compressed_tensors_tool import compress_w4a16

    compress_w4a16(folder, _llama_config(), symmetric=True, group=GROUP, seed=seed)


def _make_llama160_w4a16(folder: Path) -> None:
    from helpers.compressed_tensors_tool import compress_w4a16

    compress_w4a16(folder, _llama_config(inter=160), symmetric=True, group=GROUP)


# ---- GPTQ and AWQ, from the formats' definitions -------------------------------------------------

_LINEAR = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _pack(codes: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """4-bit codes -> int32 words of 8 along ``axis``: nibble i (bits 4*i) of word w holds
    element 8*w + order[i]."""
    codes = np.moveaxis(codes.astype(np.uint32), axis, 0)
    words = np.zeros((codes.shape[0] // 8, *codes.shape[1:]), dtype=np.uint32)
    for i, j in enumerate(order):
        words |= codes[j::8] << np.uint32(4 * i)
    return np.moveaxis(words, 0, axis).view(np.int32)


def _groups(w: np.ndarray) -> np.ndarray:
    """HF weight [N, K] -> [K/G, G, N] float32 (both formats store K first)."""
    wt = w.T.astype(np.float32)
    return wt.reshape(wt.shape[0] // GROUP, GROUP, wt.shape[1])


def quantize_gptq_sym(w: np.ndarray) -> dict[str, np.ndarray]:
    """GPTQ v1, 4-bit symmetric (AutoGPTQ's quantizer): scale = 2*max|w|/15 per group and
    column, zero 8, q = clamp(round(w/scale) + 8, 0, 15); qzeros store zero - 1 = 7."""
    g = _groups(w)
    amax = np.abs(g).max(axis=1)  # [K/G, N]
    scale = np.where(amax == 0, 1.0, 2 * amax / 15).astype(np.float16)
    s = scale.astype(np.float32)[:, None, :]
    q = np.clip(np.round(g / s) + 8, 0, 15).reshape(-1, g.shape[2])  # [K, N]
    k, n = q.shape
    return {
        "qweight": _pack(q, 0),  # [K/8, N]
        "qzeros": _pack(np.full((k // GROUP, n), 8 - 1), 1),  # [K/G, N/8]
        "scales": scale,  # [K/G, N]
        "g_idx": (np.arange(k) // GROUP).astype(np.int32),
    }  # [K]


def quantize_awq(w: np.ndarray) -> dict[str, np.ndarray]:
    """AWQ GEMM, 4-bit with zero points (AutoAWQ's round-to-nearest): scale = (max - min)/15,
    zero = clamp(round(-min/scale), 0, 15), q = clamp(round(w/scale) + zero, 0, 15); codes and
    zeros packed along N in AWQ's interleaved order, zeros stored as they are."""
    g = _groups(w)
    lo, hi = g.min(axis=1), g.max(axis=1)  # [K/G, N]
    scale = (np.maximum(hi - lo, 1e-5) / 15).astype(np.float16)
    s = scale.astype(np.float32)
    zero = np.clip(np.round(-lo / s), 0, 15)
    q = np.clip(np.round(g / s[:, None, :]) + zero[:, None, :], 0, 15).reshape(-1, g.shape[2])
    return {
        "qweight": _pack(q, 1, AWQ_ORDER),  # [K, N/8]
        "qzeros": _pack(zero, 1, AWQ_ORDER),  # [K/G, N/8]
        "scales": scale,
    }  # [K/G, N]


def _quantized_llama(
    folder: Path, quantize, quant_config: dict, extra_files: dict, source: str = "llama_bf16"
) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    source = path(source)
    weights = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.endswith(_LINEAR):
            for key, value in quantize(tensor.float().numpy()).items():
                out[f"{prefix}.{key}"] = torch.from_numpy(np.ascontiguousarray(value))
        else:
            out[name] = tensor.to(torch.float16)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "float16"
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file, content in extra_files.items():
        (folder / file).write_text(json.dumps(content, indent=2) + "\n")
    if (source / "generation_config.json").exists():
        shutil.copy(source / "generation_config.json", folder / "generation_config.json")


def _make_llama_gptq(folder: Path, source: str = "llama_bf16") -> None:
    quant = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    _quantized_llama(
        folder,
        quantize_gptq_sym,
        quant,
        {"quantize_config.json": {k: v for k, v in quant.items() if k != "quant_method"}},
        source=source,
    )


def _make_llama160_gptq(folder: Path) -> None:
    quant = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    _quantized_llama(folder, quantize_gptq_sym, quant, {}, source="llama160_bf16")


def _make_llama160_gptqmodel(folder: Path, desc_act: bool = False) -> None:
    from helpers.gptqmodel_tool import quantize

    quantize(path("llama160_bf16"), folder, bits=4, group=GROUP, desc_act=desc_act)


def _make_llama_awq(folder: Path, source: str = "llama_bf16") -> None:
    quant = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _quantized_llama(folder, quantize_awq, quant, {}, source=source)


_MAKERS = {
    "llama_bf16": _make_llama_bf16,
    "llama9_bf16": _make_llama9_bf16,
    "qwen2_moe_bf16": _make_qwen2_moe_bf16,
    "llama_w8a8": _make_llama_w8a8,
    "llama_w4a16": _make_llama_w4a16,
    "llama_gptq": _make_llama_gptq,
    "llama_awq": _make_llama_awq,
    "llama160_bf16": _make_llama160_bf16,
    "llama160_gptq": _make_llama160_gptq,
    "llama160_gptqmodel": _make_llama160_gptqmodel,
    "llama160_gptqmodel_act": lambda folder: _make_llama160_gptqmodel(folder, desc_act=True),
    "llama160_w4a16": _make_llama160_w4a16,
    "qwen2_moe576_bf16": _make_qwen2_moe576_bf16,
    "llama_bf16_seed1": lambda folder: _random(_llama_config(), folder, seed=1),
    "llama9_bf16_seed1": lambda folder: _random(_llama9_config(), folder, seed=1),
    "llama_w8a8_seed1": lambda folder: _make_llama_w8a8(folder, seed=1),
    "llama_w4a16_seed1": lambda folder: _make_llama_w4a16(folder, seed=1),
    "llama_gptq_seed1": lambda folder: _make_llama_gptq(folder, source="llama_bf16_seed1"),
    "llama_awq_seed1": lambda folder: _make_llama_awq(folder, source="llama_bf16_seed1"),
}
assert _MAKERS.keys() == MODELS.keys()


def main(argv: list[str] | None = None) -> None:
    names = (sys.argv[1:] if argv is None else argv) or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"no test model {', '.join(unknown)}; the models are {', '.join(MODELS)}")
    for name in names:
        start = time.perf_counter()
        folder = path(name)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        print(f"{name}\t{folder}\t{size / 2**20:.2f} MiB\t{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    # tests/, for helpers.*, and the checkout, for devtools
    sys.path[:0] = [str(Path(__file__).resolve().parents[n]) for n in (1, 2)]
    main()
