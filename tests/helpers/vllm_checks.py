"""One vLLM engine per case, on the tests' side (``helpers.vllm_engine`` runs in vLLM's own
environment): ``run_engine`` starts it on a checkpoint and gives its report and each rank's
statistics line; ``check_same_as_default`` asserts that shardload's load equals vLLM's default
loader's in that engine; ``refit_there_and_back``, that a refit equals a fresh engine."""

from __future__ import annotations

import json

from helpers.paths import REPO
from helpers.subprocesses import subprocess_env
from helpers.vllm_engine import launch


def run_engine(
    model: str, tp: int, *args: str, timeout: float = 600, env: dict | None = None
) -> tuple[dict, list, str]:
    """One engine (devtools/vllm_engine.py): its report, the shardload statistics lines
    (by rank), and its whole output (for failures); ``env``: variables to add to its
    environment."""
    report, stats, log = launch(
        model,
        "--tp",
        str(tp),
        *args,
        timeout=timeout,
        cwd=REPO,
        env=subprocess_env(VLLM_CPU_KVCACHE_SPACE="1", **(env or {})),
    )
    return report, sorted(stats, key=lambda s: s["rank"]), log


def check_same_as_default(
    report: dict, stats: list, log: str, tp: int, verified: bool = True
) -> None:
    """shardload's load (verified: read into poisoned stand-ins) equals vLLM's default
    loader's, and so does shardload's in-place reload where the engine made one (views of the
    mapped file, nothing read into stand-ins but padded tensors)."""
    assert "outputs" in report, log[-6000:]
    assert report["outputs"] == report["default_outputs"]  # tokens and top-5 logprobs, exactly
    assert report["digests"] == report["default_digests"]  # every parameter, bitwise
    first = [s for s in stats if not s["reload"]]
    assert [s["rank"] for s in first] == list(range(tp))
    assert all(s["verified"] == verified for s in first)
    if "reload_outputs" in report:
        assert report["reload_outputs"] == report["outputs"]
        assert report["reload_digests"] == report["digests"]
        again = [s for s in stats if s["reload"]]
        assert [s["rank"] for s in again] == list(range(tp))
        assert all(not s["verified"] and s["bytes_read_in_place"] > 0 for s in again)
    for s in stats:
        assert s["bytes_read"] <= 1.05 * s["bytes_kept"]


def refit_there_and_back(first: str, second: str, tp: int, *args: str) -> tuple[dict, list, dict]:
    """An engine started on checkpoint ``second`` (the fresh reference) refits to ``first``,
    then, every parameter poisoned first (one the refit does not write would show), back to
    ``second``, through vLLM's weight-transfer API with shardload's backend
    (``devtools/vllm_engine.py --refits``). Asserts that both refits took their weights, the
    first other weights, the second every parameter bitwise the fresh engine's, each rank
    logging a line per refit; gives the report, the refits' statistics lines and the refit
    back (its ``outputs`` to compare where the format generates)."""
    steps = [
        {"update_info": {"checkpoint": first}},
        {"poison": True, "update_info": {"checkpoint": second}},
    ]
    report, stats, log = run_engine(second, tp, "--digests", "--refits", json.dumps(steps), *args)
    assert "refits" in report, log[-6000:]
    one, two = report["refits"]
    assert one["error"] is None and two["error"] is None, (one["error"], two["error"])
    assert one["digests"] != report["digests"]
    assert two["digests"] == report["digests"]  # vLLM's processed parameters, bitwise
    refits = [s for s in stats if s.get("refit")]
    assert len(refits) == 2 * tp
    return report, refits, two
