"""gpt-oss as llama.cpp's converter writes it to GGUF (``general.architecture`` ``gpt-oss``).

The test model (``helpers.gpt_oss_gguf``) is written with gguf-py's own ``GGUFWriter``, with
the tensors and keys llama.cpp's ``convert_hf_to_gguf.py`` (``GptOssModel``) writes for gpt-oss;
each tensor name is gguf-py's (``TENSOR_NAMES``), checked to be one gguf-py lists for
``MODEL_ARCH.GPT_OSS`` (``MODEL_TENSORS``), and the model holds every tensor gguf-py lists for
it:

* per block ``attn_norm``, ``post_attention_norm``; ``attn_q/k/v/output`` with ``.weight``
  and ``.bias``; ``attn_sinks.weight`` [n_head] (one learned logit per query head);
  ``ffn_gate_inp.weight`` [E, hidden] and ``.bias`` [E] (the router);
* the stacked experts: ``ffn_gate_exps`` and ``ffn_up_exps`` [E, inter, hidden] (numpy order;
  GGUF's ``ne`` is reversed: [hidden, inter, E]; HF's interleaved ``gate_up_proj`` is
  de-interleaved by the converter), ``ffn_down_exps`` [E, hidden, inter], in MXFP4 (32-element
  blocks of 17 bytes along K: one E8M0 exponent, 16 bytes of E2M1 codes), each with a
  ``.bias``: [E, inter], [E, inter], [E, hidden];
* ``token_embd``, ``output``, ``output_norm``; everything but the experts F16 / F32.

What each worker must hold is written here from the rules, not from the planner
(``helpers.tp_reference``), and compared with every loaded piece, byte for byte where a piece is
a choice of whole stored blocks, and dequantized by gguf-py's own dequantizer:

* tensor parallelism: gate/up experts split their rows (dim 1) in whole rows, their biases
  along dim 1 with them; down experts split K (dim 2) in whole 32-element MXFP4 blocks (17
  bytes each), their bias is replicated (added after the row-parallel sum); q/k/v rows and
  biases in whole heads (KV heads replicated when the workers outnumber them), attn_output's K
  in whole query heads, its bias replicated; attn_sinks with the query heads; router, norms,
  embeddings and output replicated. The experts' 96 rows are 3 MXFP4 groups: N = 2 and 4 zero-pad
  the MLP in 32-row blocks, N = 3 zero-pads the 4 query heads (the 3 groups divide);
* expert parallelism: every ``*_exps`` weight and bias splits along dim 0 in whole experts,
  contiguous and balanced (the first E % N workers take one more; the others a zero slot);
* the role of every tensor gguf-py lists for ``MODEL_ARCH.GPT_OSS``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
from gguf.quants import dequantize
from helpers.gguf_blocks import dequantized
from helpers.gpt_oss_gguf import (
    ARCH,
    BLOCK,
    BLOCK_BYTES,
    EXP_KINDS,
    EXPERTS,
    GROUPS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    gguf_name,
    tensors,
    write_gpt_oss,
)
from helpers.loads import load_decision
from helpers.tp_reference import padded_heads, padded_units, rows_of, take

from shardload.planners import plan_decision
from shardload.planners.architectures import GGUF_ARCHITECTURES
from shardload.planners.spec import spec_from_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The model's path and every tensor as stored: name -> (raw numpy data, ggml type)."""
    path = str(tmp_path_factory.mktemp("gpt_oss_gguf") / "gpt-oss.gguf")
    write_gpt_oss(path)
    reader = gguf.GGUFReader(path)
    stored = {t.name: (np.array(t.data), T(t.tensor_type)) for t in reader.tensors}
    shapes = {t.name: t.shape.tolist() for t in reader.tensors}
    return path, stored, shapes


def test_the_model_is_laid_out_as_llama_cpp_writes_it(model):
    path, stored, shapes = model
    want = tensors()
    assert set(stored) == set(want)
    # every tensor gguf-py lists for gpt-oss is in the model
    listed = {TENSOR_NAMES[k].format(bid=0) for k in MODEL_TENSORS[MODEL_ARCH.GPT_OSS]}
    assert listed == {n.rpartition(".")[0] for n in want if not n.startswith("blk.1.")}
    for name, (shape, qtype, _) in want.items():
        raw, stored_type = stored[name]
        assert stored_type == qtype, name
        assert shapes[name] == list(reversed(shape)), name  # ne: innermost first
        if qtype == T.MXFP4:  # [..., K / 32 * 17] bytes, K / 32 blocks of 17 per row
            assert raw.dtype == np.uint8
            assert raw.shape == (*shape[:-1], shape[-1] // BLOCK * BLOCK_BYTES), name
    # llama.cpp's ne for the experts: ffn_gate_exps {n_embd, n_ff_exp, n_expert}, their biases
    # {n_ff_exp, n_expert}, ffn_down_exps {n_ff_exp, n_embd, n_expert}
    assert shapes["blk.0.ffn_gate_exps.weight"] == [HIDDEN, INTER, EXPERTS]
    assert shapes["blk.0.ffn_gate_exps.bias"] == [INTER, EXPERTS]
    assert shapes["blk.0.ffn_down_exps.weight"] == [INTER, HIDDEN, EXPERTS]
    assert shapes["blk.0.ffn_down_exps.bias"] == [HIDDEN, EXPERTS]
    # gguf-py's MXFP4 dequantizer works block by block along K (what the split relies on)
    raw = stored["blk.0.ffn_down_exps.weight"][0]
    assert np.array_equal(
        dequantize(raw[..., BLOCK_BYTES : 2 * BLOCK_BYTES], T.MXFP4),
        dequantize(raw, T.MXFP4)[..., BLOCK : 2 * BLOCK],
    )
    # and a zero block (a padded one) is zeros
    assert not dequantize(np.zeros((1, BLOCK_BYTES), np.uint8), T.MXFP4).any()


# ---- tensor parallelism --------------------------------------------------------------------


def _layout(n: int) -> tuple[list, list, list]:
    """Each worker's query heads, KV heads and 32-row MLP blocks (-1: a zero one)."""
    q, kv = padded_heads(HEADS, KV_HEADS, n)
    mlp = padded_units(GROUPS, n)
    if HEADS % n == 0 and (KV_HEADS % n == 0 or n % KV_HEADS == 0):
        # where the heads divide, the padded layout is the plain one (vLLM's rule, rows_of)
        for i in range(n):
            assert q[i] == list(range(*rows_of(n, i, HEADS, HEADS, False).indices(HEADS)))
            assert kv[i] == list(range(*rows_of(n, i, KV_HEADS, KV_HEADS, True).indices(KV_HEADS)))
    return q, kv, mlp


def _want(whole: np.ndarray, split: str, q: list, kv: list, mlp: list) -> np.ndarray:
    """A worker's part of ``whole`` (dequantized) for its query heads, KV heads and MLP
    blocks (-1: zeros)."""
    if split == "rep":
        return whole
    if split == "q":
        return take(whole, q, HEAD_DIM, 0)
    if split == "kv":
        return take(whole, kv, HEAD_DIM, 0)
    if split == "o":
        return take(whole, q, HEAD_DIM, 1)
    if split == "sinks":
        return take(whole, q, 1, 0)
    if split == "exp_rows":
        return take(whole, mlp, BLOCK, 1)
    assert split == "exp_k"
    return take(whole, mlp, BLOCK, 2)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_tp_every_worker_dequantizes_to_its_slice(model, n):
    path, stored, _ = model
    splits = {name: split for name, (_, _, split) in tensors().items()}
    d = plan_decision(path, n)
    # N = 1 fits as is; 2 and 4 break the experts' 3 MXFP4 groups along down's K, 3 the 4
    # query heads: each is a zero-padded plan for that N
    assert d.kind == ("unpadded" if n == 1 else "padded")
    info = d.shard_info()
    q, kv, mlp = _layout(n)
    if n == 1:
        assert "tensor_parallel" not in info.metadata
    else:
        layout = info.metadata["tensor_parallel"]
        assert (layout["q_heads"], layout["kv_heads"]) == (q, kv)
        assert layout["head_dim"] == HEAD_DIM
        assert layout["mlp_block"] == BLOCK
        assert layout["mlp_blocks"] == {str(INTER): padded_units(GROUPS, n)}
    assert "experts" not in info.metadata
    sharded = load_decision(path, d)
    for name, (raw, qtype) in stored.items():
        split = splits[name]
        whole = dequantized(raw, qtype)
        for i in range(n):
            piece = sharded.shard(name, i).numpy()
            where = f"{name} worker {i} of {n}"
            if split == "rep":  # replicated, bytes and all
                assert piece.dtype == raw.dtype and np.array_equal(piece, raw), where
            elif qtype == T.MXFP4:  # whole stored rows, or whole 17-byte blocks of K
                by = (
                    take(raw, mlp[i], BLOCK, 1)
                    if split == "exp_rows"
                    else take(raw, mlp[i], BLOCK_BYTES, 2)
                )
                assert piece.shape == by.shape and np.array_equal(piece, by), where
            want = _want(whole, split, q[i], kv[i], mlp[i])
            got = dequantized(piece, qtype)
            assert got.shape == want.shape, where
            assert np.array_equal(got, want), where
            if qtype == T.MXFP4 and mlp[i][-1] == -1:  # a padded block is zeros, exactly
                padded = got[..., -BLOCK:] if split == "exp_k" else got[:, -BLOCK:]
                assert not padded.any(), where


# ---- expert parallelism --------------------------------------------------------------------


def _experts_of(n: int) -> list[list[int]]:
    """Whole experts per worker, contiguous, the first E % N one more; -1 a zero slot."""
    held, start = [], 0
    for w in range(n):
        count = EXPERTS // n + (w < EXPERTS % n)
        held.append(list(range(start, start + count)))
        start += count
    width = max(len(h) for h in held)
    return [h + [-1] * (width - len(h)) for h in held]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ep_every_exps_tensor_splits_in_whole_experts(model, n):
    path, stored, _ = model
    splits = {name: split for name, (_, _, split) in tensors().items()}
    d = plan_decision(path, n, experts="ep")
    info = d.shard_info()
    slots = _experts_of(n)
    assert info.metadata["experts"]["experts_per_worker"] == {str(EXPERTS): slots}
    assert info.metadata["experts"]["mode"] == "ep"
    # the experts are not split, so only the heads can need padding (N = 3)
    assert d.kind == ("padded" if n == 3 else "unpadded")
    if n == 3:
        assert info.metadata["tensor_parallel"]["mlp_blocks"] == {}
    q, kv, _ = _layout(n)
    sharded = load_decision(path, d)
    exps = {
        f"{gguf_name(k, b)}.{s}"
        for k in EXP_KINDS
        for b in range(LAYERS)
        for s in ("weight", "bias")
    }
    for name, (raw, qtype) in stored.items():
        whole = dequantized(raw, qtype)
        for i in range(n):
            piece = sharded.shard(name, i).numpy()
            where = f"{name} worker {i} of {n} (EP)"
            if name in exps:  # its experts' bytes, in order; zeros in a zero slot
                by = take(raw, slots[i], 1, 0)
                assert piece.shape == by.shape and np.array_equal(piece, by), where
                want = take(whole, slots[i], 1, 0)
            else:  # attention as tensor parallelism splits it
                split = splits[name]
                assert not split.startswith("exp_"), name
                want = _want(whole, split, q[i], kv[i], [])
                if split == "rep":
                    assert np.array_equal(piece, raw), where
            assert np.array_equal(dequantized(piece, qtype), want), where


# ---- roles ---------------------------------------------------------------------------------

# the role the planner must give each tensor gguf-py lists for gpt-oss (None: replicated)
ROLES = {
    "token_embd": "embed",
    "output": "lm_head",
    "output_norm": None,
    "attn_norm": None,
    "post_attention_norm": None,
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "attn_sinks": "sinks",
    "ffn_gate_inp": None,
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_down_exps": "down",
}


def test_every_tensor_gguf_py_lists_has_its_role():
    spec = spec_from_gguf(
        {
            "general.architecture": ARCH,
            f"{ARCH}.attention.head_count": HEADS,
            f"{ARCH}.attention.head_count_kv": KV_HEADS,
            f"{ARCH}.embedding_length": HIDDEN,
            f"{ARCH}.attention.key_length": HEAD_DIM,
            f"{ARCH}.expert_feed_forward_length": INTER,
            f"{ARCH}.block_count": 1,
        },
        "m.gguf",
    )
    assert spec.rules is GGUF_ARCHITECTURES[ARCH]
    assert spec.moe_intermediate_size == INTER
    for kind in MODEL_TENSORS[MODEL_ARCH.GPT_OSS]:
        name = TENSOR_NAMES[kind].format(bid=0)
        last = name.rpartition(".")[2]
        assert last in ROLES, f"{name} is new to this test"
        for suffix in ("weight", "bias"):
            role = spec.rules.role_of(f"{name}.{suffix}")
            got = role and role.name
            assert got == ROLES[last], f"{name}.{suffix} has role {got}, not {ROLES[last]}"
