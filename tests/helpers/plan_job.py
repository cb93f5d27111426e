"""A torchrun job for tests/test_torch_shared_plan.py (not a test module itself).

    PYTHONPATH=.:tests torchrun --standalone --nproc-per-node 2 -m helpers.plan_job \
        MODE CKPT OUT_DIR

Each rank counts its calls of the planner (``plan_decision``) and writes what it saw to
OUT_DIR/rank{r}.json (its shards to OUT_DIR/rank{r}.safetensors).

MODE ``plan``: ``plan_once`` in a collective (the plan, where it came from), then
``load_sharded`` with the policy's plan.
MODE ``refuse``: ``load_sharded`` with ``experts="ep"`` of a dense model, which the planner
refuses on rank 0: what each rank raised.
"""

import hashlib
import json
import os
import sys

from safetensors.torch import save_file

import shardload.planners.decision as decision
from shardload import TorchDistributedSession, load_sharded
from shardload.errors import cli_text
from shardload.frontdoor import plan_once

calls = 0
_plan_decision = decision.plan_decision


def counted(*args, **kwargs):
    global calls
    calls += 1
    return _plan_decision(*args, **kwargs)


decision.plan_decision = counted  # resolve_plan looks it up when it plans


def digest(validated) -> str:
    return hashlib.sha256(json.dumps(validated.plan.to_dict(), sort_keys=True).encode()).hexdigest()


def main(mode: str, ckpt: str, out: str) -> None:
    report: dict = {}
    with TorchDistributedSession() as sess:
        if mode == "plan":
            with sess.collective("planning"):
                job = plan_once(sess, ckpt)
            resolved = job.resolved
            summary = resolved.decision and str(resolved.decision.summary)
            report["plan_once"] = {
                "from": job.plan_from,
                "digest": digest(resolved.validated),
                "origin": resolved.origin,
                "source": resolved.source,
                "note": resolved.note,
                "kind": resolved.decision and resolved.decision.kind,
                "summary": summary,
                "valid": resolved.decision and list(resolved.decision.valid),
                "planner_calls": calls,
            }
            result = load_sharded(ckpt, None, sess, progress=False)
            report.update(
                planner_calls=calls, digest=digest(result.plan), stats=result.stats.as_dict()
            )
            save_file(result.worker(sess.rank), os.path.join(out, f"rank{sess.rank}.safetensors"))
        else:
            try:
                load_sharded(ckpt, None, sess, progress=False, experts="ep")
                report["raised"] = None
            except Exception as exc:  # noqa: BLE001 - any error is the outcome the test checks
                report.update(raised=type(exc).__name__, message=str(exc), cli=cli_text(exc))
            report["planner_calls"] = calls
        with open(os.path.join(out, f"rank{sess.rank}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
