"""The tests' side of ``devtools/vllm_engine.py`` (one vLLM engine per call, run in vLLM's own
environment): ``vllm_python`` finds that environment, or skips the calling test (fails under
CI's ``SHARDLOAD_REQUIRE_VLLM=1``); ``launch`` runs the engine with it."""

from __future__ import annotations

import os
from pathlib import Path

from devtools import vllm_engine as _engine
from devtools.vllm_engine import PROMPTS, STATS_PREFIX  # noqa: F401 - the tests use them

__all__ = ["vllm_python", "launch", "PROMPTS", "STATS_PREFIX"]


def vllm_python() -> str:
    """The python of vLLM's environment (``SHARDLOAD_VLLM_PYTHON``, else the one
    ``scripts/vllm-env.sh`` makes under ``$SHARDLOAD_CACHE``); without it the calling test
    skips, or fails where ``SHARDLOAD_REQUIRE_VLLM=1`` (CI)."""
    import pytest

    root = Path(os.environ.get("SHARDLOAD_CACHE") or Path.home() / ".cache" / "shardload")
    python = os.environ.get("SHARDLOAD_VLLM_PYTHON") or str(root / "vllm-venv" / "bin" / "python")
    # the script writes ``ready`` beside bin/ last: a half-made environment is not taken
    if not (Path(python).parent.parent / "ready").exists():
        why = f"no vLLM environment at {python}: make it with scripts/vllm-env.sh"
        if os.environ.get("SHARDLOAD_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return python


def launch(model: str, *args: str, env: dict, cwd: str, timeout: float = 600,
           out_dir=None) -> tuple[dict, list, str]:
    """``devtools.vllm_engine.launch`` with vLLM's python (``vllm_python``)."""
    return _engine.launch(vllm_python(), model, *args, env=env, cwd=cwd, timeout=timeout,
                          out_dir=out_dir)
