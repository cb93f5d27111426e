"""The planner decides, for a given N, in one pass: the plan fits N as it is, or a plan for N
alone zero-pads heads and MLP blocks, or N is refused naming the constraint it breaks and the N
that work. It knows which N each tensor group allows from the model and the quantization
(``planners.fit``), so nothing is bound or validated to decide; the plan it returns for N is
validated once, as a safety check.

The decisions are checked on the tiny models ``helpers.quantized_models`` and
``helpers.gguf_mlc_models`` build, and the N the constraints allow against validating the plan
for every N (``valid_num_shards``).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from helpers.gguf_mlc_models import GGUF_LINEARS, write_gguf, write_mlc_model
from helpers.quantized_models import (
    GPTQ,
    GQA,
    MQA,
    OTHERS,
    PLAIN,
    THREE,
    WIDE,
    Geometry,
    awq,
    fp8,
    gptq,
    pack_quantized,
    write_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardload.planners as planners
from shardload import PlanError, ThreadedSession, load_sharded, open_checkpoint
from shardload import plan as plan_module
from shardload.cli import cli
from shardload.planners import plan_decision, plan_for, valid_num_shards
from shardload.planners.decision import PlanKind
from shardload.planners.fit import Constraint, Constraints

NS = range(1, 13)


def decisions(ckpt, **kwargs) -> dict[str, list[int]]:
    """N from 1 to 12 by the planner's decision for each."""
    out: dict[str, list[int]] = {"unpadded": [], "padded": [], "refused": []}
    for n in NS:
        out[plan_decision(ckpt, n, **kwargs).kind].append(n)
    return out


# ---- the decision for each N -------------------------------------------------------------------


@pytest.mark.parametrize(
    "geometry, fmt, unpadded, refused",
    [
        # 8 query heads, 2 KV heads, MLP 512: N divides the heads, or is a multiple of the 2 KV
        # heads
        (GQA, PLAIN[0], [1, 2, 4, 8], []),
        (GQA, awq(32), [1, 2, 4, 8], []),
        (GQA, gptq(4, 32), [1, 2, 4, 8], []),  # g_idx: zero rows in zero-scaled groups of their own
        (GQA, gptq(4, -1), [1, 2, 4, 8], [3, 5, 6, 7, 9, 10, 11, 12]),  # per channel, zero points
        # 12 query heads, 3 KV heads, MLP 768
        (THREE, PLAIN[0], [1, 3, 6, 12], []),
        (THREE, fp8("channel"), [1, 3, 6, 12], []),
        (THREE, gptq(4, 32, act_order=True), [1, 3, 6, 12], []),
        # 1 KV head: replicated to every worker; zero points packed 8 to a word along N
        (MQA, pack_quantized(4, 32, False), [1, 2, 4, 8], []),
    ],
    ids=[
        "gqa-fp16",
        "gqa-awq",
        "gqa-gptq",
        "gqa-gptq-channel",
        "three-fp16",
        "three-fp8",
        "three-gptq-act-order",
        "mqa-ct-asym",
    ],
)
def test_unpadded_padded_or_refused(tmp_path, geometry, fmt, unpadded, refused):
    folder = write_model(str(tmp_path), geometry, fmt).folder
    with open_checkpoint(folder) as ckpt:
        got = decisions(ckpt)
        assert got["unpadded"] == unpadded and got["refused"] == refused
        assert got["padded"] == [n for n in NS if n not in unpadded + refused]
        assert list(plan_decision(ckpt).valid)[:4] == unpadded[:4]
        assert decisions(ckpt, pad=False) == {
            "unpadded": unpadded,
            "padded": [],
            "refused": [n for n in NS if n not in unpadded],
        }


def test_what_each_decision_holds(tmp_path):
    folder = write_model(str(tmp_path), THREE, PLAIN[0]).folder
    with open_checkpoint(folder) as ckpt:
        unpadded = plan_decision(ckpt, 3)
        assert unpadded.shard_info().is_symbolic and not unpadded.summary.padded
        padded = plan_decision(ckpt, 4)
        assert padded.shard_info().metadata["tensor_parallel"]["num_shards"] == 4
        assert padded.summary.padded and not padded.shard_info().is_symbolic
        assert list(padded.valid) == [1, 3, 6, 12]
        refused = plan_decision(ckpt, 4, pad=False)
        assert refused.info is None and isinstance(refused.error, PlanError)
        with pytest.raises(PlanError) as err:
            refused.shard_info()
        assert err.value is refused.error
        # the refusal carries the N that work as data, beside its constraint
        assert refused.error.working is refused.valid
        assert str(refused.error).endswith(
            f"{refused.error.constraint}. {refused.valid.describe()}"
        )
        symbolic = plan_decision(ckpt)
        assert symbolic.kind is PlanKind.SYMBOLIC and symbolic.num_shards is None
        # each outcome is its word, in text and JSON as in comparisons
        kinds = [unpadded.kind, padded.kind, refused.kind, symbolic.kind]
        assert kinds == ["unpadded", "padded", "refused", "symbolic"]
        assert [f"{k}" for k in kinds] == [str(k) for k in kinds] == kinds
        assert json.dumps(kinds) == '["unpadded", "padded", "refused", "symbolic"]'


def test_gguf_k_quants_and_mlc(tmp_path):
    # K-quants: attn_output's K = 8 heads of 64 is two 256-element blocks; a head is a quarter
    # of a block, so heads cannot be padded either
    path = str(tmp_path / "m.gguf")
    write_gguf(path, dict.fromkeys(GGUF_LINEARS, T.Q4_K), hidden=512, inter=1024)
    assert decisions(path) == {
        "unpadded": [1, 2],
        "padded": [],
        "refused": [n for n in NS if n > 2],
    }
    # Q8_0 (32-element blocks): heads of 64 pad exactly
    q8 = str(tmp_path / "q8.gguf")
    write_gguf(q8, dict.fromkeys(GGUF_LINEARS, T.Q8_0), hidden=512, inter=1024)
    got = decisions(q8)
    assert got["unpadded"] == [1, 2, 4, 8] and not got["refused"]
    mlc = tmp_path / "mlc"
    write_mlc_model(mlc)
    assert decisions(mlc)["unpadded"] == [1, 2, 4, 8]


# ---- the constraints say what validating every N says --------------------------------------------


@pytest.mark.parametrize("fmt", PLAIN + GPTQ + OTHERS + [fp8("block")], ids=lambda f: f.name)
def test_constraints_allow_exactly_the_n_that_validate(tmp_path, fmt):
    geometries = [WIDE] if fmt.name == "fp8-block" else [GQA, THREE, MQA]
    for k, geometry in enumerate(geometries):
        folder = write_model(str(tmp_path / str(k)), geometry, fmt).folder
        with open_checkpoint(folder) as ckpt:
            decision = plan_decision(ckpt)
            truth = valid_num_shards(decision.shard_info(), ckpt)  # binds and validates each N
            assert list(decision.valid) == list(truth), (fmt.name, geometry)
            assert decision.valid.complete


@st.composite
def models(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 5]))
    head_dim = draw(st.sampled_from([32, 64]))
    inter = draw(st.sampled_from([96, 160, 256, 384, 640]))
    fmt = draw(
        st.sampled_from(
            [
                PLAIN[0],
                gptq(4, 32),
                gptq(3, 32),
                gptq(2, -1),
                awq(32),
                pack_quantized(4, 32, False),
                pack_quantized(8, None, True),
                fp8("channel"),
            ]
        )
    )
    return Geometry(
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        inter=inter,
        vocab=32,
    ), fmt


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=models())
def test_random_models_decide_as_validating_would(tmp_path_factory, case):
    geometry, fmt = case
    folder = write_model(str(tmp_path_factory.mktemp("random")), geometry, fmt).folder
    with open_checkpoint(folder) as ckpt:
        decision = plan_decision(ckpt)
        assert list(decision.valid) == list(valid_num_shards(decision.shard_info(), ckpt))
        for n in (2, 3, 5, 6):
            kind = plan_decision(ckpt, n).kind  # a padded plan has passed its validation
            if n in decision.valid:
                assert kind == "unpadded"
            else:  # per channel with zero points that differ by column cannot pad (the
                # asymmetric GPTQ); a symmetric offset (compressed-tensors) pads with its code
                per_channel_zero_points = fmt.name == "gptq2-g-1-v1"
                assert kind == ("refused" if per_channel_zero_points else "padded"), fmt.name


# ---- no binding or validating to decide ---------------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    """Counts of ``ShardInfo.bind`` and ``Plan.validate`` calls."""
    counts = {"bind": 0, "validate": 0}
    bind, validate = plan_module.ShardInfo.bind, plan_module.Plan.validate

    def counting_bind(self, n):
        counts["bind"] += 1
        return bind(self, n)

    def counting_validate(self, metadata):
        counts["validate"] += 1
        return validate(self, metadata)

    monkeypatch.setattr(plan_module.ShardInfo, "bind", counting_bind)
    monkeypatch.setattr(plan_module.Plan, "validate", counting_validate)
    return counts


@pytest.mark.parametrize(
    "n, pad, kind, validated",
    [
        (3, True, "unpadded", 1),
        (2, True, "padded", 1),
        (2, False, "refused", 0),
        (None, True, "symbolic", 0),
    ],
)
def test_the_decision_binds_nothing_and_validates_once(tmp_path, counted, n, pad, kind, validated):
    folder = write_model(str(tmp_path), THREE, PLAIN[0]).folder
    with open_checkpoint(folder) as ckpt:
        decision = plan_decision(ckpt, n, pad=pad)
    assert decision.kind == kind
    assert counted == {"bind": validated, "validate": validated}  # the safety check, only


def test_refused_with_padding_impossible_validates_nothing(tmp_path, counted):
    folder = write_model(str(tmp_path), THREE, gptq(4, -1)).folder
    with pytest.raises(PlanError, match="per channel"):
        plan_for(folder, num_shards=2)
    assert counted == {"bind": 0, "validate": 0}


# ---- refusals name the constraint ----------------------------------------------------------------


def refusal(folder, n, **kwargs) -> PlanError:
    with pytest.raises(PlanError) as err:
        plan_for(folder, num_shards=n, **kwargs)
    return err.value


def test_refusal_names_the_kv_heads_and_the_n_that_work(tmp_path):
    folder = write_model(str(tmp_path), THREE, PLAIN[0]).folder
    err = refusal(folder, 2, pad=False)
    assert (
        f"{folder} cannot be split over 2 workers: the 3 KV heads "
        "('num_key_value_heads' = 3) do not divide among 2 workers. "
        "N that work (up to 64): 1, 3, 6, 12"
    ) in str(err)
    assert err.param == "model.layers.0.self_attn.k_proj.weight"
    assert err.source == f"<plan for {folder}>"
    err = refusal(folder, 4, pad=False)
    assert (
        "the 3 KV heads ('num_key_value_heads' = 3) can be replicated only to a multiple of "
        "3 workers, not 4"
    ) in str(err)
    err = refusal(folder, 5, pad=False)  # the first tensor in the checkpoint's order
    assert "the 768 MLP rows ('intermediate_size' = 768) do not divide among 5 workers" in str(err)
    assert err.param == "model.layers.0.mlp.down_proj.weight"


def test_refusal_names_packed_words_and_blocks(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(path, dict.fromkeys(GGUF_LINEARS, T.Q4_K), hidden=512, inter=1024)
    err = refusal(path, 4)
    assert (
        "stored in 2 blocks of 256 (Q4_K blocks), 4 to a block, do not divide among 4 "
        "workers; and "
        "zero-padding cannot help"
    ) in str(err)
    assert "heads cannot be padded" in str(err) and "N that work (up to 64): 1, 2" in str(err)
    folder = write_model(str(tmp_path / "gptq"), THREE, gptq(4, 32)).folder
    err = refusal(folder, 24, pad=False)  # 768 MLP rows in 96 words of 8 rows: 24 divides, but
    assert "N that work (up to 64): 1, 3, 6, 12" in str(err)  # not the 3 KV heads


def test_vocab_parallel_is_never_padded(tmp_path):
    folder = write_model(str(tmp_path / "gqa"), GQA, PLAIN[0]).folder  # vocabulary 64
    err = refusal(folder, 3, vocab_parallel=True)
    assert (
        "the 64 vocabulary rows ('vocab_size' = 64) do not divide among 3 workers; and "
        "zero-padding cannot help: the vocabulary is split evenly, never padded"
    ) in str(err)
    assert err.param == "lm_head.weight"
    # heads padded for N = 2, the vocabulary (which 2 divides) split evenly
    folder = write_model(str(tmp_path / "three"), THREE, PLAIN[0]).folder
    with open_checkpoint(folder) as ckpt:
        decision = plan_decision(ckpt, 2, vocab_parallel=True)
        assert decision.kind == "padded"
        with ThreadedSession(2) as sess:
            result = load_sharded(ckpt, decision.shard_info(), sess, progress=False)
        full = ckpt.read("lm_head.weight")
    for i in range(2):
        assert torch.equal(result.shard("lm_head.weight", i), full.chunk(2)[i])


def test_num_shards_is_checked_first(tmp_path):
    folder = write_model(str(tmp_path), GQA, PLAIN[0]).folder
    for n, phrase in (
        (0, "positive integer"),
        ("2", "positive integer"),
        (5000, "more than the 4096"),
    ):
        with pytest.raises(PlanError, match=phrase):
            plan_decision(folder, n)


# ---- shardload plan: one call, its refusal printed -----------------------------------------------


def test_cli_plan_calls_the_planner_once(tmp_path, monkeypatch):
    folder = write_model(str(tmp_path / "m"), THREE, PLAIN[0]).folder
    calls = []
    real = planners.decision.plan_decision
    monkeypatch.setattr(
        planners.decision, "plan_decision", lambda *a, **k: calls.append(a[1:]) or real(*a, **k)
    )
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", "--shards", "2", "-o", str(out), folder])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
    assert (
        "zero-padded for this N; for N=2 only; unpadded plans fit N in 1, 3, 6, 12" in result.stdout
    )  # with -o, the summary is the result
    calls.clear()
    result = CliRunner().invoke(cli, ["plan", "--shards", "3", folder])
    assert result.exit_code == 0 and len(calls) == 1
    assert "valid for N in 1, 3, 6, 12" in result.stderr


def test_cli_plan_prints_the_refusal(tmp_path):
    folder = write_model(str(tmp_path), THREE, gptq(4, -1)).folder
    result = CliRunner().invoke(cli, ["plan", "--shards", "2", folder])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("Error: <plan for ") and "cannot be split over 2 workers" in line
    assert "zero-padding cannot help" in line and line.endswith(
        "N that work (up to 64): 1, 3, 6, 12"
    )
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            "--shards",
            "2",
            "--no-pad",
            write_model(str(tmp_path / "fp16"), THREE, PLAIN[0]).folder,
        ],
    )
    assert result.exit_code == 2 and "do not divide among 2 workers" in result.stderr


# ---- the constraint itself -----------------------------------------------------------------------


def test_constraint_rules():
    heads = Constraint(12, False, "the 12 query heads", "q")
    kv = Constraint(2, True, "the 2 KV heads", "k")
    assert [n for n in range(1, 13) if heads.allows(n)] == [1, 2, 3, 4, 6, 12]
    assert [n for n in range(1, 13) if kv.allows(n)] == [1, 2, 4, 6, 8, 10, 12]
    words = Constraint(64, False, "the 512 MLP rows", "d", stored="stored in 64 blocks of 8")
    assert words.why_not(3) == (
        "the 512 MLP rows, stored in 64 blocks of 8, do not divide among 3 workers"
    )
    group = Constraints()
    for c in (heads, kv, heads, Constraint(12, False, "the 12 query heads", "o")):
        group.add(c)
    assert list(group) == [heads, kv]  # once per rule, the first tensor kept
    assert group.broken(8) == [heads] and group.allows(4)
