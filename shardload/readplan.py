"""Read plans: what each worker reads, and where it lands, as data.

A ``ValidatedPlan`` says what each parameter's steps are; a ``ReadPlan`` says, for one worker,
which bytes of which file make its piece of each parameter. It is built on the controller before
any tensor data is read, from the validated plan, each shard function's ``ranges`` rule and the
checkpoint's byte locations; it is what a worker process receives (as JSON in the compact form
of ``pieces.wire``: no pickle, no plan to parse or validate there), what ``shardload inspect
--reads`` prints (``to_json``), and what a staged GPU pipeline or expert parallelism can
schedule from.

For each parameter, a worker's ``PieceRead`` is one of:

* **read**: ``runs`` of bytes copied into the piece (the rest of the piece, if
  ``zeros``, stays zero: a padded unit), then an optional ``fixup`` (``split_rebase`` rebases
  its indices). A replicated parameter is one run of the whole tensor (``shared``: the same
  piece on every worker); a split is one run per range, strided when the split axis is not
  the outermost.
* **compute**: ``runs`` fill the whole stored tensor, the ``chain`` of steps runs on it, and
  the worker keeps ``output[index]``: for functions without a ``ranges`` rule and for chains
  of several steps.

A ``Run`` is a strided copy: ``count`` blocks of ``nbytes`` bytes, ``stride`` apart in the
source from ``offset``, ``dst_stride`` apart in the piece from ``dst_offset``.

>>> from shardload import ArrayCheckpoint, ShardInfo
>>> import numpy as np
>>> ckpt = ArrayCheckpoint({"w": np.zeros((4, 6), np.float16)})
>>> plan = ShardInfo.from_dict({"w": [["shardload.split", [[2, 4, 3], "float16"], 1]]})
>>> reads = build_read_plans(plan.bind(2).validate(ckpt.metadata()), ckpt)
>>> reads[1].pieces[0].runs      # 4 rows of 3 halves from byte 6 of each 12-byte row
(Run(source=0, offset=6, nbytes=6, count=4, stride=12, dst_offset=0, dst_stride=6),)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Optional, Sequence

from . import dtypes
from .errors import PlanError, ShardloadError, quote
from .gc_pause import gc_paused
from .selection import Selection

if TYPE_CHECKING:  # pragma: no cover  (a worker process carries out read plans without them)
    from .plan import ParamPlan, ValidatedPlan
    from .readers.base import Checkpoint

__all__ = ["Run", "Chain", "Fixup", "PieceRead", "ReadPlan", "build_read_plans",
           "read_plan_for", "is_read", "worker_functions", "check_run"]


class Run(NamedTuple):
    """``count`` blocks of ``nbytes`` bytes: from ``offset + k * stride`` of source ``source``
    to ``dst_offset + k * dst_stride`` of the piece's (or the chain input's) bytes.

    A named tuple, as is ``PieceRead``: a load makes one per piece and worker (a hundred
    thousand and more for a large MoE), and a tuple is made several times faster than a frozen
    dataclass."""

    source: int
    offset: int
    nbytes: int
    count: int = 1
    stride: int = 0
    dst_offset: int = 0
    dst_stride: int = 0

    @property
    def total(self) -> int:
        return self.nbytes * self.count

    def to_json(self) -> list[int]:
        return list(self)


@dataclass(frozen=True)
class Chain:
    """Steps a worker runs on the whole stored tensor (``shape``, ``dtype``), keeping
    ``output[index]`` of the last."""

    shape: tuple[int, ...]
    dtype: str
    steps: tuple[tuple, ...]  # each as the plan writes it: (func, [out_shape, dtype], *extra)
    index: int

    def runnable(self) -> list[tuple]:
        """The steps as ``(func, out_shape, dtype, extra)``."""
        return [(s[0], tuple(s[1][0]), s[1][1], tuple(s[2:])) for s in self.steps]


@dataclass(frozen=True)
class Fixup:
    """``func``'s fixup, applied to the read piece: ``fixup(piece, *extra, num_shards, index)``."""

    func: str
    extra: tuple


class PieceRead(NamedTuple):
    """One worker's piece of one parameter: its shape and dtype, and how to get it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    runs: tuple[Run, ...]
    zeros: bool = False
    fixup: Optional[Fixup] = None
    chain: Optional[Chain] = None
    #: every worker's piece is this same whole tensor (replicated, not placed): workers that
    #: share a process may read it once and copy it between them
    shared: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the piece the worker keeps."""
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    @property
    def bytes_read(self) -> int:
        """Checkpoint bytes this piece copies."""
        return sum(r.total for r in self.runs)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape),
                               "dtype": self.dtype, "runs": [r.to_json() for r in self.runs]}
        if self.zeros:
            out["zeros"] = True
        if self.shared:
            out["shared"] = True
        if self.fixup is not None:
            out["fixup"] = [self.fixup.func, *self.fixup.extra]
        if self.chain is not None:
            out["chain"] = {"shape": list(self.chain.shape), "dtype": self.chain.dtype,
                            "index": self.chain.index,
                            "steps": [list(s) for s in self.chain.steps]}
        return out

    @classmethod
    def from_json(cls, data: dict) -> "PieceRead":
        chain = data.get("chain")
        fixup = data.get("fixup")
        return cls(
            name=data["name"], shape=tuple(data["shape"]), dtype=data["dtype"],
            runs=tuple(Run(*r) for r in data["runs"]), zeros=bool(data.get("zeros", False)),
            shared=bool(data.get("shared", False)),
            fixup=None if fixup is None else Fixup(fixup[0], tuple(fixup[1:])),
            chain=None if chain is None else Chain(
                tuple(chain["shape"]), chain["dtype"],
                tuple((s[0], [list(s[1][0]), s[1][1]], *s[2:]) for s in chain["steps"]),
                int(chain["index"])))


@dataclass(frozen=True)
class ReadPlan:
    """Everything worker ``rank`` of ``num_shards`` reads: the byte sources (files) and, in
    storage order, its piece of every parameter."""

    rank: int
    num_shards: int
    sources: tuple[dict, ...]
    pieces: tuple[PieceRead, ...]

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def to_json(self) -> dict:
        """Plain JSON values, a piece at a time (``inspect --reads``; a worker process gets
        ``pieces.wire``'s compact form)."""
        return {"rank": self.rank, "num_shards": self.num_shards,
                "sources": list(self.sources), "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, data: dict) -> "ReadPlan":
        return cls(int(data["rank"]), int(data["num_shards"]), tuple(data["sources"]),
                   tuple(PieceRead.from_json(p) for p in data["pieces"]))

    def describe(self) -> list[str]:
        """One line per piece: what it reads (``inspect --reads``)."""
        lines = []
        for p in self.pieces:
            how = "compute " + " > ".join(s[0] for s in p.chain.steps) if p.chain else "read"
            runs = ", ".join(_describe_run(r, self.sources) for r in p.runs[:4])
            if len(p.runs) > 4:
                runs += f", ... ({len(p.runs)} runs)"
            extra = " + zero padding" if p.zeros else ""
            extra += f" + fixup {p.fixup.func}" if p.fixup else ""
            lines.append(f"{p.name}: {how} {p.bytes_read} B{extra}: {runs or 'nothing'}")
        return lines


def check_run(run: Run, source_len: int, dst_len: int, name: str) -> None:
    """Every byte a run touches lies inside its source and its destination."""
    if min(run.offset, run.nbytes, run.count, run.stride, run.dst_offset,
           run.dst_stride) < 0 or run.count < 1:
        raise ShardloadError(f"parameter {name!r}: malformed read run {run}")
    last = run.count - 1
    if run.offset + last * run.stride + run.nbytes > source_len or \
            run.dst_offset + last * run.dst_stride + run.nbytes > dst_len:
        raise ShardloadError(f"parameter {name!r}: read run {run} lies outside its source "
                             f"({source_len} bytes) or its piece ({dst_len} bytes)")


def _describe_run(run: Run, sources: Sequence[dict]) -> str:
    src = sources[run.source]
    where = src.get("file") or f"tensor {src.get('tensor')}"
    base = where.rsplit("/", 1)[-1]
    if run.count == 1:
        return f"{base}[{run.offset}:{run.offset + run.nbytes}]"
    return f"{base}[{run.offset}:+{run.nbytes} x{run.count} every {run.stride}]"


# ---- building ----------------------------------------------------------------------------------

def is_read(param: "ParamPlan") -> bool:
    """Whether workers read their pieces of ``param`` by byte runs (replicated, or one step whose
    function declares a ``ranges`` rule) rather than computing its chain (no rule, several
    steps): the one place that decides it."""
    return param.replicated or (len(param.steps) == 1 and param.funcs[0].ranges is not None)


def worker_functions(param: "ParamPlan") -> list[tuple]:
    """``(step, func)`` of the shard functions a worker itself runs for ``param``: its whole
    chain when computed, else the fixup's function if it has one (a function read by its
    ``ranges`` rule alone runs nowhere)."""
    steps = list(zip(param.steps, param.funcs))
    if not is_read(param):
        return steps
    return [(s, f) for s, f in steps if f.fixup is not None]


def _selection(param: "ParamPlan", n: int, i: int, source: Optional[str]) -> Optional[Selection]:
    """Worker ``i``'s selection of ``param``'s stored tensor, or None when it must be computed:
    a replicated parameter is the whole tensor, a step with a ``ranges`` rule what it says."""
    if not is_read(param):
        return None
    if param.replicated:
        return Selection.whole()
    step, func = param.steps[0], param.funcs[0]
    meta = param.meta
    try:
        sel = func.ranges(meta.shape, meta.dtype, *step.extra, num_shards=n, index=i)
        if not isinstance(sel, Selection):
            raise TypeError(f"it returned {type(sel).__name__}, not a Selection")
        sel.check(meta.shape)
    except (ValueError, TypeError, ArithmeticError, LookupError) as exc:
        raise PlanError(f"the ranges rule of {quote(step.func)} failed for worker {i}: {exc}",
                        source=source, param=param.name, step=step.index) from None
    if sel.piece_shape(meta.shape) != tuple(step.out_shape[1:]):
        raise PlanError(f"the ranges rule of {quote(step.func)} gives worker {i} a piece of "
                        f"shape {list(sel.piece_shape(meta.shape))}, but the step declares "
                        f"{list(step.out_shape[1:])}: the rule disagrees with the function",
                        source=source, param=param.name, step=step.index)
    return sel.coalesced()


def _runs(sel: Selection, shape: Sequence[int], itemsize: int, source: int,
          begin: int) -> tuple[Run, ...]:
    """The strided copies that assemble selection ``sel`` of a C-order tensor at ``begin``."""
    if sel.axis is None:
        nbytes = math.prod(shape) * itemsize
        return (Run(source, begin, nbytes),) if nbytes else ()
    axis = sel.axis
    outer = math.prod(shape[:axis])
    size = shape[axis]
    inner = math.prod(shape[axis + 1:]) * itemsize
    piece = sel.length
    runs = []
    offset = 0
    for start, length in sel.ranges:
        if start is not None and length and outer and inner:
            if outer == 1:
                runs.append(Run(source, begin + start * inner, length * inner, 1, 0,
                                offset * inner, 0))
            elif length == size == piece:  # the whole axis: one contiguous block
                runs.append(Run(source, begin, outer * size * inner))
            else:
                runs.append(Run(source, begin + start * inner, length * inner, outer,
                                size * inner, offset * inner, piece * inner))
        offset += length
    return tuple(runs)


def read_plan_for(validated: "ValidatedPlan", ckpt: "Checkpoint", rank: int) -> ReadPlan:
    """Worker ``rank``'s read plan (see the module docstring)."""
    return build_read_plans(validated, ckpt, [rank])[0]


def build_read_plans(validated: "ValidatedPlan", ckpt: "Checkpoint",
                     ranks: Optional[Iterable[int]] = None) -> list[ReadPlan]:
    """The read plans of workers ``ranks`` (default: all), in that order.

    One pass over the parameters makes every rank's pieces. Every layer repeats the same steps
    on the same shapes, so what a rank's piece of a parameter is (its selection, and the runs
    it makes relative to the tensor's first byte) is worked out once per kind of parameter; a
    tensor's own runs are that template moved to where the tensor lies.
    """
    with gc_paused():  # hundreds of thousands of tuples, all kept
        return _build(validated, ckpt, ranks)


def _build(validated: "ValidatedPlan", ckpt: "Checkpoint",
           ranks: Optional[Iterable[int]]) -> list[ReadPlan]:
    n = validated.num_shards
    ranks = list(range(n) if ranks is None else ranks)
    pieces: list[list[PieceRead]] = [[] for _ in ranks]
    templates: dict[tuple, list] = {}
    new = tuple.__new__
    params = list(validated)
    where = ckpt.locate_all([param.meta.name for param in params])
    for param, (source, begin) in zip(params, where):
        meta = param.meta
        # parameters with the same steps share one tuple of them (``ShardInfo.from_dict``)
        key = (id(param.steps), meta.shape, meta.dtype, param.workers)
        per_rank = templates.get(key)
        if per_rank is None:
            per_rank = templates[key] = [_moving(_template(validated, param, r))
                                         for r in ranks]
        for out, template in zip(pieces, per_rank):
            if template is None:  # placed on other workers
                continue
            shape, dtype, runs, zeros, fixup, chain, shared = template
            # the template's runs moved to where this tensor lies, tuples made whole (a read
            # plan of a large MoE holds hundreds of thousands; most pieces are one run)
            if len(runs) == 1:
                offset, nbytes, count, stride, dst_offset, dst_stride = runs[0]
                moved: tuple = (new(Run, (source, begin + offset, nbytes, count, stride,
                                          dst_offset, dst_stride)),)
            else:
                moved = tuple([new(Run, (source, begin + run[0], *run[1:])) for run in runs])
            out.append(new(PieceRead, (meta.name, shape, dtype, moved, zeros, fixup, chain,
                                       shared)))
    sources = tuple(ckpt.sources())
    return [ReadPlan(r, n, sources, tuple(p)) for r, p in zip(ranks, pieces)]


def _moving(template: Optional[tuple]) -> Optional[tuple]:
    """A template as ``_build`` moves it: each run without its source."""
    if template is None:
        return None
    shape, dtype, runs, *after = template
    return (shape, dtype, [tuple(r)[1:] for r in runs], *after)


def _template(validated: "ValidatedPlan", param: "ParamPlan", rank: int) -> Optional[tuple]:
    """Rank ``rank``'s piece of ``param`` as a ``PieceRead``'s fields after its name, the runs
    counted from the tensor's first byte of source 0; None where it holds none."""
    if not param.held_by(rank):
        return None
    meta = param.meta
    itemsize = dtypes.itemsize(meta.dtype)
    sel = _selection(param, validated.num_shards, rank, validated.plan.source)
    if sel is None:
        chain = Chain(meta.shape, meta.dtype, tuple(tuple(s.to_json()) for s in param.steps),
                      rank)
        return (param.piece_shape, param.piece_dtype,
                _runs(Selection.whole(), meta.shape, itemsize, 0, 0), False, None, chain, False)
    step = param.steps[0] if param.steps else None
    func = param.funcs[0] if param.funcs else None
    fixup = (Fixup(func.name, tuple(step.extra))
             if func is not None and func.fixup is not None else None)
    return (param.piece_shape, param.piece_dtype, _runs(sel, meta.shape, itemsize, 0, 0),
            sel.has_zeros, fixup, None, param.replicated and param.workers is None)
