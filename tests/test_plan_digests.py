"""Every plan and read plan the planner makes for the coverage table's checkpoints is the one
recorded before the planner was made faster (``tests/data/plan_digests.json``, issue 40; see
``helpers/plan_digests.py``): one step, shape or byte range that differs fails here.

By default a cross-section (the smaller checkpoints at N = 3, a padded N, and 8; a
many-expert one at 3); ``-m extended`` every checkpoint at every N from 2 to 16 (minutes: the
planner at full size, 92k tensors for DeepSeek-V3).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from helpers import plan_digests
from helpers.paths import EXAMPLE

DEFAULT = {
    "Qwen/Qwen2.5-7B-Instruct-AWQ": (3, 8),
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16": (3, 8),
    "TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ": (3, 8),
    "openai/gpt-oss-120b": (3, 8),
    "Qwen/Qwen3-30B-A3B-FP8": (3,),
}
RECORDED = plan_digests.recorded()


def _cases():
    for name in RECORDED:
        if name in DEFAULT:
            yield pytest.param(name, DEFAULT[name], id=f"{name}-default")
        rest = tuple(n for n in plan_digests.N_ALL if n not in DEFAULT.get(name, ()))
        yield pytest.param(
            name, rest, id=f"{name}-rest", marks=[pytest.mark.extended, pytest.mark.slow]
        )


@pytest.mark.parametrize("name, ns", list(_cases()))
def test_plans_and_read_plans_are_the_recorded_ones(name, ns):
    got = plan_digests.model_digests(name, ns)
    want = {str(n): RECORDED[name][str(n)] for n in ns}
    assert got == want, "the planner changed: see python tests/helpers/plan_digests.py"


def test_the_recording_covers_every_checkpoint_of_the_table_at_every_n():
    names = [m["name"] for m in plan_digests.coverage_script().MODELS]
    assert sorted(RECORDED) == sorted(names)
    assert all(sorted(map(int, RECORDED[name])) == list(plan_digests.N_ALL) for name in names)


def test_one_byte_range_or_one_step_changes_the_digest():
    from shardload import open_checkpoint
    from shardload.planners import plan_for
    from shardload.readplan import build_read_plans

    with open_checkpoint(EXAMPLE) as ckpt:
        info = plan_for(ckpt, num_shards=3)
        validated = info.bind(3).validate(ckpt.metadata())
        reads = build_read_plans(validated, ckpt)
    base = plan_digests._reads_digest(reads)
    piece = reads[1].pieces[5]
    moved = piece._replace(
        runs=(piece.runs[0]._replace(offset=piece.runs[0].offset + 1), *piece.runs[1:])
    )
    pieces = list(reads[1].pieces)
    pieces[5] = moved
    changed = [reads[0], dataclasses.replace(reads[1], pieces=tuple(pieces)), *reads[2:]]
    assert plan_digests._reads_digest(changed) != base
    plan = info.to_dict()
    name = "model.layers.0.self_attn.q_proj.qweight"
    assert plan[name][0][0] == "shardload.take_units"
    other = copy.deepcopy(plan)
    other[name][0][-1] += 1  # one unit index of one step
    assert plan_digests._plan_digest(other) != plan_digests._plan_digest(plan)
