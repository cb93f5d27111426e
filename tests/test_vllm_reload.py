"""A failed in-place reload in a running vLLM engine lets go of the checkpoint it opened.

An engine that reloads its weights (``LLM.collective_rpc("reload_weights")``) runs for long:
each reload that fails while planning, checking or loading must leave no mapping of the
checkpoint's files and no descriptor to them in the worker, or every failed reload keeps one
more. One engine start (vLLM's CPU build, ``SHARDLOAD_VLLM_PYTHON``), on a copy of the test
Llama of its own, beside which the reload finds a plan that is not JSON.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import vllm_models
from helpers.vllm_checks import run_engine


@pytest.mark.slow
@pytest.mark.vllm
def test_a_failed_reload_leaves_no_mapping_or_descriptor_of_the_checkpoint(tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(vllm_models.path("llama_bf16"), folder)
    report, stats, log = run_engine(
        str(folder), 1, "--load-format", "shardload", "--verify", "--fail-reload", "--tokens", "1"
    )
    assert "failed_reload" in report, log[-6000:]
    failed = report["failed_reload"]
    assert failed["error"] is not None and "shard_info.json" in failed["error"], failed
    # the first load let go of what it opened, and so must the failed reload
    assert failed["before"] == [{"maps": 0, "fds": 0}]
    assert failed["after"] == [{"maps": 0, "fds": 0}]
    assert [s["reload"] for s in stats] == [False]  # the reload logged no statistics
