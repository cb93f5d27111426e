"""GGUF checkpoints of the architectures beyond Llama
(``planners.architectures.GGUF_ARCHITECTURES``): gemma2, gemma3, phi3, olmo2 and granite, as
llama.cpp names their tensors.

Each test model is written with gguf-py's own ``GGUFWriter``; its tensor names are not written
here but mapped from the Hugging Face names by gguf-py's ``TensorNameMap`` for the architecture
(and each checked to be one gguf-py lists for it, ``MODEL_TENSORS``). What each tensor holds is
the HF module's (llama.cpp's converter copies them, fused ones included: Phi-3's
``gate_up_proj`` becomes ``ffn_up`` with 2 x feed_forward_length rows, [gate, up]). The
reference is written from those rules (``helpers.tp_reference``), not from the planner, and
compared with every worker's tensors dequantized by gguf-py's own dequantizer.

llama.cpp's converter permutes q/k rows (rotary pairs) for granite (a ``LlamaModel``) and not for
gemma2, gemma3, phi3 or olmo2; the permutation stays within each head, so head-aligned splits
take the same rows either way: nothing here depends on it.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES
from helpers.gguf_blocks import blocks, dequantized
from helpers.tp_reference import padded_heads, padded_units, rows_of, take

from shardload import ThreadedSession, load_sharded, open_checkpoint
from shardload.cli import cli
from shardload.planners import plan_for
from shardload.planners.architectures import GGUF_ARCHITECTURES
from shardload.planners.spec import spec_from_gguf

HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4, 2, 32, 256, 64
UNPADDED = (1, 2, 4)  # 4 workers: each of the 2 KV heads replicated to 2 of them
PADDED = 3  # 4 query heads over 3 workers: zero-padded
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

# HF module (under model.layers.0. unless it starts with "model." or is lm_head) -> how it
# splits: q / kv rows in whole heads, qkv ([q, k, v]), o (columns in whole query heads), mlp
# rows, gate_up ([gate, up]), down (columns), q_norm / k_norm (a vector split like the q / k
# rows: OLMo-2), rep (replicated)
LLAMA = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "kv",
    "self_attn.v_proj": "kv",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "mlp",
    "mlp.up_proj": "mlp",
    "mlp.down_proj": "down",
    "input_layernorm": "rep",
    "post_attention_layernorm": "rep",
    "model.embed_tokens": "rep",
    "model.norm": "rep",
    "lm_head": "rep",
}
GEMMA2 = {
    **{k: v for k, v in LLAMA.items() if k != "lm_head"},  # tied embeddings
    "pre_feedforward_layernorm": "rep",
    "post_feedforward_layernorm": "rep",
}
ARCHS = {
    # gemma: head_dim explicit (key_length), not hidden / heads
    "gemma2": dict(hidden=96, key_length=True, modules=GEMMA2),
    # per-head q/k norms (head_dim wide): replicated
    "gemma3": dict(
        hidden=96,
        key_length=True,
        modules={**GEMMA2, "self_attn.q_norm": "rep", "self_attn.k_norm": "rep"},
    ),
    "phi3": dict(
        hidden=128,
        key_length=False,
        modules={
            "self_attn.qkv_proj": "qkv",
            "self_attn.o_proj": "o",
            "mlp.gate_up_proj": "gate_up",
            "mlp.down_proj": "down",
            "input_layernorm": "rep",
            "post_attention_layernorm": "rep",
            "model.embed_tokens": "rep",
            "model.norm": "rep",
            "lm_head": "rep",
        },
    ),
    # OLMo-2: norms after attention and MLP only; q/k norms over the whole projection
    "olmo2": dict(
        hidden=128,
        key_length=False,
        modules={
            **{k: v for k, v in LLAMA.items() if k != "input_layernorm"},
            "post_feedforward_layernorm": "rep",
            "self_attn.q_norm": "q_norm",
            "self_attn.k_norm": "k_norm",
        },
    ),
    "granite": dict(hidden=128, key_length=False, modules=LLAMA),
}


def _arch(name: str) -> gguf.MODEL_ARCH:
    return next(a for a, n in MODEL_ARCH_NAMES.items() if n == name)


def gguf_name(arch: str, hf_module: str) -> str:
    """gguf-py's name for an HF module of this architecture, checked to be one it lists."""
    hf = hf_module if hf_module.startswith(("model.", "lm_head")) else f"model.layers.0.{hf_module}"
    mapping = gguf.TensorNameMap(_arch(arch), 1)
    found = mapping.get_type_and_name(hf)
    assert found is not None, f"gguf-py has no {arch} name for {hf}"
    kind, name = found
    assert kind in MODEL_TENSORS[_arch(arch)], f"{name} is not a {arch} tensor in gguf-py"
    return name


def _shape(split: str, hidden: int, hf_module: str) -> tuple[int, ...]:
    if split == "rep":
        if hf_module in ("model.embed_tokens", "lm_head"):
            return (VOCAB, hidden)
        return (HEAD_DIM,) if hf_module.endswith(("q_norm", "k_norm")) else (hidden,)
    return {
        "q": (Q, hidden),
        "kv": (KV, hidden),
        "qkv": (Q + 2 * KV, hidden),
        "o": (hidden, Q),
        "mlp": (INTER, hidden),
        "gate_up": (2 * INTER, hidden),
        "down": (hidden, INTER),
        "q_norm": (Q,),
        "k_norm": (KV,),
    }[split]


def write_model(path: str, arch: str, qtype: T) -> dict[str, str]:
    """A one-layer ``arch`` GGUF with its linear weights in ``qtype`` (Q8_0 embeddings, F32
    vectors); the split kind of each tensor, by GGUF name."""
    spec = ARCHS[arch]
    hidden = spec["hidden"]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    if spec["key_length"]:
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    kinds = {}
    for module, split in spec["modules"].items():
        name = gguf_name(arch, module) + ".weight"
        shape = _shape(split, hidden, module)
        kinds[name] = split
        if len(shape) == 1:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
        elif split == "rep":  # embeddings, lm_head
            writer.add_tensor(name, blocks(rng, T.Q8_0, *shape), raw_dtype=T.Q8_0)
        elif qtype == T.F16:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
        else:
            writer.add_tensor(name, blocks(rng, qtype, *shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kinds


def _want(whole: np.ndarray, split: str, n: int, i: int) -> np.ndarray:
    """Worker i's part of ``whole`` (dequantized) for an N the heads and MLP divide."""
    if split == "rep":
        return whole
    if split in ("q", "q_norm"):
        return whole[rows_of(n, i, Q, HEADS, False)]
    if split in ("kv", "k_norm"):
        return whole[rows_of(n, i, KV, KV_HEADS, True)]
    if split == "qkv":
        q, k, v = np.split(whole, [Q, Q + KV])
        return np.concatenate(
            [
                q[rows_of(n, i, Q, HEADS, False)],
                k[rows_of(n, i, KV, KV_HEADS, True)],
                v[rows_of(n, i, KV, KV_HEADS, True)],
            ]
        )
    if split == "mlp":
        return np.split(whole, n)[i]
    if split == "gate_up":
        gate, up = np.split(whole, 2)
        return np.concatenate([np.split(gate, n)[i], np.split(up, n)[i]])
    return np.split(whole, n, axis=1)[i]  # o, down


def _want_padded(
    whole: np.ndarray, split: str, q_heads: list, kv_heads: list, mlp: list, block: int
) -> np.ndarray:
    """A worker's part of ``whole`` in a zero-padded plan (-1: a zero head or block)."""
    if split == "rep":
        return whole
    if split in ("q", "q_norm"):
        return take(whole, q_heads, HEAD_DIM, 0)
    if split in ("kv", "k_norm"):
        return take(whole, kv_heads, HEAD_DIM, 0)
    if split == "qkv":
        q, k, v = np.split(whole, [Q, Q + KV])
        return np.concatenate(
            [
                take(q, q_heads, HEAD_DIM, 0),
                take(k, kv_heads, HEAD_DIM, 0),
                take(v, kv_heads, HEAD_DIM, 0),
            ]
        )
    if split == "o":
        return take(whole, q_heads, HEAD_DIM, 1)
    if split == "mlp":
        return take(whole, mlp, block, 0)
    if split == "gate_up":
        gate, up = np.split(whole, 2)
        return np.concatenate([take(gate, mlp, block, 0), take(up, mlp, block, 0)])
    return take(whole, mlp, block, 1)  # down


def _load(path: str, n: int):
    with open_checkpoint(path) as ckpt:
        info = plan_for(ckpt, num_shards=n)
        with ThreadedSession(n) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
            return info, [result.worker(i) for i in range(n)]


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_worker_dequantizes_to_its_slice(tmp_path, arch, qtype):
    path = str(tmp_path / f"{arch}.gguf")
    kinds = write_model(path, arch, qtype)
    full = {t.name: (np.array(t.data), T(t.tensor_type)) for t in gguf.GGUFReader(path).tensors}
    assert set(full) == set(kinds)
    for n in UNPADDED:
        info, shards = _load(path, n)
        assert "tensor_parallel" not in info.metadata
        for name, (raw, stored) in full.items():
            whole = dequantized(raw, stored)
            for i in range(n):
                piece = shards[i][name].numpy()
                if kinds[name] == "rep":  # replicated, bytes and all
                    assert np.array_equal(piece, raw), name
                want = _want(whole, kinds[name], n, i)
                assert np.array_equal(dequantized(piece, stored), want), f"{name} worker {i} of {n}"

    info, shards = _load(path, PADDED)
    layout = info.metadata["tensor_parallel"]
    q_heads, kv_heads = padded_heads(HEADS, KV_HEADS, PADDED)
    block = 1 if qtype == T.F16 else 32
    mlp = padded_units(INTER // block, PADDED)
    assert (layout["q_heads"], layout["kv_heads"]) == (q_heads, kv_heads)
    assert (layout["mlp_block"], layout["mlp_blocks"]) == (block, {str(INTER): mlp})
    if arch == "olmo2":  # the norms' mean runs over the real projection width
        assert layout["projection_norms"] == {"attn_q_norm": Q, "attn_k_norm": KV}
    else:
        assert "projection_norms" not in layout
    for name, (raw, stored) in full.items():
        whole = dequantized(raw, stored)
        for i in range(PADDED):
            want = _want_padded(whole, kinds[name], q_heads[i], kv_heads[i], mlp[i], block)
            got = dequantized(shards[i][name].numpy(), stored)
            assert np.array_equal(got, want), f"{name} worker {i} of {PADDED} (padded)"


# what the planner does with every tensor gguf-py lists for the architecture, beyond those the
# test models hold: other forms of the same layers, and tensors that are never split
OTHER_FORMS = {
    "attn_q": "q",
    "attn_k": "kv",
    "attn_v": "kv",
    "output": "rep",
    "rope_freqs": "rep",
    "rope_factors_long": "rep",
    "rope_factors_short": "rep",
}
ROLE_SPLITS = {
    "q": "q",
    "k": "kv",
    "v": "kv",
    "qkv": "qkv",
    "o": "o",
    "gate": "mlp",
    "up": "mlp",
    "gate_up": "gate_up",
    "down": "down",
    "q_norm": "q_norm",
    "k_norm": "k_norm",
    "embed": "rep",
    "lm_head": "rep",
    None: "rep",
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_tensor_gguf_py_lists_has_its_role(arch):
    """The planner's roles (by GGUF name) against the HF modules gguf-py maps to each name."""
    spec = spec_from_gguf(
        {
            "general.architecture": arch,
            f"{arch}.attention.head_count": HEADS,
            f"{arch}.embedding_length": ARCHS[arch]["hidden"],
            f"{arch}.attention.key_length": HEAD_DIM,
            f"{arch}.block_count": 1,
        },
        "m.gguf",
    )
    assert spec.rules is GGUF_ARCHITECTURES[arch]
    expected = {gguf_name(arch, m): split for m, split in ARCHS[arch]["modules"].items()}
    for kind in MODEL_TENSORS[_arch(arch)]:
        name = TENSOR_NAMES[kind].format(bid=0)
        want = expected.get(name, OTHER_FORMS.get(name.rpartition(".")[2]))
        assert want is not None, f"{arch}: {name} is new to this test"
        role = spec.rules.role_of(name + ".weight")
        got = ROLE_SPLITS[role and role.name]
        assert got == want, f"{arch}: {name} splits as {got}, not {want}"


def test_phi3_separate_gate_and_up_are_refused_by_shape(tmp_path):
    # phi3's ffn_up is [gate, up]: a file with half as many rows disagrees with the metadata
    from shardload import FormatError

    path = str(tmp_path / "phi3.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    for add, value in (
        (writer.add_block_count, 1),
        (writer.add_embedding_length, 128),
        (writer.add_feed_forward_length, INTER),
        (writer.add_head_count, HEADS),
        (writer.add_head_count_kv, KV_HEADS),
    ):
        add(value)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((INTER, 128), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FormatError, match=r"blk.0.ffn_up.weight.*must be 512"):
        plan_for(path, num_shards=2)


def test_cli_plan(tmp_path):
    path = str(tmp_path / "phi3.gguf")
    write_model(path, "phi3", T.Q8_0)
    plan = tmp_path / "shard_info.json"
    result = CliRunner().invoke(cli, ["plan", "--shards", "2", "-o", str(plan), path])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("phi3, 1 layers") and "valid for N in 1, 2, 4" in result.output
    steps = json.loads(plan.read_text())
    # [gate, up] and [q, k, v] split segment by segment (segments in rows: size, units)
    assert steps["blk.0.ffn_up.weight"][0][0] == "shardload.split_segments"
    assert steps["blk.0.ffn_up.weight"][0][2:] == [0, INTER, INTER, INTER, INTER]
    assert steps["blk.0.attn_qkv.weight"][0][2:] == [0, Q, HEADS, KV, -KV_HEADS, KV, -KV_HEADS]
    checked = CliRunner().invoke(
        cli, ["validate", "--shards", "4", "--shard-info", str(plan), path]
    )
    assert checked.exit_code == 0 and checked.output.startswith("ok:"), checked.output
