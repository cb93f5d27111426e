"""Placement (``__placement__``) in the plan format, and expert parallelism in the planner.

What is proven, and how:

1. **Placement** (``shardload/plan.py``): a hand-written plan mixing a split parameter, a
   replicated one and parameters held whole by some workers only

   * parses, serialises and parses back to the same plan (``from_dict``/``to_dict``,
     ``dumps``/``loads``, ``Plan.to_dict``); the workers of a placed parameter are a set, kept
     sorted;
   * is refused, with a ``PlanError`` naming the parameter, when a placement lists a worker out
     of range, a worker twice, no worker or a non-integer; when a placed parameter also has
     steps; when a placed name is not in the checkpoint (at validate); and when bound to
     another N than its own (the message says how to re-plan: ``experts='ep'`` in Python,
     ``--experts ep`` on the command line);
   * loads on ``ThreadedSession(3)`` and ``ProcessSession(3)`` with every placed parameter on
     its workers only, bit-exact; ``shard(name, other)`` is a ``KeyError``, ``worker(i)`` and
     ``holds`` leave it out, and the load statistics (kept bytes, tensors, *bytes read*) are
     the sizes worked out by hand here: a worker that does not hold a parameter reads nothing
     of it;
   * shows as such on the command line, against a safetensors file whose header is parsed by
     hand here: ``inspect`` ("(whole on worker k)"), ``inspect --json`` ("workers"),
     ``inspect --reads`` (each worker lists its own tensors only, at the byte offsets of the
     header), ``validate`` ("at most ... per worker (K tensors placed on some workers only)"),
     ``load --json``.

2. **Expert parallelism** (``shardload/planners/experts.py``, ``experts="ep"``):

   a. Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral saved by transformers (one tensor per
      expert): at N = 1, 2, 3, 4, 8 every tensor of expert e is placed whole on exactly the
      worker a balanced contiguous assignment gives (``assignment`` below, written from the
      rule: the first E % N workers take one more expert, in order), and
      ``__metadata__.experts`` records the same; every other tensor has the very steps the
      TP plan for that N gives it (and the same head/MLP padding), and every loaded piece
      equals the reference written from the TP rules (vLLM's GQA layout and zero padding,
      ``helpers.tp_reference``). The load statistics are worked out tensor by tensor. An N
      that only the experts' MLP width breaks needs no padding under EP.
   b. A qwen3moe GGUF written with gguf-py's ``GGUFWriter``, its experts stacked in 3-D
      ``ffn_{gate,up,down}_exps`` tensors ([E, rows, K] in numpy order: GGUF's ``ne``
      reversed), Q8_0 and F16: at N = 2, 3, 4 with 4 experts and N = 4 with 6, each worker's
      piece of every ``*_exps`` tensor is its experts' bytes, in order, and a zero slot where
      it holds fewer (zero bytes); gguf-py's own dequantizer gives, for the piece, that of the
      experts' slice of the whole tensor (and zeros for the slot); the read plan reads only
      the real experts' bytes.
   c. EP without a number of workers, EP of a dense model and an unknown mode are refused.
   d. The command line: ``plan --experts ep`` (no plan file) writes a plan for that N alone,
      which ``load``/``validate`` then use and refuse for another N; ``load --experts ep``
      with a plan file (given, or beside the checkpoint) is a usage error (exit 2).

``check_plan_fits`` refusing a plan for another N (a placed plan, or any plan of plain
integers) says the reason with one full stop, and names the one N the plan works for.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from helpers.cli_runs import run_cli
from helpers.moe_configs import COMMON, CONFIGS, EXPERTS, HEADS, HIDDEN, KV_HEADS, VOCAB, mlp_sizes  # noqa: F401
from helpers.paths import EXAMPLE
from helpers.planner_checks import split_of
from helpers.tp_reference import padded_heads, padded_units, rows_of, take
from safetensors.torch import load_file, save_file

from shardload import (
    ArrayCheckpoint,
    PlanError,
    ProcessSession,
    ShardInfo,
    ThreadedSession,
    load_sharded,
    open_checkpoint,
)
from shardload.errors import cli_text
from shardload.plan import check_plan_fits
from shardload.planners import plan_decision, plan_for, valid_num_shards
from shardload.readplan import read_plan_for

# ----------------------------------------------------------------------------------------------
# the expert assignment, from the rule


def assignment(num_experts: int, n: int) -> list[list[int]]:
    """Each worker's experts: contiguous, in order; the first ``num_experts % n`` workers take
    one more than the others."""
    out, start = [], 0
    for w in range(n):
        count = num_experts // n + (w < num_experts % n)
        out.append(list(range(start, start + count)))
        start += count
    assert start == num_experts
    return out


def slots(num_experts: int, n: int) -> list[list[int]]:
    """``assignment`` with -1 (a zero slot) filling shorter workers up to the longest."""
    held = assignment(num_experts, n)
    width = max(len(h) for h in held)
    return [h + [-1] * (width - len(h)) for h in held]


def owner(num_experts: int, n: int) -> dict[int, int]:
    return {e: w for w, held in enumerate(assignment(num_experts, n)) for e in held}


def test_the_reference_assignment():
    # the rule above, against assignments written out by hand
    assert assignment(4, 3) == [[0, 1], [2], [3]]
    assert slots(6, 4) == [[0, 1], [2, 3], [4, -1], [5, -1]]
    assert slots(4, 8) == [[0], [1], [2], [3], [-1], [-1], [-1], [-1]]
    assert assignment(60, 8) == [
        list(range(s, s + c))
        for s, c in zip((0, 8, 16, 24, 32, 39, 46, 53), (8, 8, 8, 8, 7, 7, 7, 7))
    ]


# ----------------------------------------------------------------------------------------------
# 1. placement in a hand-written plan

N = 3
_rng = torch.Generator().manual_seed(0)
#: name -> tensor: a split parameter, a replicated one, and three placed ones of other dtypes
TENSORS = {
    "embed.weight": torch.randn(6, 4, generator=_rng),  # split along 0: [2, 4] each
    "norm.weight": torch.randn(5, generator=_rng),  # replicated
    "experts.0.w": torch.randn(3, 4, generator=_rng),  # whole on worker 0
    "experts.1.w": torch.randn(2, 4, generator=_rng, dtype=torch.float64),  # whole on 2
    "shared.w": torch.arange(7, dtype=torch.int32),  # whole on workers 0 and 2
}
HOLDERS = {"experts.0.w": [0], "experts.1.w": [2], "shared.w": [0, 2]}
PLAN = {
    "__placement__": {"num_shards": N, "params": HOLDERS},
    "embed.weight": [["shardload.split", [[N, 2, 4], "float32"], 0]],
}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def held(worker: int) -> set[str]:
    """The parameters ``worker`` holds under ``PLAN``: all but those placed elsewhere."""
    return {name for name in TENSORS if worker in HOLDERS.get(name, [worker])}


def want_piece(name: str, worker: int) -> torch.Tensor:
    if name == "embed.weight":
        return TENSORS[name][2 * worker : 2 * worker + 2]
    return TENSORS[name]  # replicated, or placed: whole


#: by hand: every worker 32 B of embed (2 x 4 float32) and 20 B of norm (5 float32); worker 0
#: also experts.0 (12 float32 = 48 B) and shared (7 int32 = 28 B); worker 2 experts.1 (8
#: float64 = 64 B) and shared (28 B)
BYTES = [32 + 20 + 48 + 28, 32 + 20, 32 + 20 + 64 + 28]


def test_placement_parses_and_round_trips():
    info = ShardInfo.from_dict(PLAN)
    assert info.placement is not None and info.placement.num_shards == N
    assert dict(info.placement.params) == {
        "experts.0.w": (0,),
        "experts.1.w": (2,),
        "shared.w": (0, 2),
    }
    assert info.planned_num_shards == N and len(info) == 1  # placed names take no steps
    assert info.to_dict() == PLAN
    again = ShardInfo.loads(info.dumps())
    assert again.to_dict() == PLAN and again.placement == info.placement
    assert ShardInfo.from_dict(json.loads(json.dumps(PLAN))).to_dict() == PLAN
    plan = info.bind(N)
    assert plan.placement == info.placement
    assert plan.to_dict() == PLAN  # plain integers: binding changes nothing
    assert ShardInfo.from_dict(plan.to_dict()).bind(N).to_dict() == PLAN
    # a worker set written in another order is the same set, kept sorted
    shuffled = {**PLAN, "__placement__": {"num_shards": N, "params": {"shared.w": [2, 0]}}}
    assert ShardInfo.from_dict(shuffled).placement.params["shared.w"] == (0, 2)
    # a symbolic plan with a placement is still for the placement's N alone
    symbolic = {
        "__placement__": {"num_shards": 2, "params": {"a": [1]}},
        "b": [["shardload.split", [["num_shards", "6 // num_shards"], "float32"], 0]],
    }
    info = ShardInfo.from_dict(symbolic)
    assert info.is_symbolic and info.planned_num_shards == 2
    assert info.bind(2).params["b"][0].out_shape == (2, 3)
    assert ShardInfo.loads(info.dumps()).to_dict() == symbolic


def test_validated_plan_says_who_holds_what():
    assert BYTES == [sum(nbytes(want_piece(k, w)) for k in held(w)) for w in range(N)]
    validated = ShardInfo.from_dict(PLAN).bind(N).validate(ArrayCheckpoint(TENSORS).metadata())
    for name, workers in HOLDERS.items():
        param = validated.params[name]
        assert param.workers == tuple(workers) and param.replicated
        assert param.piece_shape == tuple(TENSORS[name].shape)
        assert [param.held_by(w) for w in range(N)] == [w in workers for w in range(N)]
    assert validated.params["norm.weight"].workers is None
    assert validated.params["embed.weight"].workers is None
    for w in range(N):
        assert {p.name for p in validated.held_by(w)} == held(w)
        assert validated.bytes_per_worker(w) == BYTES[w]
    assert validated.bytes_per_worker() == max(BYTES)
    assert valid_num_shards(ShardInfo.from_dict(PLAN), ArrayCheckpoint(TENSORS)) == [N]


@pytest.mark.parametrize("workers", [[3], [-1], [0, 0], [], [True], [1.0], 0, None, "0"], ids=repr)
def test_bad_worker_lists_are_refused(workers):
    plan = {"__placement__": {"num_shards": N, "params": {"experts.0.w": workers}}}
    with pytest.raises(PlanError, match=r"non-empty list of distinct workers 0\.\.2") as exc:
        ShardInfo.from_dict(plan)
    assert exc.value.param == "experts.0.w"


@pytest.mark.parametrize(
    "placement",
    [
        [],
        {"num_shards": N},
        {"params": {}},
        {"num_shards": N, "params": {}, "extra": 1},
        {"num_shards": 0, "params": {}},
        {"num_shards": True, "params": {}},
        {"num_shards": 4097, "params": {}},
        {"num_shards": N, "params": []},
    ],
    ids=repr,
)
def test_bad_placements_are_refused(placement):
    with pytest.raises(PlanError, match="__placement__"):
        ShardInfo.from_dict({"__placement__": placement})


def test_placed_name_missing_from_the_checkpoint_is_refused_at_validate():
    plan = {"__placement__": {"num_shards": N, "params": {"experts.7.w": [1]}}}
    bound = ShardInfo.from_dict(plan).bind(N)  # parses and binds: names come later
    with pytest.raises(PlanError, match=r"no tensor named 'experts\.7\.w'") as exc:
        bound.validate(ArrayCheckpoint(TENSORS).metadata())
    assert exc.value.param == "experts.7.w"


def test_placed_name_with_steps_is_refused():
    plan = {**PLAN, "experts.0.w": [["shardload.split", [[N, 1, 4], "float32"], 0]]}
    with pytest.raises(PlanError, match=r"placed on workers \[0\].*has steps") as exc:
        ShardInfo.from_dict(plan)
    assert exc.value.param == "experts.0.w"
    # no steps at all (an empty list, as a replicated parameter may be written) is fine
    info = ShardInfo.from_dict({**PLAN, "experts.0.w": []})
    assert info.bind(N).validate(ArrayCheckpoint(TENSORS).metadata()).params[
        "experts.0.w"
    ].workers == (0,)


@pytest.mark.parametrize("other", [1, 2, 4])
def test_binding_to_another_n_says_how_to_replan(other):
    with pytest.raises(PlanError) as exc:
        ShardInfo.from_dict(PLAN).bind(other)
    text = str(exc.value)
    assert f"num_shards={N} (__placement__)" in text and f"num_shards={other} was" in text
    assert f"plan_for(checkpoint, num_shards={other}, experts='ep')" in text
    assert f"shardload plan --shards {other} --experts ep" in cli_text(exc.value)
    # through the plan's check, which also lists the N that work: for a plan in expressions
    # of num_shards, just the placement's
    symbolic = {
        **PLAN,
        "embed.weight": [["shardload.split", [["num_shards", "6 // num_shards", 4], "float32"], 0]],
    }
    with pytest.raises(PlanError, match=rf"N that work \(up to 64\): {N}$") as exc:
        check_plan_fits(ShardInfo.from_dict(symbolic), ArrayCheckpoint(TENSORS), other)
    assert f"num_shards={N} (__placement__)" in str(exc.value)
    assert f"--shards {other} --experts ep" in cli_text(exc.value)


# check_plan_fits' message (plan.shards._refuse), which placement makes common (a placed plan is
# always for one N), though plain-integer plans have it too
def test_check_num_shards_message_has_one_full_stop():
    with pytest.raises(PlanError) as exc:
        check_plan_fits(ShardInfo.from_dict(PLAN), ArrayCheckpoint(TENSORS), 2)
    assert "`.." not in str(exc.value), str(exc.value)


def test_check_num_shards_names_the_n_a_placed_plan_works_for():
    assert valid_num_shards(ShardInfo.from_dict(PLAN), ArrayCheckpoint(TENSORS)) == [N]
    with pytest.raises(PlanError) as exc:
        check_plan_fits(ShardInfo.from_dict(PLAN), ArrayCheckpoint(TENSORS), 2)
    assert str(exc.value).endswith(f"N that work (up to 64): {N}"), str(exc.value)


@pytest.mark.parametrize(
    "session_class",
    [ThreadedSession, pytest.param(ProcessSession, marks=pytest.mark.slow)],
    ids=["thread", "process"],
)
def test_placed_parameters_load_on_their_workers_only(session_class):
    with session_class(N) as session:
        sharded = load_sharded(TENSORS, PLAN, session, progress=False)
        assert sorted(sharded.names) == sorted(TENSORS)
        for w in range(N):
            mine = sharded.worker(w)
            assert set(mine) == held(w)
            for name in TENSORS:
                assert sharded.holds(name, w) == (name in held(w))
                if name in held(w):
                    want = want_piece(name, w)
                    assert mine[name].dtype == want.dtype
                    assert torch.equal(mine[name], want), (name, w)
                    assert torch.equal(sharded.shard(name, w), want)
                else:
                    with pytest.raises(
                        KeyError,
                        match=rf"worker {w} holds no piece of "
                        rf"'{name}'",
                    ):
                        sharded.shard(name, w)
        assert not sharded.holds("no.such", 0)
        stats = sharded.stats
        assert stats.bytes_per_worker == BYTES
        assert stats.bytes_read_per_worker == BYTES  # nothing padded: read = kept
        assert stats.tensors_per_worker == [len(held(w)) for w in range(N)]


def test_a_worker_may_hold_nothing():
    plan = {"__placement__": {"num_shards": N, "params": {k: [1] for k in TENSORS}}}
    with ThreadedSession(N) as session:
        sharded = load_sharded(TENSORS, plan, session, progress=False)
        assert sharded.worker(0) == {} and sharded.worker(2) == {}
        assert sorted(sharded.worker(1)) == sorted(TENSORS)
        total = sum(map(nbytes, TENSORS.values()))
        assert sharded.stats.bytes_read_per_worker == [0, total, 0]
        assert sharded.stats.tensors_per_worker == [0, len(TENSORS), 0]


# ---- the command line, on a safetensors file -------------------------------------------------


def ok(result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def usage_error(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def data_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in a safetensors file, from its header parsed here."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {
        k: (8 + size + v["data_offsets"][0], 8 + size + v["data_offsets"][1])
        for k, v in header.items()
    }


@pytest.fixture()
def placed_files(tmp_path):
    ckpt = tmp_path / "model.safetensors"
    save_file(TENSORS, str(ckpt))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    return ckpt, plan


def test_cli_shows_placement(placed_files):
    ckpt, plan = placed_files
    lines = ok(run_cli("inspect", "--shards", N, "--shard-info", plan, ckpt)).splitlines()
    rows = {line.split()[0]: line for line in lines[2 : 2 + len(TENSORS)]}
    assert "(whole on worker 0)" in rows["experts.0.w"]
    assert "(whole on worker 2)" in rows["experts.1.w"]
    assert "(whole on workers 0, 2)" in rows["shared.w"]
    assert "(replicated)" in rows["norm.weight"] and "shardload.split" in rows["embed.weight"]
    assert lines[-1] == (
        f"{len(TENSORS)} tensors, at most {max(BYTES)} B per worker "
        f"(3 tensors placed on some workers only)"
    )

    report = json.loads(ok(run_cli("inspect", "--shards", N, "--json", "--shard-info", plan, ckpt)))
    workers = {row["name"]: row["workers"] for row in report["params"]}
    assert workers == {name: HOLDERS.get(name) for name in TENSORS}

    checked = ok(run_cli("validate", "--shards", N, "--shard-info", plan, ckpt))
    assert checked.startswith("ok:")
    assert checked.rstrip().endswith(
        f"at most {max(BYTES)} B per worker (3 tensors placed on some workers only)"
    )

    loaded = json.loads(ok(run_cli("load", "--shards", N, "--json", "--shard-info", plan, ckpt)))
    assert [w["bytes_read"] for w in loaded["workers"]] == BYTES
    assert [w["tensors"] for w in loaded["workers"]] == [len(held(w)) for w in range(N)]


def test_cli_reads_list_each_workers_own_tensors(placed_files):
    ckpt, plan = placed_files
    ranges = data_ranges(ckpt)
    text = ok(run_cli("inspect", "--shards", N, "--reads", "--shard-info", plan, ckpt))
    listed: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        if line.startswith("worker "):
            worker = int(line.split()[1].rstrip(":"))
            assert f"reads {BYTES[worker]} B" in line, line
            listed[worker] = {}
        else:
            name, rest = line.strip().split(": ", 1)
            listed[worker][name] = rest
    assert {w: set(names) for w, names in listed.items()} == {w: held(w) for w in range(N)}
    for name in HOLDERS:
        begin, end = ranges[name]
        for w in HOLDERS[name]:
            assert listed[w][name] == f"read {end - begin} B: {ckpt.name}[{begin}:{end}]"

    report = json.loads(
        ok(run_cli("inspect", "--shards", N, "--reads", "--json", "--shard-info", plan, ckpt))
    )
    assert [w["bytes_read"] for w in report["workers"]] == BYTES
    for w in report["workers"]:
        assert {p["name"] for p in w["pieces"]} == held(w["rank"])


def test_cli_refuses_a_placed_plan_for_another_n(placed_files):
    ckpt, plan = placed_files
    for command in ("validate", "inspect", "load"):
        line = usage_error(run_cli(command, "--shards", 2, "--shard-info", plan, ckpt))
        assert f"num_shards={N} (__placement__)" in line
        assert "Re-plan for 2 workers with `shardload plan --shards 2 --experts ep`" in line


# ----------------------------------------------------------------------------------------------
# 2a. expert parallelism: MoE models saved by transformers, one tensor per expert

# the tiny MoE configs (HEADS, ..., COMMON, CONFIGS): helpers.moe_configs
#: where a layer's experts live, and their projections
EXPERT_MODULES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
SHARDS = (1, 2, 3, 4, 8)
#: 4 query heads over 3 or 8 workers need zero heads (query heads are never replicated); the
#: dense MLPs (128, and Qwen2-MoE's 48-wide shared expert) divide by 1, 2 and 4
PADDED = {3, 8}


def _save(folder: Path, config) -> None:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """``moe_model(arch)``: (folder, config, {name: tensor}), saved once per module."""
    saved: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in saved:
            folder = tmp_path_factory.mktemp(arch)
            config = CONFIGS[arch]()
            _save(folder, config)
            saved[arch] = folder, config, load_file(str(folder / "model.safetensors"))
        return saved[arch]

    return get


def routed_expert(name: str, arch: str):
    """(layer, expert) of a routed expert's tensor, or None."""
    block, projections = EXPERT_MODULES[arch]
    parts = name.split(".")  # model.layers.L.<block>.experts.E.<proj>.weight
    if len(parts) == 8 and parts[3] == block and parts[4] == "experts":
        assert parts[6] in projections, name
        return int(parts[2]), int(parts[5])
    return None


def tp_piece(name, w, n, i, config, padded) -> tuple[torch.Tensor, int]:
    """Worker i's TP piece of a non-expert tensor, and the bytes it reads (zero heads and
    blocks are not read)."""
    split = split_of(name, config)
    if split is None:
        return w, nbytes(w)
    axis, rows, units, replicable, kind = split
    line = nbytes(w) // w.shape[axis]  # bytes of one row (axis 0) or column (axis 1)
    if not padded:
        index = rows_of(n, i, rows, units, replicable)
        piece = w[index] if axis == 0 else w[:, index]
        return piece, (index.stop - index.start) * line
    if kind in ("q", "kv"):
        q_heads, kv_heads = padded_heads(HEADS, KV_HEADS, n)
        worker_units, size = (q_heads if kind == "q" else kv_heads)[i], rows // units
    else:
        worker_units, size = padded_units(rows, n)[i], 1
    piece = torch.from_numpy(take(w.numpy(), worker_units, size, axis))
    return piece, sum(u >= 0 for u in worker_units) * size * line


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_ep_places_whole_experts_on_their_workers(moe_model, arch):
    folder, config, dense = moe_model(arch)
    experts = {name: e for name in dense if (e := routed_expert(name, arch)) is not None}
    layers = {layer for layer, _ in experts.values()}
    assert len(experts) == 3 * EXPERTS * len(layers) and experts  # 3 projections each
    for n in SHARDS:
        decision = plan_decision(str(folder), n, experts="ep")
        info, padded = decision.shard_info(), n in PADDED
        assert decision.kind == ("padded" if padded else "unpadded"), (arch, n)
        # the placement: every expert tensor on its expert's worker, nothing else placed
        owners = owner(EXPERTS, n)
        assert info.placement is not None and info.placement.num_shards == n
        assert dict(info.placement.params) == {
            name: (owners[e],) for name, (_, e) in experts.items()
        }
        assert not set(experts) & set(info.steps)
        assert info.metadata["experts"] == {
            "mode": "ep",
            "num_shards": n,
            "experts_per_worker": {str(EXPERTS): slots(EXPERTS, n)},
        }
        # everything else as the TP plan for this N has it
        tp = plan_for(str(folder), n, experts="tp")
        assert {
            k: v for k, v in tp.to_dict().items() if k not in experts and not k.startswith("__")
        } == {k: v for k, v in info.to_dict().items() if not k.startswith("__")}, (arch, n)
        if padded:
            layout = info.metadata["tensor_parallel"]
            assert (layout["q_heads"], layout["kv_heads"]) == padded_heads(HEADS, KV_HEADS, n)
            dense_sizes = {s for kind, s in mlp_sizes(config).items() if kind != "experts"}
            assert layout["mlp_blocks"] == {str(s): padded_units(s, n) for s in dense_sizes}
            tp_layout = dict(tp.metadata["tensor_parallel"])
            tp_layout["mlp_blocks"] = {
                k: v for k, v in tp_layout["mlp_blocks"].items() if int(k) in dense_sizes
            }
            assert layout == tp_layout
        else:
            assert "tensor_parallel" not in info.metadata

        with ThreadedSession(n) as session:
            sharded = load_sharded(str(folder), decision.validated, session, progress=False)
        kept, read = [0] * n, [0] * n
        for i in range(n):
            worker = sharded.worker(i)
            mine = {name for name, (_, e) in experts.items() if owners[e] == i}
            assert set(worker) == (set(dense) - set(experts)) | mine, (arch, n, i)
            for name, w in dense.items():
                if name in experts:
                    assert sharded.holds(name, i) == (name in mine)
                    if name not in mine:
                        with pytest.raises(KeyError):
                            sharded.shard(name, i)
                        continue
                    want, reads = w, nbytes(w)
                else:
                    want, reads = tp_piece(name, w, n, i, config, padded)
                assert torch.equal(worker[name], want), (arch, n, name, i)
                kept[i] += nbytes(want)
                read[i] += reads
        assert sharded.stats.bytes_per_worker == kept, (arch, n)
        assert sharded.stats.bytes_read_per_worker == read, (arch, n)


def test_ep_plan_is_for_its_n_alone(moe_model):
    folder, _, dense = moe_model("qwen3_moe")
    info = plan_for(str(folder), 2, experts="ep")
    again = ShardInfo.loads(info.dumps())
    assert again.to_dict() == info.to_dict()
    ckpt = open_checkpoint(str(folder))
    with ckpt:
        assert valid_num_shards(again, ckpt) == [2]
        validated = again.bind(2).validate(ckpt.metadata())
        for worker in range(2):
            names = {p.name for p in read_plan_for(validated, ckpt, worker).pieces}
            placed = {k for k, held_by in again.placement.params.items() if worker in held_by}
            assert names == (set(dense) - set(again.placement.params)) | placed
        for other in (1, 4):
            with pytest.raises(PlanError, match="experts='ep'"):
                again.bind(other)


def test_ep_needs_no_padding_for_an_n_only_the_experts_break(tmp_path):
    # 30-row experts do not split over 4 workers: TP zero-pads for N=4, EP keeps them whole and
    # so has nothing to pad: its other tensors are those of the symbolic TP plan
    config = transformers.Qwen3MoeConfig(
        intermediate_size=128,
        moe_intermediate_size=30,
        head_dim=24,
        num_experts=6,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        **COMMON,
    )
    _save(tmp_path, config)
    assert plan_decision(str(tmp_path), 4, experts="tp").kind == "padded"
    decision = plan_decision(str(tmp_path), 4, experts="ep")
    assert decision.kind == "unpadded"
    info = decision.shard_info()
    assert "tensor_parallel" not in info.metadata
    assert info.metadata["experts"]["experts_per_worker"] == {"6": slots(6, 4)}
    symbolic = plan_for(str(tmp_path)).to_dict()
    assert {
        k: v
        for k, v in symbolic.items()
        if not k.startswith("__") and routed_expert(k, "qwen3_moe") is None
    } == {k: v for k, v in info.to_dict().items() if not k.startswith("__")}


# ----------------------------------------------------------------------------------------------
# 2b. expert parallelism: a GGUF with experts stacked in 3-D tensors

GG_HEADS, GG_KV, GG_HEAD_DIM, GG_HIDDEN, GG_MOE, GG_VOCAB = 4, 2, 32, 64, 128, 64
EXPS = ("FFN_GATE_EXP", "FFN_UP_EXP", "FFN_DOWN_EXP")


def gguf_tensor(kind: str) -> str:
    """gguf-py's name for a qwen3moe tensor of block 0, checked to be one it lists."""
    tensor = gguf.MODEL_TENSOR[kind]
    assert tensor in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE], kind
    return gguf.TENSOR_NAMES[tensor].format(bid=0) + ".weight"


def write_qwen3moe(path: str, num_experts: int, qtype: T) -> None:
    """A one-layer qwen3moe: linear weights and stacked experts in ``qtype``, norms and the
    router F32. Shapes are numpy's (gguf-py writes ``ne`` reversed)."""
    rng = np.random.default_rng(num_experts)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_block_count(1)
    writer.add_embedding_length(GG_HIDDEN)
    writer.add_feed_forward_length(4 * GG_HIDDEN)
    writer.add_head_count(GG_HEADS)
    writer.add_head_count_kv(GG_KV)
    writer.add_key_length(GG_HEAD_DIM)
    writer.add_value_length(GG_HEAD_DIM)
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(GG_MOE)
    q, kv, e = GG_HEADS * GG_HEAD_DIM, GG_KV * GG_HEAD_DIM, num_experts
    matrices = {
        "TOKEN_EMBD": (GG_VOCAB, GG_HIDDEN),
        "OUTPUT": (GG_VOCAB, GG_HIDDEN),
        "ATTN_Q": (q, GG_HIDDEN),
        "ATTN_K": (kv, GG_HIDDEN),
        "ATTN_V": (kv, GG_HIDDEN),
        "ATTN_OUT": (GG_HIDDEN, q),
        "FFN_GATE_EXP": (e, GG_MOE, GG_HIDDEN),
        "FFN_UP_EXP": (e, GG_MOE, GG_HIDDEN),
        "FFN_DOWN_EXP": (e, GG_HIDDEN, GG_MOE),
    }
    vectors = {
        "OUTPUT_NORM": (GG_HIDDEN,),
        "ATTN_NORM": (GG_HIDDEN,),
        "FFN_NORM": (GG_HIDDEN,),
        "ATTN_Q_NORM": (GG_HEAD_DIM,),
        "ATTN_K_NORM": (GG_HEAD_DIM,),
        "FFN_GATE_INP": (e, GG_HIDDEN),
    }
    for kind, shape in matrices.items():
        name = gguf_tensor(kind)
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == T.F16:
            writer.add_tensor(name, x.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    for kind, shape in vectors.items():
        writer.add_tensor(gguf_tensor(kind), rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _deq(raw: np.ndarray, qtype: T) -> np.ndarray:
    return raw.astype(np.float32) if qtype == T.F16 else dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("num_experts, n", [(4, 2), (4, 3), (4, 4), (6, 4)])
def test_gguf_stacked_experts_split_in_whole_experts(tmp_path, qtype, num_experts, n):
    path = str(tmp_path / "moe.gguf")
    write_qwen3moe(path, num_experts, qtype)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    exps = [gguf_tensor(kind) for kind in EXPS]
    # GGUF's ne is innermost first; gguf-py's data is numpy order, [E, rows, K] (bytes of K for
    # a quantized type)
    assert stored[exps[0]].shape.tolist() == [GG_HIDDEN, GG_MOE, num_experts]
    assert stored[exps[2]].shape.tolist() == [GG_MOE, GG_HIDDEN, num_experts]
    assert all(stored[name].data.shape[0] == num_experts for name in exps)

    with open_checkpoint(path) as ckpt:
        decision = plan_decision(ckpt, n, experts="ep")
        info = decision.shard_info()
        layout = slots(num_experts, n)
        assert info.metadata["experts"]["experts_per_worker"] == {str(num_experts): layout}
        assert dict(info.placement.params) == {}  # stacked: split, not placed
        # the other tensors as the TP plan for this N has them (128-row experts in 32-element
        # blocks divide by 2 and 4 and are padded at 3, as the 4 heads are)
        tp = plan_for(ckpt, n, experts="tp").to_dict()
        ep = info.to_dict()
        assert {k: v for k, v in tp.items() if k not in exps and not k.startswith("__")} == {
            k: v for k, v in ep.items() if k not in exps and not k.startswith("__")
        }
        with ThreadedSession(n) as session:
            sharded = load_sharded(ckpt, decision.validated, session, progress=False)
        reads = [read_plan_for(decision.validated, ckpt, i) for i in range(n)]
        assert sharded.stats.bytes_read_per_worker == [r.bytes_read for r in reads]
    for name in exps:
        whole = np.array(stored[name].data)
        per_expert = whole.nbytes // num_experts
        for i in range(n):
            piece = sharded.shard(name, i).numpy()
            assert piece.shape == (len(layout[i]), *whole.shape[1:]), (name, i)
            real = [e for e in layout[i] if e >= 0]
            assert real == assignment(num_experts, n)[i]
            for k, e in enumerate(layout[i]):
                want = whole[e] if e >= 0 else np.zeros_like(whole[0])
                assert np.array_equal(piece[k].view(np.uint8), want.view(np.uint8)), (name, i, k, e)
            got = _deq(piece, qtype)
            assert np.array_equal(got[: len(real)], _deq(whole[real[0] : real[-1] + 1], qtype))
            assert not got[len(real) :].any()  # a zero slot dequantizes to zeros
            piece_read = next(p for p in reads[i].pieces if p.name == name)
            assert piece_read.bytes_read == len(real) * per_expert
            assert piece_read.nbytes == len(layout[i]) * per_expert


# ----------------------------------------------------------------------------------------------
# 2c. refusals


def test_ep_needs_a_number_of_workers(moe_model):
    folder, _, _ = moe_model("mixtral")
    with pytest.raises(PlanError, match="for one number of workers: give num_shards"):
        plan_decision(str(folder), None, experts="ep")
    with pytest.raises(PlanError, match="give num_shards"):
        plan_for(str(folder), experts="ep")


def test_ep_of_a_dense_model_is_refused():
    with pytest.raises(
        PlanError,
        match=r"has no routed experts \(llama\): expert parallelism "
        r"needs a mixture-of-experts model; plan with "
        r"experts='tp'",
    ):
        plan_decision(EXAMPLE, 2, experts="ep")


@pytest.mark.parametrize("mode", ["xyz", "EP", "", None])
def test_unknown_expert_modes_are_refused(moe_model, mode):
    folder, _, _ = moe_model("mixtral")
    with pytest.raises(PlanError, match=r"experts must be one of 'tp', 'ep', got"):
        plan_decision(str(folder), 2, experts=mode)
    with pytest.raises(PlanError, match=r"experts must be one of"):
        plan_for(str(folder), 2, experts=mode)


# ----------------------------------------------------------------------------------------------
# 2d. the command line


def test_cli_plan_ep_then_load_and_validate_with_it(moe_model, tmp_path):
    folder, config, dense = moe_model("mixtral")
    n = 3
    result = run_cli("plan", "--shards", n, "--experts", "ep", folder)
    written = json.loads(ok(result))
    owners = owner(EXPERTS, n)
    experts = {name: ex[1] for name in dense if (ex := routed_expert(name, "mixtral")) is not None}
    assert written["__placement__"] == {
        "num_shards": n,
        "params": {name: [owners[e]] for name, e in experts.items()},
    }
    assert written["__metadata__"]["experts"]["experts_per_worker"] == {
        str(EXPERTS): slots(EXPERTS, n)
    }
    assert f"for N={n} only (whole experts are placed on its workers)" in result.stderr
    plan = tmp_path / "ep.json"
    plan.write_text(result.stdout)

    # by hand: each worker reads its experts whole, attention as TP in zero-padded heads (4
    # heads over 3 workers), routers, norms and embeddings whole
    want_read = [
        sum(
            (nbytes(w) * (owners[experts[name]] == i))
            if name in experts
            else tp_piece(name, w, n, i, config, padded=True)[1]
            for name, w in dense.items()
        )
        for i in range(n)
    ]
    report = json.loads(ok(run_cli("load", "--shards", n, "--json", "--shard-info", plan, folder)))
    assert [w["bytes_read"] for w in report["workers"]] == want_read
    assert [w["tensors"] for w in report["workers"]] == [
        len(dense) - len(experts) + sum(owners[e] == i for e in experts.values()) for i in range(n)
    ]
    # planning on the fly (--experts ep, no plan file) loads the same
    direct = json.loads(ok(run_cli("load", "--shards", n, "--json", "--experts", "ep", folder)))
    assert direct["workers"] == report["workers"]
    line = usage_error(run_cli("validate", "--shards", 2, "--shard-info", plan, folder))
    assert "`shardload plan --shards 2 --experts ep`" in line
    checked = ok(run_cli("validate", "--shards", n, "--experts", "ep", folder))
    assert checked.rstrip().endswith(f"({len(experts)} tensors placed on some workers only)")


def test_cli_experts_applies_only_when_shardload_plans(moe_model, tmp_path, placed_files):
    folder, _, _ = moe_model("mixtral")
    ckpt, plan = placed_files
    line = usage_error(
        run_cli("load", "--shards", N, "--experts", "ep", "--shard-info", plan, ckpt)
    )
    assert "--experts ep chooses how shardload plans" in line
    assert "is used as it is" in line and "shardload plan --experts ep" in line
    # a plan beside the checkpoint is a plan file too
    copy = tmp_path / "beside"
    shutil.copytree(folder, copy)
    (copy / "shard_info.json").write_text(plan_for(str(copy), 2).dumps())
    for command in ("load", "validate", "inspect"):
        line = usage_error(run_cli(command, "--shards", 2, "--experts", "ep", copy))
        assert "--experts ep chooses how shardload plans" in line
        assert "shard_info.json" in line
    # --experts tp (the default) with a plan file is fine
    ok(run_cli("validate", "--shards", 2, "--experts", "tp", copy))
