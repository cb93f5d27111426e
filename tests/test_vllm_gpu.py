"""``--load-format shardload`` on the formats only vLLM's GPU kernels run: FP8 (per-tensor and
block), NVFP4 and MXFP4 (compressed-tensors, written by the library itself), and refits of FP8
(as ``test_vllm_refit.py`` on the CPU). A GGUF is refused
(docs/vllm.md, "What stays refused"). Run by ``benchmarks/gpu_check.sh`` on a machine with CUDA
and vLLM; skipped elsewhere. Each case is one engine, compared with vLLM's default loader in
that engine (and shardload's own reload), as in ``test_vllm.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.vllm_checks import check_same_as_default, refit_there_and_back, run_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PRESETS = ["FP8", "FP8_BLOCK", "NVFP4", "MXFP4"]


def _checkpoint(tmp_path_factory, preset: str) -> str:
    import transformers
    from helpers.compressed_tensors_tool import compress_preset
    from helpers.vllm_models import path

    config = transformers.AutoConfig.from_pretrained(str(path("llama_bf16")))
    folder = tmp_path_factory.mktemp(preset.lower())
    compress_preset(folder, config, preset)
    return str(folder)


@pytest.mark.parametrize("preset", PRESETS)
def test_shardload_loads_what_vllms_default_loader_loads_on_the_gpu(tmp_path_factory, preset):
    model = _checkpoint(tmp_path_factory, preset)
    report, stats, log = run_engine(
        model, 1, "--load-format", "shardload", "--verify", "--compare-default"
    )
    check_same_as_default(report, stats, log, 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
@pytest.mark.parametrize("preset", ["FP8_BLOCK", "NVFP4"])
def test_padded_blocks_give_tp1s_tokens_on_two_gpus(tmp_path_factory, preset):
    """An MLP of 3 blocks of 128 rows (FP8 128x128; NVFP4 24 groups of 16): at TP=2 vLLM's
    loader refuses the FP8 block split; shardload pads to 4 blocks and gives TP=1's tokens."""
    import json

    import transformers
    from helpers.compressed_tensors_tool import compress_preset
    from helpers.vllm_models import path

    from shardload.vllm import vllm_overrides

    config = transformers.AutoConfig.from_pretrained(str(path("llama_bf16")))
    config.intermediate_size = 384
    folder = tmp_path_factory.mktemp(preset.lower() + "_384")
    compress_preset(folder, config, preset)
    one, _, log1 = run_engine(str(folder), 1)
    assert "outputs" in one, log1[-6000:]
    overrides = vllm_overrides(str(folder), 2)
    padded, stats, log = run_engine(
        str(folder),
        2,
        "--load-format",
        "shardload",
        "--verify",
        *(("--hf-overrides", json.dumps(overrides)) if overrides else ()),
    )
    assert "outputs" in padded, log[-6000:]
    assert [o["tokens"] for o in padded["outputs"]] == [o["tokens"] for o in one["outputs"]]


@pytest.mark.parametrize("preset", ["FP8", "FP8_BLOCK"])
def test_an_fp8_refit_is_a_fresh_engine_on_the_gpu(tmp_path_factory, preset):
    """Through vLLM's weight-transfer API with shardload's backend (test_vllm_refit.py on the
    CPU): an engine started on a second checkpoint refits to the first and back, then answers
    and holds every parameter as a fresh engine on it, vLLM's FP8 processing run again."""

    import transformers
    from helpers.compressed_tensors_tool import compress_preset
    from helpers.vllm_models import path

    config = transformers.AutoConfig.from_pretrained(str(path("llama_bf16")))
    first, second = (tmp_path_factory.mktemp(f"{preset.lower()}_{s}") for s in ("0", "1"))
    compress_preset(first, config, preset, seed=0)
    compress_preset(second, config, preset, seed=1)
    report, _, back = refit_there_and_back(str(first), str(second), 1)
    assert back["outputs"] == report["outputs"]
