"""docs/vllm.md's coverage table is what ``scripts/vllm_coverage.py`` makes of the checkpoints
people serve, and the script's statement of vLLM's checks says what vLLM's source does.

* the whole table, regenerated (``--check``): minutes (the planner runs at full size, 92k
  tensors for DeepSeek-V3), so under ``-m extended``;
* quickly: the tensor counts and every vLLM verdict in the table (no planning), one row whole
  (the shardload verdicts of a small checkpoint), and that the header-only checkpoints are what
  the script says (sparse, in files of at most 5 GB, opened by shardload's strict reader, the
  tensors the planner reads holding their real values);
* vLLM's checks on facts that hold whatever shardload does (sizes from the published configs).

After a change to the planner: ``python scripts/vllm_coverage.py --write``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.paths import REPO
from helpers.subprocesses import subprocess_env

from devtools.coverage import coverage_script

SCRIPT = os.path.join(REPO, "scripts", "vllm_coverage.py")
STALE = "docs/vllm.md's coverage table is stale: run python scripts/vllm_coverage.py --write"


@pytest.fixture(scope="module")
def cov():
    return coverage_script()


@pytest.fixture(scope="module")
def table(cov):
    with open(cov.DOC, encoding="utf-8") as f:
        return cov.read_section(f.read())


def model(cov, name: str) -> dict:
    return next(m for m in cov.MODELS if m["name"] == name)


def config(cov, name: str, **changes) -> dict:
    return dict(model(cov, name)["config"], **changes)


# ---- the table is current ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.extended
def test_the_whole_table_is_current():
    done = subprocess.run(
        [sys.executable, SCRIPT, "--check", "--quiet"],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=REPO,
        env=subprocess_env(),
    )
    assert done.returncode == 0, f"{STALE}\n{done.stdout[-6000:]}{done.stderr[-3000:]}"


def test_every_checkpoint_has_its_row_and_its_tensor_count(cov, table):
    rows, _ = table
    assert list(rows) == [m["name"] for m in cov.MODELS], STALE
    for m in cov.MODELS:
        assert rows[m["name"]][0] == sum(1 for _ in cov.stored_tensors(m["config"])), STALE


def test_every_vllm_verdict_in_the_table_is_current(cov, table):
    rows, notes = table
    for m in cov.MODELS:
        for n, cell in zip(cov.TP, rows[m["name"]][1]):
            fresh = cov.Notes()
            want = cov.expand(cov.vllm_cell(m["config"], n, fresh), fresh.texts)
            assert cov.expand(cell, notes).split(" · ")[0] == want, (m["name"], n, STALE)


@pytest.mark.parametrize(
    "name",
    [
        "Qwen/Qwen2.5-72B-Instruct-AWQ",
        "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "Qwen/Qwen3-32B-AWQ",
        "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic",
        "casperhansen/llama-3.3-70b-instruct-awq",
        "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
        "TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ",
        "openai/gpt-oss-120b",
    ],
)
def test_small_rows_whole(cov, table, tmp_path, name):
    """Every row under 10,000 tensors with its shardload verdicts too (seconds each; the
    Qwen3 MoE and DeepSeek-V3 rows, 37k to 92k tensors, take minutes: the whole table,
    above): AWQ and GPTQ groups padded at TP=16, a Qwen2 whose heads vLLM cannot pad,
    compressed-tensors, whose weight_shape the planner reads, Mixtral's per-channel GPTQ,
    gpt-oss's fused MXFP4 experts."""
    rows, notes = table
    m = model(cov, name)
    cov.write_checkpoint(m, str(tmp_path))
    for n, cell in zip(cov.TP, rows[name][1]):
        verdict = cov.shardload_verdict(str(tmp_path), name, m["config"], n)
        fresh = cov.Notes()
        made = f"{cov.vllm_cell(m['config'], n, fresh)} · {cov.shardload_cell(verdict, fresh)}"
        assert cov.expand(cell, notes) == cov.expand(made, fresh.texts), (n, STALE)


# ---- the header-only checkpoints -----------------------------------------------------------------


def test_a_header_only_checkpoint_is_sparse_sharded_and_opens(cov, tmp_path):
    from shardload import open_checkpoint

    m = model(cov, "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4")
    count = cov.write_checkpoint(m, str(tmp_path))
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    sizes = [os.path.getsize(tmp_path / f) for f in files]
    used = sum(os.stat(tmp_path / f).st_blocks * 512 for f in files)
    assert sum(sizes) > 38e9 and used < 60e6  # 39 GB of tensors, the g_idx on disk
    assert len(files) > 1 and max(sizes) < cov.SHARD_BYTES + 10**7
    ckpt = open_checkpoint(str(tmp_path))
    meta = ckpt.metadata()
    assert len(meta) == count
    down = "model.layers.79.mlp.down_proj"
    assert list(meta[down + ".qweight"].shape) == [29696 // 8, 8192]
    assert list(meta[down + ".scales"].shape) == [29696 // 128, 8192]
    assert np.array_equal(ckpt.read(down + ".g_idx").numpy(), np.arange(29696) // 128)


def test_compressed_tensors_weight_shape_and_block_fp8_scales(cov):
    llama = {
        t[0]: t
        for t in cov.stored_tensors(
            model(cov, "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16")["config"]
        )
    }
    name, shape, dtype, value = llama["model.layers.0.mlp.down_proj.weight_shape"]
    assert (shape, dtype, value.tolist()) == ([2], "I64", [4096, 14336])
    assert llama["model.layers.0.mlp.down_proj.weight_packed"][1:3] == ([4096, 14336 // 8], "I32")
    v3 = {t[0]: t[1:3] for t in cov.stored_tensors(model(cov, "deepseek-ai/DeepSeek-V3")["config"])}
    # kv_a_proj_with_mqa: 512 + 64 rows, a partial last block
    assert v3["model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ([5, 56], "F32")
    assert v3["model.layers.3.mlp.experts.255.down_proj.weight"] == ([7168, 2048], "F8_E4M3")
    assert "model.layers.61.shared_head.head.weight" in v3  # the multi-token-prediction layer
    oss = {t[0]: t[1:3] for t in cov.stored_tensors(model(cov, "openai/gpt-oss-120b")["config"])}
    assert oss["model.layers.0.mlp.experts.gate_up_proj_blocks"] == ([128, 5760, 90, 16], "U8")
    assert oss["model.layers.0.mlp.experts.down_proj_scales"] == ([128, 2880, 90], "U8")


# ---- vLLM's checks: facts independent of shardload -----------------------------------------------


def test_vllm_refuses_a_72b_gptq_whose_mlp_splits_its_groups(cov):
    # Qwen2.5-72B's own width: 29568 / 8 = 3696 rows a rank, not whole 128-groups; Qwen's
    # published GPTQ and AWQ pad it to 29696, whose 3712 a rank (29 groups) vLLM runs
    name = "Qwen/Qwen2.5-72B-Instruct-GPTQ-Int4"
    assert cov.vllm_refusal(config(cov, name, intermediate_size=29568), 8) == (
        "groups",
        "down_proj's K on a rank, 3696, is not a whole number of 128-groups",
    )
    assert cov.vllm_refusal(config(cov, name), 8) is None
    assert cov.vllm_refusal(config(cov, name), 16)[0] == "groups"  # 1856 a rank
    assert cov.vllm_refusal(config(cov, name), 3)[0] == "heads"  # 64 heads


def test_vllm_refines_qwen3_moe_fp8_blocks_down_to_32(cov):
    # 768 / 4 = 192 expert rows a rank: not whole 128-blocks; vLLM 0.32 refines the scale
    # blocks to gcd(128, 192, 2048) = 64 and runs, and refuses only below 32 (48 rows at N=16)
    name = "Qwen/Qwen3-30B-A3B-FP8"
    assert 768 // 4 % 128
    assert cov.vllm_refusal(config(cov, name), 4) is None
    assert "64x64" in cov.vllm_note(config(cov, name), 4)
    assert cov.vllm_refusal(config(cov, name), 16)[0] == "blocks"


def test_vllm_refuses_gptq_act_order_with_groups_at_every_n(cov):
    name = "TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ"
    assert cov.vllm_refusal(config(cov, name), 8) is None  # one group a column: a no-op
    grouped = config(
        cov,
        name,
        quantization_config=dict(config(cov, name)["quantization_config"], group_size=128),
    )
    assert {cov.vllm_refusal(grouped, n)[0] for n in (2, 4, 8)} == {"act-order"}


def test_no_checkpoint_here_runs_at_3_or_6_in_vllm(cov):
    for m in cov.MODELS:
        assert [cov.vllm_refusal(m["config"], n)[0] for n in (3, 6)] == ["heads", "heads"]


def test_vllm_runs_latent_attention_and_mxfp4_at_16(cov):
    assert cov.vllm_refusal(config(cov, "deepseek-ai/DeepSeek-V3"), 16) is None
    gpt_oss = config(cov, "openai/gpt-oss-120b")
    assert cov.vllm_refusal(gpt_oss, 16) is None  # 8 KV heads, each on 2 ranks
    assert "192 rows a rank (of 180)" in cov.vllm_note(gpt_oss, 16)
