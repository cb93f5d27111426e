"""The tests' side of ``devtools/vllm_engine.py`` (one vLLM engine per call, run in vLLM's own
environment): ``vllm_python`` finds that environment, or skips the calling test (fails under
CI's ``SHARDLOAD_REQUIRE_VLLM=1``); ``launch`` runs the engine with it."""

from __future__ import annotations

from devtools import vllm_engine as _engine
from devtools.vllm_engine import PROMPTS, STATS_PREFIX
from helpers.environments import require

__all__ = ["PROMPTS", "STATS_PREFIX", "int4_kernel_missing", "launch", "vllm_python"]


def vllm_python() -> str:
    """The python of vLLM's environment (``helpers.environments``: made by
    ``scripts/vllm-env.sh``); without it the calling test skips, or fails where
    ``SHARDLOAD_REQUIRE_VLLM=1`` (CI)."""
    return require("vllm")


def int4_kernel_missing() -> str | None:
    """Why vLLM's CPU build cannot run int4 weights (GPTQ, AWQ, compressed-tensors W4A16) on
    this machine, or None where it can. Its int4 kernel (``cpu_gemm_wna16``) is compiled for
    AVX-512 only: on a CPU without it the engine fails at its first step, with vLLM's own
    loader too (vLLM issue 55613). A property of the machine, as a GPU is: the tests that need
    it skip, under CI too."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:
        return None  # not Linux: let vLLM say
    if "avx512f" in flags:
        return None
    return (
        "vLLM's CPU build has its int4 (WNA16) kernel only for AVX-512 CPUs, and this one "
        "has none (vLLM issue 55613)"
    )


def launch(
    model: str, *args: str, env: dict, cwd: str, timeout: float = 600, out_dir=None
) -> tuple[dict, list, str]:
    """``devtools.vllm_engine.launch`` with vLLM's python (``vllm_python``)."""
    return _engine.launch(
        vllm_python(), model, *args, env=env, cwd=cwd, timeout=timeout, out_dir=out_dir
    )
