"""The load loop at scale: the inline read of plain pieces (``pieces.load._read_all``) gives
exactly what the general read (``read_host``) gives, and refuses what it refuses; read plans
travel to worker processes compactly (``pieces.wire``) and arrive unchanged; spans close
together are released and read ahead in one call.
"""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shardload import (
    ProcessSession,
    ShardInfo,
    ShardloadError,
    ThreadedSession,
    load_sharded,
    open_checkpoint,
    strict_json,
)
from shardload.pieces import load as loop
from shardload.pieces import wire
from shardload.pieces.load import read_host
from shardload.pieces.reads import SPAN_GAP_BYTES, Readahead, SourceViews, piece_spans
from shardload.pieces.request import LoadRequest
from shardload.readplan import (
    Chain,
    Fixup,
    Kind,
    PieceRead,
    Pieces,
    ReadPlan,
    Run,
    build_read_plans,
)
from shardload.sources.specs import FileSource
from shardload.staging import Staging

# (name, stored tensor, its plan's steps at N): row splits (one run), column splits (strided
# runs), dtypes numpy lacks (viewed by torch), a scalar, padding and a fixup (the general path)
CASES = {
    "rows": (
        torch.arange(8 * 6, dtype=torch.float16).reshape(8, 6),
        lambda n: [["shardload.split", [[n, 8 // n, 6], "float16"], 0]],
    ),
    "cols": (
        torch.arange(3 * 8, dtype=torch.int32).reshape(3, 8),
        lambda n: [["shardload.split", [[n, 3, 8 // n], "int32"], 1]],
    ),
    "mid": (
        torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3).to(torch.bfloat16),
        lambda n: [["shardload.split", [[n, 2, 8 // n, 3], "bfloat16"], 1]],
    ),
    "fp8": (
        (torch.arange(8 * 4) % 100).to(torch.uint8).view(torch.float8_e4m3fn).reshape(8, 4),
        lambda n: [["shardload.split", [[n, 8 // n, 4], "float8_e4m3fn"], 0]],
    ),
    "whole": (torch.arange(5, dtype=torch.int64), lambda n: []),
    "scalar": (torch.tensor(3.5, dtype=torch.float64), lambda n: []),
    "rebase": (
        torch.arange(8, dtype=torch.int32) // 2,
        lambda n: [["shardload.split_rebase", [[n, 8 // n], "int32"], 0]],
    ),
    "padded": (
        torch.arange(3 * 4, dtype=torch.float16).reshape(3, 4),
        lambda n: [
            [
                "shardload.take_units",
                [[n, 2, 4], "float16"],
                0,
                1,
                *[u if u < 3 else -1 for i in range(n) for u in (i, i + n)],
            ]
        ],
    ),
}


def _checkpoint(tmp_path) -> str:
    path = str(tmp_path / "m.safetensors")
    save_file({name: t for name, (t, _) in CASES.items()}, path)
    return path


def _plan(n: int) -> dict:
    return {name: steps(n) for name, (_, steps) in CASES.items()}


def test_pieces_record_the_fields_the_load_loop_unpacks():
    # _read_all and Pieces unpack a Kind whole, in this order, and make a PieceRead from it:
    # a field added or moved must be taken there too
    assert PieceRead._fields == (
        "name",
        "shape",
        "dtype",
        "runs",
        "zeros",
        "fixup",
        "chain",
        "shared",
    )
    assert Kind._fields == ("shape", "dtype", "tails", "zeros", "fixup", "chain", "shared")


class _Books:
    """What ``_read_all`` asks of its books, counted."""

    def __init__(self):
        self.reports, self.flushed, self.turns = [], None, 0

    def report(self, j, nbytes):
        self.reports.append((j, nbytes))

    def flush(self, upto, nbytes):
        self.flushed = (upto, nbytes)

    def take_turn(self):
        self.turns += 1


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_inline_read_gives_what_the_general_read_gives(tmp_path, n):
    with open_checkpoint(_checkpoint(tmp_path)) as ckpt:
        validated = ShardInfo.from_dict(_plan(n)).bind(n).validate(ckpt.metadata())
        for plan in build_read_plans(validated, ckpt):
            views = SourceViews(ckpt)
            general = []

            def by_general(j, piece, general=general, views=views, rank=plan.rank):
                general.append(piece.name)
                return read_host(piece, views, n, rank)

            kept: dict = {}
            read, nbytes = loop._read_all(plan.pieces, kept, _Books(), views, by_general, True)
            # the plain pieces are read inline; padding and fixups go the general way
            assert set(general) == {"rebase", "padded"} - ({"padded"} if n == 1 else set())
            assert read == plan.bytes_read and nbytes == plan.nbytes
            for piece in plan.pieces:
                want, _ = read_host(piece, SourceViews(ckpt), n, plan.rank)
                got = kept[piece.name]
                assert got.dtype == want.dtype and got.shape == want.shape, piece.name
                assert torch.equal(
                    got.view(torch.uint8) if got.dim() else got,
                    want.view(torch.uint8) if want.dim() else want,
                ), piece.name
                # a new tensor of its own: contiguous, its storage just its bytes
                assert got.is_contiguous() and got.untyped_storage().nbytes() == piece.nbytes


def test_the_inline_read_refuses_what_check_run_refuses(tmp_path):
    with open_checkpoint(_checkpoint(tmp_path)) as ckpt:
        views = SourceViews(ckpt)
        size = ckpt.source_bytes(0).numel()
        bad = {
            "outside": Run(0, size - 8, 16),
            "negative": Run(0, -16, 16),
            "strided outside": Run(0, size - 40, 8, 2, 40, 0, 8),
        }
        for run in bad.values():
            piece = PieceRead("x", (4,), "float32", (run,))
            with pytest.raises(ShardloadError, match="parameter 'x'.*(outside|malformed)"):
                loop._read_all(
                    Pieces.of([piece]),
                    {},
                    _Books(),
                    views,
                    lambda j, p: read_host(p, views, 1, 0),
                    True,
                )


def test_batches_are_reported_as_the_books_define_them(tmp_path):
    big = 3 * loop.BOOKS_BYTES  # a piece this large starts a batch of its own
    arrays = {f"t{k:03d}": np.full(4, k, np.int32) for k in range(2 * loop.BOOKS_PIECES + 5)}
    arrays["t100"] = np.zeros(big // 4, np.int32)
    path = str(tmp_path / "b.safetensors")
    save_file({k: torch.from_numpy(v) for k, v in arrays.items()}, path)
    with open_checkpoint(path) as ckpt:
        validated = ShardInfo.from_dict({}).bind(1).validate(ckpt.metadata())
        plan = build_read_plans(validated, ckpt)[0]
        books, views = _Books(), SourceViews(ckpt)
        kept: dict = {}
        loop._read_all(
            plan.pieces, kept, books, views, lambda j, p: read_host(p, views, 1, 0), True
        )
    starts = [j for j, _ in books.reports]
    at = [p.name for p in plan.pieces].index("t100")
    assert starts[0] == 0 and at in starts
    assert all(b - a <= loop.BOOKS_PIECES for a, b in itertools.pairwise(starts))
    assert books.flushed[0] == len(plan.pieces)
    assert sum(nbytes for _, nbytes in books.reports) + books.flushed[1] == plan.nbytes
    assert all(torch.equal(kept[k], torch.from_numpy(v)) for k, v in arrays.items())


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_load_keeps_what_each_worker_reads_alone(tmp_path, kind):
    path, n = _checkpoint(tmp_path), 4
    session = ThreadedSession(n) if kind == "thread" else ProcessSession(n, device="cpu")
    with session, open_checkpoint(path) as ckpt:
        result = load_sharded(ckpt, _plan(n), session, progress=False)
        validated = ShardInfo.from_dict(_plan(n)).bind(n).validate(ckpt.metadata())
        for plan in build_read_plans(validated, ckpt):
            for piece in plan.pieces:
                want, _ = read_host(piece, SourceViews(ckpt), n, plan.rank)
                got = result.shard(piece.name, plan.rank)
                assert got.dtype == want.dtype and torch.equal(
                    got.view(torch.uint8) if got.dim() else got,
                    want.view(torch.uint8) if want.dim() else want,
                ), (piece.name, plan.rank)


# ---- read plans on the wire ----------------------------------------------------------------------

# a piece's runs lie in one source (a tensor's bytes): ``Pieces`` keeps one per piece
_runs = st.integers(0, 3).flatmap(
    lambda source: st.lists(
        st.builds(
            Run,
            st.just(source),
            st.integers(0, 1 << 40),
            st.integers(0, 99),
            st.integers(1, 9),
            st.integers(0, 999),
            st.integers(0, 99),
            st.integers(0, 99),
        ),
        max_size=3,
    ).map(tuple)
)
_fixups = st.sampled_from(
    [None, Fixup("shardload.split_rebase", (0,)), Fixup("my.fixup", (1, "a", [2, 3]))]
)
_chains = st.sampled_from(
    [None, Chain((4, 2), "float16", (("shardload.split", [[2, 2, 2], "float16"], 0),), 1)]
)
_pieces = st.builds(
    PieceRead,
    st.text(max_size=12),
    st.lists(st.integers(0, 9), max_size=3).map(tuple),
    st.sampled_from(["float16", "int32", "bfloat16", "float8_e4m3fn"]),
    _runs,
    st.booleans(),
    _fixups,
    _chains,
    st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            _pieces,
            st.sampled_from(
                [
                    PieceRead("w", (2, 3), "float16", (Run(0, 64, 12),)),
                    PieceRead("w", (2, 3), "float16", (Run(1, 80, 12),)),
                ]
            ),
        ),
        max_size=12,
    )
)
def test_read_plans_cross_the_wire_unchanged(pieces):
    plan = ReadPlan(
        1, 4, (FileSource("/m-1.safetensors"), FileSource("/m-2.safetensors")), tuple(pieces)
    )
    data = strict_json.loads(json.dumps(wire.encode(plan), allow_nan=False))
    assert wire.decode(data) == plan


def test_a_read_plan_on_the_wire_is_its_kinds_and_flat_lists(tmp_path):
    with open_checkpoint(_checkpoint(tmp_path)) as ckpt:
        validated = ShardInfo.from_dict(_plan(2)).bind(2).validate(ckpt.metadata())
        plan = build_read_plans(validated, ckpt)[1]
    data = wire.encode(plan)
    assert data["names"] == [p.name for p in plan.pieces]
    assert len(data["kind"]) == len(plan.pieces) and len(data["kinds"]) <= len(plan.pieces)
    # where each piece's tensor lies; its runs at their kind's offsets from there
    assert data["source"] == [p.runs[0].source for p in plan.pieces if p.runs]
    for piece, k, begin in zip(plan.pieces, data["kind"], data["begin"]):
        assert [begin + tail[0] for tail in data["kinds"][k]["tails"]] == [
            r.offset for r in piece.runs
        ]
    assert wire.decode(data) == plan


def test_a_piece_whose_runs_lie_in_two_sources_is_refused():
    with pytest.raises(ValueError, match="more than one source"):
        ReadPlan(
            0,
            1,
            (FileSource("/a"), FileSource("/b")),
            (PieceRead("w", (4,), "int32", (Run(0, 0, 8), Run(1, 0, 8))),),
        )


@pytest.mark.parametrize(
    "breaks",
    [
        lambda d: d.update(kind=d["kind"][:-1]),  # a piece without a kind
        lambda d: d.update(kind=[len(d["kinds"])] * len(d["kind"])),  # a kind not there
        lambda d: d.update(kind=[-1] * len(d["kind"])),
        lambda d: d.update(begin=d["begin"][:-1]),  # a piece without its place
        lambda d: d.update(source=d["source"] + [0]),  # numbers left over
        lambda d: d.update(begin=[0.5] * len(d["begin"])),  # not integers
        lambda d: d["kinds"].__setitem__(0, None),  # a kind the worker holds none of
        lambda d: d["kinds"][1]["tails"][0].pop(),  # a run of 5 numbers
        lambda d: d.update(names=[1] * len(d["names"])),  # a name that is not text
    ],
)
def test_a_read_plan_whose_parts_do_not_fit_is_refused(breaks):
    plan = ReadPlan(
        0,
        2,
        (FileSource("/m.safetensors"),),
        (
            PieceRead("a", (2,), "int32", (Run(0, 0, 8),)),
            PieceRead("b", (2,), "int32", (Run(0, 8, 4), Run(0, 16, 4))),
        ),
    )
    data = wire.encode(plan)
    breaks(data)
    with pytest.raises(ValueError):
        wire.decode(data)


def test_a_load_request_crosses_the_wire_unchanged_or_is_refused():
    plan = ReadPlan(
        1, 2, (FileSource("/m.safetensors"),), (PieceRead("a", (2,), "int32", (Run(0, 0, 8),)),)
    )
    request = LoadRequest("7-0", plan, {"slot": 1}, ("my_plugin",), Staging(buffers=2))
    data = strict_json.loads(json.dumps(request.to_json(), allow_nan=False))
    assert LoadRequest.from_json(data) == request
    assert LoadRequest.from_json(LoadRequest("7-0").to_json()) == LoadRequest("7-0")
    for key, value, says in [
        ("load", 7, "naming its load by 7"),
        ("modules", "my_plugin", "modules are 'my_plugin'"),
        ("stream", [1], "stream is \\[1\\]"),
        ("extra", 1, "with keys"),
    ]:
        with pytest.raises(ValueError, match=says):
            LoadRequest.from_json({**data, key: value})


# ---- spans close together ------------------------------------------------------------------------


class _Prefetches:
    def __init__(self):
        self.calls = []

    def prefetch_bytes(self, index, begin, end):
        self.calls.append((index, begin, end))


def test_spans_close_together_are_read_ahead_in_one_call():
    # a worker process's pieces of small tensors: every 4th slice of 256 bytes
    spans = [(f"t{k}", 0, 256 * k + 64, 256 * k + 128) for k in range(1000)]
    far = 100 * SPAN_GAP_BYTES
    spans += [("far", 0, far, far + 10), ("other", 1, 0, 10)]
    source = _Prefetches()
    ahead = Readahead(source, spans).start()
    ahead.reached("other")
    deadline = time.monotonic() + 5
    while len(source.calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    ahead.close()
    assert source.calls == [(0, 64, 256 * 999 + 128), (0, far, far + 10), (1, 0, 10)]


def test_piece_spans_are_the_extents_of_each_piece_s_runs(tmp_path):
    with open_checkpoint(_checkpoint(tmp_path)) as ckpt:
        validated = ShardInfo.from_dict(_plan(4)).bind(4).validate(ckpt.metadata())
        plans = build_read_plans(validated, ckpt)
    # and pieces of several runs (a fused tensor's), the first not the lowest, and none
    plans.append(
        ReadPlan(
            0,
            2,
            (FileSource("/m.safetensors"), FileSource("/n.safetensors")),
            (
                PieceRead("qkv", (6,), "int32", (Run(1, 96, 8), Run(1, 16, 8, 2, 40, 8, 8))),
                PieceRead("pad", (2,), "int32", (), zeros=True),
                PieceRead("w", (2,), "int32", (Run(0, 8, 8),)),
            ),
        )
    )
    for plan in plans:
        want = [
            (
                p.name,
                p.runs[0].source,
                min(r.offset for r in p.runs),
                max(r.offset + (r.count - 1) * r.stride + r.nbytes for r in p.runs),
            )
            for p in plan.pieces
            if p.runs
        ]
        assert piece_spans(plan) == want
