"""The tests' side of ``devtools/environments.py``: ``require(name)`` is the program of an
optional environment (vLLM's python, GPTQModel's python, Azurite's ``azurite-blob``), or the
calling test skips saying which script makes it, or fails where CI's ``SHARDLOAD_REQUIRE_*=1``
asks for every environment."""

from __future__ import annotations

import pytest

from devtools.environments import ENVIRONMENTS, environment

__all__ = ["ENVIRONMENTS", "require"]


def require(name: str) -> str:
    """The program of the environment ``name``, made by its script; else skip (or fail)."""
    env = environment(name)
    found = env.find()
    if found is None:
        if env.required:
            pytest.fail(env.missing(), pytrace=False)
        pytest.skip(env.missing())
    return found
