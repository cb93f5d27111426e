"""The tests' side of ``devtools/vllm_engine.py`` (one vLLM engine per call, run in vLLM's own
environment): ``vllm_python`` finds that environment, or skips the calling test (fails under
CI's ``SHARDLOAD_REQUIRE_VLLM=1``); ``launch`` runs the engine with it."""

from __future__ import annotations

from devtools import vllm_engine as _engine
from devtools.vllm_engine import PROMPTS, STATS_PREFIX  # noqa: F401 - the tests use them
from helpers.environments import require

__all__ = ["vllm_python", "launch", "PROMPTS", "STATS_PREFIX"]


def vllm_python() -> str:
    """The python of vLLM's environment (``helpers.environments``: made by
    ``scripts/vllm-env.sh``); without it the calling test skips, or fails where
    ``SHARDLOAD_REQUIRE_VLLM=1`` (CI)."""
    return require("vllm")


def launch(model: str, *args: str, env: dict, cwd: str, timeout: float = 600,
           out_dir=None) -> tuple[dict, list, str]:
    """``devtools.vllm_engine.launch`` with vLLM's python (``vllm_python``)."""
    return _engine.launch(vllm_python(), model, *args, env=env, cwd=cwd, timeout=timeout,
                          out_dir=out_dir)
