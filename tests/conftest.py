"""Shared fixtures: a clean registry per test, and small checkpoints on disk."""

from __future__ import annotations

import os

import pytest

from shardload import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "tiny_llama_q4")


@pytest.fixture(autouse=True)
def _restore_registry():
    """Functions a test registers do not leak into the next test."""
    registry.list_shard_funcs()  # make sure built-ins and entry points are in before the snapshot
    before = dict(registry._registry), dict(registry._session_registry)
    yield
    with registry._lock:
        for table, saved in zip((registry._registry, registry._session_registry), before):
            table.clear()
            table.update(saved)
