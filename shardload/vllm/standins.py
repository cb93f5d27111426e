"""Stand-ins: the full-shape tensors vLLM's weight loaders narrow from, holding only this
rank's bytes.

vLLM's contract is "full Hugging Face tensor in": each parameter's ``weight_loader`` takes the
whole logical tensor and narrows its rank's slice. A stand-in is a tensor of that whole shape in
which shardload wrote only the bytes its plan gives this rank; the rest is never written
(``torch.empty``: its pages are never touched, so memory stays at the slice). Handed to the
model's own ``load_weights``, vLLM's fusion, padding, scales and post-processing run unchanged.

Each worker's read plan (``readplan.ReadPlan``) becomes a read plan of stand-ins
(``stand_in_reads``):

* a **read** piece (a split by ranges, or a replicated tensor): the stored tensor's shape, each
  run landing at the place it was read from (a split's fixup, such as a rebase of GPTQ's
  ``g_idx``, is dropped: vLLM narrows the raw tensor itself);
* a piece of a **padded** tensor (the plan zero-pads heads or MLP blocks for an N the model does
  not divide; on every rank, whether its own piece has zeros or not): the padded whole, ``N``
  pieces long along the split axis, this rank's piece at chunk ``rank`` and the rest zeros;
  vLLM's model is then the padded one (``padding.vllm_overrides``);
* a **computed** piece (a chain of shard functions): the whole stored tensor, as read for the
  chain; vLLM narrows it.

A read piece whose reader can give the stored tensor in place (``Checkpoint.view``: a view of
a mapped file) is not read at all when ``view`` is given: its stand-in is that view, and vLLM's
narrowing copies this rank's bytes straight out of the mapping into its parameter, one copy
where reading into a stand-in makes two, and no stand-in memory to fault in. The pages of the
rest of the tensor are never touched. (``verify`` needs stand-ins it can poison, so it reads.)

``mine`` records, per stand-in, the blocks of bytes that are this rank's (``Block``): what
``verify`` poisons around.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import dtypes
from ..errors import PlanError
from ..readplan import PieceRead, Pieces, ReadPlan, Run

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..plan import ValidatedPlan
    from ..readers import Checkpoint

__all__ = ["Block", "StandIns", "stand_in_reads"]


@dataclass(frozen=True)
class Block:
    """``count`` blocks of ``nbytes`` bytes, ``stride`` apart from ``offset``, of a stand-in."""

    offset: int
    nbytes: int
    count: int = 1
    stride: int = 0


@dataclass
class StandIns:
    """This rank's stand-ins: the read plan that makes them, and which of their bytes it wrote
    (``mine``); ``kept``: the bytes of the pieces the plan gives the rank, of which
    ``replicated`` are of tensors every rank holds whole; ``padded``: the zero-padded ones;
    ``views``: the stand-ins that are views of the mapped checkpoint, not read by the plan,
    of which vLLM copies ``viewed`` bytes (this rank's); ``order``: every stand-in's name, in
    the read plan's (storage) order."""

    plan: ReadPlan
    mine: dict[str, tuple[Block, ...]]
    kept: int
    replicated: int
    padded: tuple[str, ...]
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    viewed: int = 0
    order: tuple[str, ...] = ()


def _in_place(
    piece: PieceRead, shape: tuple[int, ...], dtype: str, begin: int
) -> tuple[PieceRead, tuple[Block, ...]]:
    runs = tuple(
        Run(
            r.source,
            r.offset,
            r.nbytes,
            r.count,
            r.stride,
            r.offset - begin,
            r.stride if r.count > 1 else 0,
        )
        for r in piece.runs
    )
    blocks = tuple(Block(r.dst_offset, r.nbytes, r.count, r.dst_stride) for r in runs)
    return PieceRead(piece.name, shape, dtype, runs, shared=piece.shared), blocks


def _padded(
    piece: PieceRead, shape: tuple[int, ...], plan: ReadPlan, source: str | None
) -> tuple[PieceRead, tuple[Block, ...]]:
    axes = [d for d, (a, b) in enumerate(zip(piece.shape, shape)) if a != b]
    if len(axes) != 1 or len(piece.shape) != len(shape):
        raise PlanError(
            f"the padded piece {list(piece.shape)} of a tensor of shape "
            f"{list(shape)} is not one chunk along one axis, so vLLM cannot narrow "
            "it from a padded whole",
            source=source,
            param=piece.name,
        )
    axis, n, rank = axes[0], plan.num_shards, plan.rank
    inner = math.prod(piece.shape[axis + 1 :]) * dtypes.itemsize(piece.dtype)
    outer = math.prod(piece.shape[:axis])
    chunk = piece.shape[axis] * inner  # one worker's bytes per outer row
    row = n * chunk  # the padded whole's bytes per outer row
    runs = []
    for r in piece.runs:
        at = r.dst_offset % chunk if chunk else 0
        if (
            at + r.nbytes > chunk
            or (r.count > 1 and r.dst_stride != chunk)
            or (r.count == 1 and outer > 1 and r.nbytes > chunk)
        ):
            raise PlanError(
                "a padded piece's read crosses a row of the padded whole, which "
                "shardload cannot place for vLLM",
                source=source,
                param=piece.name,
            )
        first_row = r.dst_offset // chunk if chunk else 0
        runs.append(
            Run(
                r.source,
                r.offset,
                r.nbytes,
                r.count,
                r.stride,
                first_row * row + rank * chunk + at,
                row if r.count > 1 else 0,
            )
        )
    whole = list(piece.shape)
    whole[axis] *= n
    blocks = (Block(rank * chunk, chunk, outer, row if outer > 1 else 0),)
    return PieceRead(piece.name, tuple(whole), piece.dtype, tuple(runs), zeros=True), blocks


def _padded_whole(piece: tuple[int, ...], shape: tuple[int, ...], n: int) -> bool:
    """The tensor is padded for N (its N pieces are longer than it along the split axis), so
    every rank's piece goes into the padded whole, a piece without zeros too: vLLM narrows the
    padded model's tensor, whose chunks do not all start where the stored tensor's would."""
    axes = [d for d, (a, b) in enumerate(zip(piece, shape)) if a != b]
    return len(piece) == len(shape) and len(axes) == 1 and piece[axes[0]] * n != shape[axes[0]]


def stand_in_reads(
    plan: ReadPlan,
    validated: ValidatedPlan,
    ckpt: Checkpoint,
    view: Callable[[str], torch.Tensor | None] | None = None,
) -> StandIns:
    """``plan`` (one worker's read plan) as reads of full-shape stand-ins (the module
    docstring); with ``view`` (``Checkpoint.view``), a read piece whose stored tensor it gives
    in place is that view instead of a read.

    >>> ins = stand_in_reads(read_plan_for(validated, ckpt, 1), validated, ckpt)  # doctest: +SKIP
    >>> ins.plan.pieces[0].shape == validated.params[ins.plan.pieces[0].name].meta.shape
    True
    """
    pieces, mine, padded, views, viewed = [], {}, [], {}, 0
    source = validated.plan.source
    # a zero-padded plan (only there are pieces longer in all than the tensor: elsewhere that
    # is a KV head on several ranks, which vLLM narrows from the stored tensor itself)
    padded_plan = "tensor_parallel" in validated.plan.metadata
    for piece in plan.pieces:
        meta = validated.params[piece.name].meta
        if piece.chain is not None:
            whole = PieceRead(piece.name, tuple(piece.chain.shape), piece.chain.dtype, piece.runs)
            made, blocks = (
                whole,
                tuple(Block(r.dst_offset, r.nbytes, r.count, r.dst_stride) for r in piece.runs),
            )
        elif piece.zeros or (
            padded_plan and _padded_whole(piece.shape, tuple(meta.shape), plan.num_shards)
        ):
            made, blocks = _padded(piece, tuple(meta.shape), plan, source)
            padded.append(piece.name)
        else:
            _, begin, _ = ckpt.locate(piece.name)
            made, blocks = _in_place(piece, tuple(meta.shape), meta.dtype, begin)
            in_place = view(piece.name) if view is not None else None
            if in_place is not None:
                views[piece.name], mine[piece.name] = in_place, blocks
                viewed += sum(r.total for r in piece.runs)
                continue
        pieces.append(made)
        mine[piece.name] = blocks
    kept = sum(p.nbytes for p in plan.pieces)
    replicated = sum(p.nbytes for p in plan.pieces if validated.params[p.name].replicated)
    return StandIns(
        ReadPlan(plan.rank, plan.num_shards, plan.sources, Pieces.of(pieces)),
        mine,
        kept,
        replicated,
        tuple(padded),
        views,
        viewed,
        tuple(p.name for p in plan.pieces),
    )
