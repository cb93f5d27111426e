"""Digests of the plans and read plans the planner makes for the coverage table's checkpoints
(header-only copies of published checkpoints, written by ``scripts/vllm_coverage.py``), at
N = 2 to 16, recorded in ``tests/data/plan_digests.json`` before the planner was made faster
(issue 40): a changed step, shape or byte range changes a digest.

    python tests/helpers/plan_digests.py --write    # record them again: only for a meant change
    python tests/helpers/plan_digests.py            # compare, printing what differs

Per (checkpoint, N): ``plan``, the SHA-256 of the plan file's JSON (keys sorted), and
``reads``, of every rank's read plan in order (each piece's fields, its byte runs, the files
by name), or ``"refused"`` where the planner refuses that N.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "tests", "data", "plan_digests.json")
N_ALL = tuple(range(2, 17))

if REPO not in sys.path:  # run as a script
    sys.path.insert(0, REPO)
from devtools.coverage import coverage_script  # noqa: E402


def _plan_digest(plan_file: dict) -> str:
    text = json.dumps(plan_file, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _reads_digest(read_plans) -> str:
    h = hashlib.sha256()
    for rp in read_plans:
        files = [os.path.basename(getattr(s, "path", "")) for s in rp.sources]
        h.update(repr((rp.rank, rp.num_shards, files)).encode())
        for piece in rp.pieces:
            h.update(repr(tuple(piece)).encode())
    return h.hexdigest()[:16]


def digests(folder: str, ns: Iterable[int]) -> dict[str, object]:
    """{N: {"plan": ..., "reads": ...} or "refused"} for the checkpoint in ``folder``."""
    from shardload import PlanError, open_checkpoint
    from shardload.planners import plan_for
    from shardload.readplan import build_read_plans

    out: dict[str, object] = {}
    with open_checkpoint(folder) as ckpt:
        metadata = ckpt.metadata()
        for n in ns:
            try:
                info = plan_for(ckpt, num_shards=n)
            except PlanError:
                out[str(n)] = "refused"
                continue
            validated = info.bind(n).validate(metadata)
            out[str(n)] = {
                "plan": _plan_digest(info.to_dict()),
                "reads": _reads_digest(build_read_plans(validated, ckpt)),
            }
    return out


def model_digests(name: str, ns: Iterable[int]) -> dict[str, object]:
    """``digests`` of the coverage table's checkpoint ``name``, written into a temporary
    folder (sparse files: no disk to speak of)."""
    cov = coverage_script()
    model = next(m for m in cov.MODELS if m["name"] == name)
    with tempfile.TemporaryDirectory(prefix="plan-digests-") as folder:
        cov.write_checkpoint(model, folder)
        return digests(folder, ns)


def recorded() -> dict[str, dict[str, object]]:
    with open(DATA) as f:
        return json.load(f)


def main(argv: list[str]) -> int:
    names = [m["name"] for m in coverage_script().MODELS]
    got = {}
    for name in names:
        got[name] = model_digests(name, N_ALL)
        print(name, "done", file=sys.stderr, flush=True)
    if argv[:1] == ["--write"]:
        os.makedirs(os.path.dirname(DATA), exist_ok=True)
        with open(DATA, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {DATA}")
        return 0
    want = recorded()
    differ = [
        (name, n)
        for name in names
        for n in map(str, N_ALL)
        if got[name].get(n) != want.get(name, {}).get(n)
    ]
    for name, n in differ:
        print(f"{name} N={n}: {want.get(name, {}).get(n)} -> {got[name].get(n)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
