"""The planner classifies each kind of tensor once (``planners.tensors.walk``): every tensor's
kind must be what classifying that tensor on its own gives (``tensors.tensors``), on the
coverage table's checkpoints (header-only copies of published ones: Mixtral's ``w1``/``w3``,
DeepSeek-style experts, gpt-oss's fused experts, AWQ, GPTQ, FP8 blocks) and the example.
"""

from __future__ import annotations

import tempfile

import pytest
from helpers.paths import EXAMPLE

from devtools.coverage import coverage_script
from shardload import open_checkpoint
from shardload.planners.kinds import detect
from shardload.planners.tensors import tensors, walk

#: coverage-table checkpoints of a few thousand tensors at most, each a different layout
CHECKPOINTS = (
    "TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ",
    "openai/gpt-oss-120b",
    "Qwen/Qwen2.5-7B-Instruct-AWQ",
    "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
)


def _kinds_agree(ckpt) -> tuple[int, int]:
    """(tensors, kinds) of ``ckpt``, after checking every tensor against its kind."""
    _, spec, scheme = detect(ckpt)
    walked = walk(ckpt, spec, scheme)
    alone = list(tensors(ckpt, spec, scheme))
    assert [t.name for t in walked] == [t.name for t in alone]
    for stamped, own in zip(walked, alone):
        assert stamped == own, stamped.name
    return len(alone), len({id(kind) for kind in walked.kinds})


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_every_tensor_is_classified_as_its_kind(name):
    cov = coverage_script()
    model = next(m for m in cov.MODELS if m["name"] == name)
    with tempfile.TemporaryDirectory(prefix="walk-") as folder:
        cov.write_checkpoint(model, folder)
        with open_checkpoint(folder) as ckpt:
            count, kinds = _kinds_agree(ckpt)
    assert kinds < count / 4  # the layers repeat: each kind planned once


def test_the_example_is_classified_as_its_kinds():
    with open_checkpoint(EXAMPLE) as ckpt:
        _kinds_agree(ckpt)


def test_digits_inside_a_name_component_are_not_an_index():
    # Mixtral's w1 (gate) and w3 (up) have the same shape: only the whole-number components
    # (layers.3, experts.5) may be abstracted, or the two would be planned as one
    cov = coverage_script()
    model = next(m for m in cov.MODELS if m["name"] == CHECKPOINTS[0])
    with tempfile.TemporaryDirectory(prefix="walk-") as folder:
        cov.write_checkpoint(model, folder)
        with open_checkpoint(folder) as ckpt:
            _, spec, scheme = detect(ckpt)
            walked = walk(ckpt, spec, scheme)
            roles = {
                meta.name.rsplit(".", 2)[-2]: kind.role.name
                for meta, kind in walked.rows()
                if ".experts." in meta.name and meta.name.endswith(".qweight")
            }
    assert roles == {"w1": "gate", "w2": "down", "w3": "up"}
