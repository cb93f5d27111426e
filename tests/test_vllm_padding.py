"""Any N in vLLM where its own loader refuses the quantization groups: an MLP of 5 groups of 32.

``llama160_*`` (tests/helpers/vllm_models.py) have intermediate 160; ``llama160_gptqmodel`` is
quantized by GPTQModel itself, as the GPTQ checkpoints people serve are (its act-order twin is
refused by vLLM 0.32 at every N with its own loader, "desc_act=True is no longer supported":
``test_hf_tp_formats`` proves it padded in shardload's own TP model). At TP=2 each rank's
down_proj would take 80 input rows, which no kernel takes in groups of 32 (vLLM's CPU kernel:
"Input size (80) not supported by CPUWNA16, supported sizes are multiples of 32"). shardload
zero-pads the MLP to 192 rows (3 groups per rank; the GPTQ ``g_idx`` points the zero rows at
zero-scaled groups of their own), and vLLM, told ``intermediate_size: 192``, generates the
tokens its default loader generates at TP=1, with ``verify`` on. So does a Qwen2-MoE whose experts
and shared expert pad at TP=3, in vLLM's fused MoE; and without the overrides, vLLM is told, in
one line, the flag to add.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
from helpers import vllm_models
from helpers.paths import EXAMPLE, REPO
from helpers.subprocesses import subprocess_env
from helpers.vllm_engine import int4_kernel_missing, launch

PADDED = {"intermediate_size": 192}


def engine(model: str, tp: int, *args: str) -> tuple[dict, list, str]:
    return launch(
        model, "--tp", str(tp), *args, cwd=REPO, env=subprocess_env(VLLM_CPU_KVCACHE_SPACE="1")
    )


@functools.cache
def tp1_tokens(name: str) -> list:
    """vLLM's default loader at TP=1: the tokens every padded N must give."""
    report, _, log = engine(str(vllm_models.path(name)), 1)
    assert "outputs" in report, log[-6000:]
    return [o["tokens"] for o in report["outputs"]]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.quant_tools
@pytest.mark.extended  # vLLM's own refusal, the premise of the tests below
def test_vllms_default_loader_refuses_tp2_for_groups_that_do_not_divide():
    report, _, log = engine(str(vllm_models.path("llama160_gptqmodel")), 2)
    assert report.get("returncode", 0) != 0
    assert "Input size (80) not supported" in log, log[-4000:]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("llama160_gptqmodel", marks=pytest.mark.quant_tools),
        pytest.param("llama160_gptq", marks=pytest.mark.extended),
        pytest.param("llama160_w4a16", marks=pytest.mark.extended),
    ],
)
def test_padded_groups_give_tp1s_tokens(name):
    from shardload.vllm import vllm_overrides

    model = str(vllm_models.path(name))
    overrides = vllm_overrides(model, 2)
    assert overrides["intermediate_size"] == 192  # 5 groups -> 6, 3 per rank
    # where vLLM's CPU build has no int4 kernel (no AVX-512), the padded model is loaded and
    # verified but cannot generate, with vLLM's own loader neither: the tokens are not compared
    generates = int4_kernel_missing() is None
    report, stats, log = engine(
        model,
        2,
        "--load-format",
        "shardload",
        "--verify",
        "--hf-overrides",
        json.dumps(overrides),
        *(() if generates else ("--tokens", "0")),
    )
    assert "outputs" in report, log[-6000:]
    if generates:
        assert [o["tokens"] for o in report["outputs"]] == tp1_tokens(name)
    first = sorted((s for s in stats if not s["reload"]), key=lambda s: s["rank"])
    assert [s["rank"] for s in first] == [0, 1] and all(s["verified"] for s in first)
    # gate, up and down of 2 layers, and down_proj's g_idx (GPTQ) or weight_shape (pack)
    assert all(s["padded_tensors"] >= 2 * 3 * 2 for s in first)


@pytest.mark.slow
@pytest.mark.vllm
def test_padded_experts_and_shared_expert_give_tp1s_tokens_in_vllms_fused_moe():
    """Qwen2-MoE at TP=3: every routed expert's 128 rows and the shared expert's 256 pad to
    129 and 258 (vLLM's fused MoE asserts they divide); heads and vocabulary divide."""
    from shardload.vllm import vllm_overrides

    model = str(vllm_models.path("qwen2_moe576_bf16"))
    overrides = vllm_overrides(model, 3)
    assert overrides == {
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "moe_intermediate_size": 129,
        "shared_expert_intermediate_size": 258,
    }
    report, stats, log = engine(
        model, 3, "--load-format", "shardload", "--verify", "--hf-overrides", json.dumps(overrides)
    )
    assert "outputs" in report, log[-6000:]
    assert [o["tokens"] for o in report["outputs"]] == tp1_tokens("qwen2_moe576_bf16")
    first = sorted((s for s in stats if not s["reload"]), key=lambda s: s["rank"])
    assert [s["rank"] for s in first] == [0, 1, 2] and all(s["verified"] for s in first)
    # 8 experts x 3 + the shared expert's 3 tensors, in 2 layers
    assert all(s["padded_tensors"] == 2 * (8 * 3 + 3) for s in first)


@pytest.mark.slow
@pytest.mark.vllm
def test_under_expert_parallelism_only_the_shared_expert_pads():
    """Qwen2-MoE at TP=3 with --enable-expert-parallel: the 8 routed experts are whole on their
    ranks (3, 3 and 2, vLLM's placement) and keep their 128 rows; the shared expert's 256 pad
    to 258. vLLM builds that model and shardload loads it, verify on (vLLM's CPU MoE kernels
    crash generating under expert parallelism, with its own loader too: loaded only). Without
    the overrides, one line names them."""
    import re

    from shardload import open_checkpoint
    from shardload.vllm import vllm_overrides

    model = str(vllm_models.path("qwen2_moe576_bf16"))
    overrides = vllm_overrides(model, 3, experts="ep")
    assert overrides == {
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "shared_expert_intermediate_size": 258,
    }
    report, stats, log = engine(
        model,
        3,
        "--ep",
        "--tokens",
        "0",
        "--load-format",
        "shardload",
        "--verify",
        "--hf-overrides",
        json.dumps(overrides),
    )
    assert "outputs" in report, log[-6000:]
    first = sorted((s for s in stats if not s["reload"]), key=lambda s: s["rank"])
    assert [s["rank"] for s in first] == [0, 1, 2]
    assert all(s["verified"] and s["experts"] == "ep" for s in first)
    assert [s["padded_tensors"] for s in first] == [2 * 3] * 3  # the shared expert's, 2 layers
    names = list(open_checkpoint(model).metadata())
    expert = [int(m.group(1)) for n in names if (m := re.search(r"\.experts\.(\d+)\.", n))]
    held = [range(0, 3), range(3, 6), range(6, 8)]
    for rank, s in enumerate(first):
        assert s["tensors"] == len(names) - sum(1 for e in expert if e not in held[rank])
    report, stats, log = engine(model, 3, "--ep", "--tokens", "0", "--load-format", "shardload")
    assert report.get("returncode", 0) != 0 and not stats
    line = next(s for s in reversed(log.splitlines()) if "PlanError" in s)
    assert json.loads(line.split("add --hf-overrides ", 1)[1].strip("'")) == overrides


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.quant_tools
def test_without_the_overrides_vllm_is_told_the_one_flag_to_add():
    """Before vLLM's own refusal (in its worker, here): one line with the exact flag."""
    model = str(vllm_models.path("llama160_gptqmodel"))
    report, stats, log = engine(model, 2, "--load-format", "shardload")
    assert report.get("returncode", 0) != 0 and not stats
    line = next(s for s in reversed(log.splitlines()) if "PlanError" in s)
    flag = line.split("add --hf-overrides ", 1)[1]
    assert json.loads(flag.strip("'")) == {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        **PADDED,
    }
    assert "Input size (80)" not in log  # vLLM's own refusal never came


def _vllm_config(model: str, n: int, built: dict, load_format: str = "shardload"):
    """What preflight reads of vLLM's VllmConfig, without vLLM."""
    return SimpleNamespace(
        load_config=SimpleNamespace(load_format=load_format, model_loader_extra_config=None),
        model_config=SimpleNamespace(model=model, hf_text_config=SimpleNamespace(**built)),
        parallel_config=SimpleNamespace(tensor_parallel_size=n, enable_expert_parallel=False),
    )


def test_preflight_names_the_flag_or_the_n_that_work():
    from shardload import PlanError
    from shardload.vllm.preflight import preflight

    as_stored = {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 512,
    }
    preflight(_vllm_config(str(EXAMPLE), 4, as_stored))  # N divides: vLLM goes on
    preflight(_vllm_config(str(EXAMPLE), 3, as_stored, "auto"))  # not shardload's to judge
    with pytest.raises(PlanError) as err:  # 8 heads, 16 groups over 3
        preflight(_vllm_config(str(EXAMPLE), 3, as_stored))
    (line,) = str(err.value).splitlines()
    wanted = {
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "intermediate_size": 576,
    }
    assert line.endswith(f"add --hf-overrides '{json.dumps(wanted)}'")
    preflight(_vllm_config(str(EXAMPLE), 3, wanted))  # with them: vLLM goes on


def test_the_command_line_gives_the_overrides_under_expert_parallelism():
    from click.testing import CliRunner

    from shardload.cli import cli

    model = str(vllm_models.path("qwen2_moe576_bf16"))
    tp = CliRunner().invoke(cli, ["vllm-overrides", "--shards", "3", model])
    ep = CliRunner().invoke(cli, ["vllm-overrides", "--shards", "3", "--experts", "ep", model])
    assert tp.exit_code == 0 and ep.exit_code == 0, (tp.output, ep.output)
    assert json.loads(tp.stdout)["moe_intermediate_size"] == 129  # experts split, padded
    assert json.loads(ep.stdout) == {
        "num_attention_heads": 12,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "shared_expert_intermediate_size": 258,
    }
