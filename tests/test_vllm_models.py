"""The tiny checkpoints ``helpers.vllm_models`` makes for the vLLM engine tests, checked without
vLLM against references written here from the formats' definitions (numpy, no shardload): each
quantized layer dequantizes to ``llama_bf16``'s weight within its quantization step, and the
configs carry the quantization_config vLLM reads. They are made into a temporary cache (a few
seconds), twice, to check that making them is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import vllm_models
from safetensors.torch import load_file

LINEAR = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _make_all(cache: Path) -> dict[str, Path]:
    # the models' folder moves, not SHARDLOAD_CACHE: the environments (GPTQModel's) stay
    # where their scripts made them
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_models, "root", lambda: cache / "vllm-models")
        return {name: vllm_models.path(name) for name in vllm_models.MODELS}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return _make_all(tmp_path_factory.mktemp("cache"))


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor as numpy, bf16 as float32 (numpy has no bf16)."""
    import torch

    return {
        k: (v.float() if v.dtype == torch.bfloat16 else v).numpy()
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }


@pytest.fixture(scope="module")
def bf16(models) -> dict[str, np.ndarray]:
    return _tensors(models["llama_bf16"])


def _linear_names(bf16: dict) -> list[str]:
    return [
        k[: -len(".weight")]
        for k in bf16
        if k.endswith(".weight") and k[: -len(".weight")].endswith(LINEAR)
    ]


# ---- references, from the formats' definitions ---------------------------------------------------


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., W] -> their 8 nibbles [..., W, 8], least significant first."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return np.stack([(u >> (4 * i)) & 0xF for i in range(8)], axis=-1)


def gptq_v1_dequantize(qweight, qzeros, scales, g_idx) -> np.ndarray:
    """GPTQ v1: W[n, k] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1)), g = g_idx[k]; qweight
    [K/8, N] packs 8 rows k per word (row 8w + i at bits 4i), qzeros [K/G, N/8] 8 columns."""
    q = np.moveaxis(_nibbles(qweight), -1, 1).reshape(-1, qweight.shape[1])  # [K, N]
    z = (_nibbles(qzeros).reshape(qzeros.shape[0], -1) + 1) & 0xF  # [K/G, N]
    g = g_idx.astype(np.int64)
    return (scales.astype(np.float32)[g] * (q - z[g])).T


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AutoAWQ's: column j of a word is nibble REV[j]


def awq_unpack(words: np.ndarray) -> np.ndarray:
    """AWQ GEMM [R, N/8] int32 -> [R, N] codes, undoing the [0,2,4,6,1,3,5,7] interleave."""
    return _nibbles(words)[..., AWQ_REVERSE_ORDER].reshape(words.shape[0], -1)


def awq_dequantize(qweight, qzeros, scales, group: int) -> np.ndarray:
    """AWQ GEMM: W[n, k] = scales[k // G, n] * (q[k, n] - z[k // G, n])."""
    q, z = awq_unpack(qweight), awq_unpack(qzeros)
    g = np.arange(q.shape[0]) // group
    return (scales.astype(np.float32)[g] * (q - z[g])).T


def pack_quantized_dequantize(packed, scale, shape, group: int | None) -> np.ndarray:
    """compressed-tensors pack-quantized int4, symmetric: [N, K/8] int32, element 8w + i of a
    row at bits 4i of word w, stored plus 8; W[n, k] = scale[n, k // G] * (code - 8)."""
    n, k = (int(x) for x in shape)
    codes = _nibbles(packed).reshape(n, -1)[:, :k] - 8
    g = np.arange(k) // (group or k)
    return scale[:, g] * codes


def _steps(scales_kn: np.ndarray, group: int, k: int) -> np.ndarray:
    """[K/G, N] scales -> the step of each element of the HF weight [N, K]."""
    return scales_kn.astype(np.float32)[np.arange(k) // group].T


# ---- the bf16 models -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, arch, hidden, heads, kv, head_dim, inter",
    [
        ("llama_bf16", "LlamaForCausalLM", 256, 8, 2, 32, 512),
        ("llama9_bf16", "LlamaForCausalLM", 576, 9, 3, 64, 1536),
        ("qwen2_moe_bf16", "Qwen2MoeForCausalLM", 256, 8, 2, 32, 512),
    ],
)
def test_bf16_models_have_the_asked_shapes(models, name, arch, hidden, heads, kv, head_dim, inter):
    import torch

    folder = models[name]
    c = _config(folder)
    assert c["architectures"] == [arch] and "quantization_config" not in c
    assert (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["intermediate_size"],
    ) == (hidden, heads, kv, inter)
    assert c.get("head_dim", hidden // heads) == head_dim
    assert (
        c["vocab_size"],
        c["num_hidden_layers"],
        c["max_position_embeddings"],
        c["tie_word_embeddings"],
        c["dtype"],
    ) == (512, 2, 256, False, "bfloat16")
    t = load_file(str(folder / "model.safetensors"))
    assert {v.dtype for v in t.values()} == {torch.bfloat16}
    assert t["lm_head.weight"].shape == t["model.embed_tokens.weight"].shape == (512, hidden)
    assert not torch.equal(t["lm_head.weight"], t["model.embed_tokens.weight"])
    p = "model.layers.1."
    assert t[p + "self_attn.q_proj.weight"].shape == (heads * head_dim, hidden)
    assert t[p + "self_attn.k_proj.weight"].shape == (kv * head_dim, hidden)
    assert t[p + "self_attn.o_proj.weight"].shape == (hidden, heads * head_dim)
    if arch == "Qwen2MoeForCausalLM":
        assert (
            c["num_experts"],
            c["num_experts_per_tok"],
            c["moe_intermediate_size"],
            c["shared_expert_intermediate_size"],
        ) == (8, 2, 128, 256)
        assert t[p + "mlp.gate.weight"].shape == (8, hidden)
        for e in range(8):  # per-expert tensors, as vLLM's loader names them
            assert t[p + f"mlp.experts.{e}.gate_proj.weight"].shape == (128, hidden)
            assert t[p + f"mlp.experts.{e}.down_proj.weight"].shape == (hidden, 128)
        assert t[p + "mlp.shared_expert.up_proj.weight"].shape == (256, hidden)
        assert t[p + "mlp.shared_expert_gate.weight"].shape == (1, hidden)
    else:
        assert t[p + "mlp.down_proj.weight"].shape == (hidden, inter)


# ---- GPTQ and AWQ --------------------------------------------------------------------------------


def _unquantized_are_fp16_copies(q: dict, bf16: dict) -> None:
    for name, w in bf16.items():
        if not name[: -len(".weight")].endswith(LINEAR):
            assert q[name].dtype == np.float16, name
            np.testing.assert_array_equal(q[name], w.astype(np.float16))


def test_gptq_is_llama_bf16_in_v1_layout_symmetric(models, bf16):
    folder = models["llama_gptq"]
    c = _config(folder)
    assert c["quantization_config"] == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    assert c["dtype"] == "float16"
    q = _tensors(folder)
    _unquantized_are_fp16_copies(q, bf16)
    layers = _linear_names(bf16)
    assert len(layers) == 14
    for p in layers:
        w = bf16[p + ".weight"]
        n, k = w.shape
        qw, qz, s, g = (q[f"{p}.{x}"] for x in ("qweight", "qzeros", "scales", "g_idx"))
        assert (qw.dtype, qz.dtype, s.dtype, g.dtype) == (np.int32, np.int32, np.float16, np.int32)
        assert (qw.shape, qz.shape, s.shape, g.shape) == (
            (k // 8, n),
            (k // 32, n // 8),
            (k // 32, n),
            (k,),
        )
        np.testing.assert_array_equal(g, np.arange(k) // 32)
        assert (qz.view(np.uint32) == 0x77777777).all()  # zero 8, stored minus one
        err = np.abs(gptq_v1_dequantize(qw, qz, s, g) - w)
        step = _steps(s, 32, k)
        assert (err <= 0.51 * step).all(), (p, (err / step).max())  # round to nearest
        # symmetric: the step is 2 max|w| / 15 of its group
        amax = np.abs(w.T.reshape(k // 32, 32, n)).max(axis=1)
        np.testing.assert_allclose(s.astype(np.float32), 2 * amax / 15, rtol=1e-3)


def test_awq_is_llama_bf16_in_gemm_layout(models, bf16):
    folder = models["llama_awq"]
    c = _config(folder)
    qc = c["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")} == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    assert c["dtype"] == "float16"
    q = _tensors(folder)
    _unquantized_are_fp16_copies(q, bf16)
    for p in _linear_names(bf16):
        w = bf16[p + ".weight"]
        n, k = w.shape
        qw, qz, s = q[p + ".qweight"], q[p + ".qzeros"], q[p + ".scales"]
        assert (qw.dtype, qz.dtype, s.dtype) == (np.int32, np.int32, np.float16)
        assert (qw.shape, qz.shape, s.shape) == ((k, n // 8), (k // 32, n // 8), (k // 32, n))
        assert set(f"{p}.{x}" for x in ("qweight", "qzeros", "scales")) == {
            key for key in q if key.startswith(p + ".")
        }
        err = np.abs(awq_dequantize(qw, qz, s, 32) - w)
        step = _steps(s, 32, k)
        assert (err <= 0.51 * step).all(), (p, (err / step).max())
        # the interleave is there: read in plain order, the codes are the wrong columns
        plain = _nibbles(qw).reshape(k, n)
        assert not np.array_equal(plain, awq_unpack(qw))
        # asymmetric: the step spans its group's range in 15
        groups = w.T.reshape(k // 32, 32, n)
        np.testing.assert_allclose(
            s.astype(np.float32), (groups.max(axis=1) - groups.min(axis=1)) / 15, rtol=1e-3
        )


# ---- compressed-tensors --------------------------------------------------------------------------


def _ct_config(folder: Path) -> dict:
    qc = _config(folder)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    return qc


def test_w8a8_is_llama_bf16_int8_per_channel_dynamic_per_token(models, bf16):
    folder = models["llama_w8a8"]
    qc = _ct_config(folder)
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "int-quantized"
    w_args, a_args = group["weights"], group["input_activations"]
    assert (w_args["num_bits"], w_args["type"], w_args["strategy"], w_args["symmetric"]) == (
        8,
        "int",
        "channel",
        True,
    )
    assert (
        a_args["num_bits"],
        a_args["type"],
        a_args["strategy"],
        a_args["dynamic"],
        a_args["symmetric"],
    ) == (8, "int", "token", True, True)
    q = _tensors(folder)
    np.testing.assert_array_equal(q["lm_head.weight"], bf16["lm_head.weight"])
    for p in _linear_names(bf16):
        w, codes, scale = bf16[p + ".weight"], q[p + ".weight"], q[p + ".weight_scale"]
        assert codes.dtype == np.int8 and codes.shape == w.shape
        assert scale.shape == (w.shape[0], 1)
        np.testing.assert_allclose(scale[:, 0], np.abs(w).max(axis=1) / 127, rtol=1e-2)
        err = np.abs(codes * scale - w)
        assert (err <= scale).all(), (p, (err / scale).max())


def test_w4a16_is_llama_bf16_pack_quantized_int4_groups_of_32(models, bf16):
    folder = models["llama_w4a16"]
    qc = _ct_config(folder)
    (group,) = qc["config_groups"].values()
    assert qc["format"] == "pack-quantized" and group["input_activations"] is None
    w_args = group["weights"]
    assert (
        w_args["num_bits"],
        w_args["type"],
        w_args["strategy"],
        w_args["group_size"],
        w_args["symmetric"],
    ) == (4, "int", "group", 32, True)
    q = _tensors(folder)
    np.testing.assert_array_equal(q["lm_head.weight"], bf16["lm_head.weight"])
    for p in _linear_names(bf16):
        w = bf16[p + ".weight"]
        n, k = w.shape
        packed, scale, shape = (
            q[f"{p}.{x}"] for x in ("weight_packed", "weight_scale", "weight_shape")
        )
        assert packed.dtype == np.int32 and packed.shape == (n, k // 8)
        assert scale.shape == (n, k // 32) and list(shape) == [n, k]
        step = scale[:, np.arange(k) // 32]
        err = np.abs(pack_quantized_dequantize(packed, scale, shape, 32) - w)
        assert (err <= step).all(), (p, (err / step).max())


# ---- the cache -----------------------------------------------------------------------------------


def _config(folder):
    """config.json, less the scratch folder GPTQModel records it quantized in (a fresh temporary
    name each run)."""
    config = json.loads((folder / "config.json").read_text())
    config.get("quantization_config", {}).get("meta", {}).pop("offload_to_disk_path", None)
    return config


def test_making_is_deterministic_atomic_and_made_once(models, tmp_path, monkeypatch):
    again = _make_all(tmp_path)
    for name, folder in models.items():
        assert (folder / ".complete").exists()
        assert folder.parent.name == "vllm-models" and folder.name == name
        assert (folder / "model.safetensors").read_bytes() == (
            again[name] / "model.safetensors"
        ).read_bytes(), name
        assert _config(folder) == _config(again[name]), name
    assert not [
        p for p in tmp_path.joinpath("vllm-models").iterdir() if p.name.startswith(".")
    ]  # no temporary folders left
    monkeypatch.setattr(vllm_models, "root", lambda: tmp_path / "vllm-models")
    mtime = (again["llama_gptq"] / "model.safetensors").stat().st_mtime_ns
    assert vllm_models.path("llama_gptq") == again["llama_gptq"]
    assert (again["llama_gptq"] / "model.safetensors").stat().st_mtime_ns == mtime
    # a folder without the marker (an interrupted run of older code) is made again
    (again["llama_awq"] / ".complete").unlink()
    (again["llama_awq"] / "model.safetensors").write_bytes(b"partial")
    assert vllm_models.path("llama_awq") == again["llama_awq"]
    assert (again["llama_awq"] / "model.safetensors").read_bytes() == (
        models["llama_awq"] / "model.safetensors"
    ).read_bytes()
    with pytest.raises(KeyError, match="no test model 'nope'; the models are llama_bf16"):
        vllm_models.path("nope")
