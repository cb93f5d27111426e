"""The embedded example: it loads for every N from 1 to 8 (its shard_info.json where it fits
N; the planner's zero-padded plan elsewhere), and every worker's GPTQ shard dequantizes to
exactly its slice of the dequantized full weight (zero-padded by an independent rule)."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.gptq_reference import dequantize
from helpers.paths import EXAMPLE
from helpers.tp_reference import padded_heads, padded_units, take
from safetensors.numpy import load_file

from shardload import PlanError, ProcessSession, ThreadedSession, load_sharded, open_checkpoint

with open(os.path.join(EXAMPLE, "config.json")) as f:
    CONFIG = json.load(f)
HEAD_DIM = CONFIG["head_dim"]
COLUMN = {
    "self_attn.q_proj": CONFIG["num_attention_heads"],
    "self_attn.k_proj": CONFIG["num_key_value_heads"],
    "self_attn.v_proj": CONFIG["num_key_value_heads"],
    "mlp.gate_proj": None,
    "mlp.up_proj": None,
}
ROW = ("self_attn.o_proj", "mlp.down_proj")


def expected_rows(w: np.ndarray, heads, n: int, i: int) -> np.ndarray:
    """Worker i's rows of a column-parallel weight: whole heads, KV heads replicated (GQA)."""
    if heads is None or n <= heads:
        return np.split(w, n, axis=0)[i]
    head = i // (n // heads)
    return w[head * HEAD_DIM : (head + 1) * HEAD_DIM]


@pytest.fixture(scope="module")
def full():
    return load_file(os.path.join(EXAMPLE, "model.safetensors"))


@pytest.mark.parametrize(
    "session, n",
    [(ThreadedSession, n) for n in (1, 2, 4, 8)]
    + [
        (ProcessSession, 1),
        (ProcessSession, 2),
        *[pytest.param(ProcessSession, n, marks=pytest.mark.slow) for n in (4, 8)],
    ],
)
def test_every_shard_dequantizes_to_its_slice(full, n, session):
    with open_checkpoint(EXAMPLE) as ckpt, session(n) as sess:
        loaded = load_sharded(ckpt, os.path.join(EXAMPLE, "shard_info.json"), sess, progress=False)
        result = {i: loaded.worker(i) for i in range(n)}  # fetched while the workers live
    check_example(full, n, result)


GROUP = 32  # the example's GPTQ group: padded MLP rows move in whole groups


@pytest.mark.parametrize("n", [3, 5, 6, 7])
def test_every_n_loads_from_the_default_policy_zero_padded(full, n):
    """The plan beside the example fits 1, 2, 4, 8; for the other N the planner's padded plan
    takes over (its zero rows are zero-scaled groups of their own, g_idx included)."""
    with open_checkpoint(EXAMPLE) as ckpt, ThreadedSession(n) as sess:
        loaded = load_sharded(ckpt, None, sess, progress=False)
        shards = {i: loaded.worker(i) for i in range(n)}
    q, kv = padded_heads(CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], n)
    mlp = padded_units(CONFIG["intermediate_size"] // GROUP, n)
    units = {
        "self_attn.q_proj": (q, HEAD_DIM),
        "self_attn.k_proj": (kv, HEAD_DIM),
        "self_attn.v_proj": (kv, HEAD_DIM),
        "self_attn.o_proj": (q, HEAD_DIM),
        "mlp.gate_proj": (mlp, GROUP),
        "mlp.up_proj": (mlp, GROUP),
        "mlp.down_proj": (mlp, GROUP),
    }
    parts = ("qweight", "qzeros", "scales", "g_idx")
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj, (worker_units, size) in units.items():
            p = f"model.layers.{layer}.{proj}."
            w = dequantize(*(full[p + s] for s in parts))  # [N, K]
            for i in range(n):
                got = dequantize(*(shards[i][p + s].numpy() for s in parts))
                want = take(w, worker_units[i], size, axis=1 if proj in ROW else 0)
                np.testing.assert_array_equal(got, want, err_msg=f"{p} worker {i} of {n}")


def test_the_cli_loads_the_example_onto_three_workers():
    result = subprocess.run(
        [sys.executable, "-m", "shardload", "load", "--shards", "3", "--quiet", EXAMPLE],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def check_example(full, n, shards):
    checked = 0
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj in (*COLUMN, *ROW):
            p = f"model.layers.{layer}.{proj}."
            w = dequantize(*(full[p + s] for s in ("qweight", "qzeros", "scales", "g_idx")))
            for i in range(n):
                piece = {
                    s: shards[i][p + s].numpy() for s in ("qweight", "qzeros", "scales", "g_idx")
                }
                got = dequantize(piece["qweight"], piece["qzeros"], piece["scales"], piece["g_idx"])
                want = (
                    np.split(w, n, axis=1)[i]
                    if proj in ROW
                    else expected_rows(w, COLUMN[proj], n, i)
                )
                np.testing.assert_array_equal(got, want, err_msg=f"{p} worker {i} of {n}")
                checked += 1
    assert checked == CONFIG["num_hidden_layers"] * 7 * n
    # everything else is replicated, bit for bit
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.input_layernorm.weight",
    ):
        for i in range(n):
            np.testing.assert_array_equal(shards[i][name].numpy(), full[name])


def test_the_plan_given_is_used_as_it_is_and_refuses_three_before_reading(full):
    with open_checkpoint(EXAMPLE) as ckpt, ThreadedSession(3) as sess:
        with pytest.raises(PlanError, match="3"):
            load_sharded(ckpt, os.path.join(EXAMPLE, "shard_info.json"), sess, progress=False)
        assert ckpt.bytes_read == 0


def test_committed_files_are_what_the_script_makes(tmp_path):
    script = os.path.join(EXAMPLE, "make_tiny_llama_q4.py")
    subprocess.run([sys.executable, script, str(tmp_path)], check=True, capture_output=True)
    for name in ("model.safetensors", "shard_info.json", "config.json", "quantize_config.json"):
        assert filecmp.cmp(tmp_path / name, os.path.join(EXAMPLE, name), shallow=False), name


def test_example_is_small():
    size = sum(os.path.getsize(os.path.join(EXAMPLE, f)) for f in os.listdir(EXAMPLE))
    assert size < 4 * 1024 * 1024
