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

A worker's pieces are held as columns (``Pieces``): per piece its name, its kind (``Kind``:
everything else, its runs counted from the tensor's first byte) and where its tensor lies.
The columns are shared by every worker's plan of one build, a kind is worked out once per
worker, and a ``PieceRead`` is made only when one is asked for: the read plans of
DeepSeek-V3's 91,991 tensors for 32 workers take 0.1 s and a few MB, not 5.9 s and 28 MB each.

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
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from . import dtypes
from .errors import PlanError, ShardloadError, quote
from .gc_pause import gc_paused
from .selection import Selection
from .sources.specs import SourceSpec, source_from_json

if TYPE_CHECKING:  # pragma: no cover  (a worker process carries out read plans without them)
    from .plan import ParamPlan, ValidatedPlan
    from .readers.base import Checkpoint

__all__ = [
    "Chain",
    "Fixup",
    "Kind",
    "PieceRead",
    "Pieces",
    "ReadPlan",
    "Run",
    "build_read_plans",
    "check_run",
    "is_read",
    "read_plan_for",
    "sources_from_json",
    "worker_functions",
]


class Run(NamedTuple):
    """``count`` blocks of ``nbytes`` bytes: from ``offset + k * stride`` of source ``source``
    to ``dst_offset + k * dst_stride`` of the piece's (or the chain input's) bytes.

    A named tuple, as is ``PieceRead``: a load makes one per piece and worker (a hundred
    thousand and more for a large MoE), and a tuple is made several times faster than a frozen
    dataclass."""

    source: int
    offset: int
    nbytes: int
    # shadows tuple.count, which no code calls on a run
    count: int = 1  # type: ignore[assignment]
    stride: int = 0
    dst_offset: int = 0
    dst_stride: int = 0

    @property
    def total(self) -> int:
        return self.nbytes * self.count

    @property
    def step(self) -> int:
        """Bytes from one block's start to the next's in the source: ``stride``, or ``nbytes``
        where it is 0 (blocks back to back, as for ``dst_stride``)."""
        return self.stride or self.nbytes

    @property
    def dst_step(self) -> int:
        """``step`` in the piece: ``dst_stride``, or ``nbytes`` where it is 0."""
        return self.dst_stride or self.nbytes

    @property
    def end(self) -> int:
        """One past the last source byte the run copies.

        >>> Run(0, 10, 4, count=3, stride=8).end, Run(0, 10, 4, count=3).end
        (30, 22)
        """
        return self.offset + (self.count - 1) * self.step + self.nbytes

    @property
    def dst_end(self) -> int:
        """One past the last byte of the piece the run writes."""
        return self.dst_offset + (self.count - 1) * self.dst_step + self.nbytes

    def spans(self) -> list[tuple[int, int]]:
        """The source byte spans the run copies, ``[(begin, end), ...]``: one where its blocks
        lie back to back, else one per block.

        >>> Run(0, 10, 4, count=2, stride=8).spans(), Run(0, 10, 4, count=2).spans()
        ([(10, 14), (18, 22)], [(10, 18)])
        """
        step = self.step
        if self.count == 1 or step == self.nbytes:
            return [(self.offset, self.end)]
        return [(a, a + self.nbytes) for a in range(self.offset, self.end, step)]

    def check(self, source_len: int, dst_len: int, name: str) -> None:
        """Every byte the run touches lies inside its source (``source_len`` bytes) and its
        piece (``dst_len``); a ``ShardloadError`` naming parameter ``name`` otherwise."""
        if min(self.offset, self.nbytes, self.stride, self.dst_offset, self.dst_stride) < 0 or (
            self.count < 1
        ):
            raise ShardloadError(f"parameter {name!r}: malformed read run {self}")
        if self.end > source_len or self.dst_end > dst_len:
            raise ShardloadError(
                f"parameter {name!r}: read run {self} lies outside its source "
                f"({source_len} bytes) or its piece ({dst_len} bytes)"
            )

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
    fixup: Fixup | None = None
    chain: Chain | None = None
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
        out: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "runs": [r.to_json() for r in self.runs],
        }
        if self.zeros:
            out["zeros"] = True
        if self.shared:
            out["shared"] = True
        if self.fixup is not None:
            out["fixup"] = [self.fixup.func, *self.fixup.extra]
        if self.chain is not None:
            out["chain"] = {
                "shape": list(self.chain.shape),
                "dtype": self.chain.dtype,
                "index": self.chain.index,
                "steps": [list(s) for s in self.chain.steps],
            }
        return out

    @classmethod
    def from_json(cls, data: dict) -> PieceRead:
        chain = data.get("chain")
        fixup = data.get("fixup")
        return cls(
            name=data["name"],
            shape=tuple(data["shape"]),
            dtype=data["dtype"],
            runs=tuple(Run(*r) for r in data["runs"]),
            zeros=bool(data.get("zeros", False)),
            shared=bool(data.get("shared", False)),
            fixup=None if fixup is None else Fixup(fixup[0], tuple(fixup[1:])),
            chain=None
            if chain is None
            else Chain(
                tuple(chain["shape"]),
                chain["dtype"],
                tuple((s[0], [list(s[1][0]), s[1][1]], *s[2:]) for s in chain["steps"]),
                int(chain["index"]),
            ),
        )


class Kind(NamedTuple):
    """A kind of piece: a ``PieceRead`` but for its name and where its tensor lies. A plan's
    pieces are few kinds repeated (every layer alike, every expert alike). ``tails`` are its
    runs, each as ``(offset, (nbytes, count, stride, dst_offset, dst_stride))`` with the offset
    counted from the tensor's first byte."""

    shape: tuple[int, ...]
    dtype: str
    tails: tuple[tuple[int, tuple[int, ...]], ...]  # each tail: five numbers
    zeros: bool
    fixup: Fixup | None
    chain: Chain | None
    shared: bool


class Pieces(Sequence[PieceRead]):
    """A worker's pieces, in storage order, as columns: each piece's ``name``, its ``kind``
    (an index into ``kinds``, a table of ``Kind``), and the ``source`` and ``begin`` of its
    tensor's bytes (a run lies at ``begin`` plus its tail's offset).

    A read plan of a large MoE holds a hundred thousand pieces per worker. As objects (a
    ``PieceRead``, a tuple of runs, a ``Run`` each) they took 0.2 s and 28 MB per worker to
    make, and every worker's plan repeated the same names and places: here the columns are
    made once for all the workers of a build and shared (a worker's own is its ``kinds``), and
    a ``PieceRead`` is made when one is asked for (indexing, iterating). The load loop reads
    the columns themselves (``pieces.load``).

    >>> p = Pieces(["w"], [Kind((2,), "float16", ((4, (4, 1, 0, 0, 0)),), False, None, None,
    ...            False)], [0], [0], [100])
    >>> p[0].runs
    (Run(source=0, offset=104, nbytes=4, count=1, stride=0, dst_offset=0, dst_stride=0),)
    """

    __slots__ = ("begin", "kind", "kinds", "names", "source")

    def __init__(
        self,
        names: Sequence[str],
        kinds: Sequence[Kind | None],
        kind: Sequence[int],
        source: Sequence[int],
        begin: Sequence[int],
    ):
        if not len(names) == len(kind) == len(source) == len(begin):
            raise ValueError(
                f"columns of {len(names)} names, {len(kind)} kinds, "
                f"{len(source)} sources and {len(begin)} begins"
            )
        self.names, self.kinds, self.kind = names, kinds, kind
        self.source, self.begin = source, begin

    @classmethod
    def of(cls, pieces: Iterable[PieceRead]) -> Pieces:
        """``pieces`` as columns. A piece's runs all lie in one source (a tensor's bytes);
        ``ValueError`` otherwise."""
        names, kind, source, begin = [], [], [], []
        kinds: list[Kind | None] = []
        index: dict[tuple, int] = {}
        for piece in pieces:
            runs = piece.runs
            at, base = (runs[0].source, runs[0].offset) if runs else (0, 0)
            if any(r.source != at for r in runs):
                raise ValueError(f"piece {piece.name!r}: its runs lie in more than one source")
            tails = tuple((r.offset - base, tuple(r[2:])) for r in runs)
            # a fixup or chain is told apart by identity (a chain's steps hold lists)
            key = (
                piece.shape,
                piece.dtype,
                tails,
                piece.zeros,
                id(piece.fixup),
                id(piece.chain),
                piece.shared,
            )
            k = index.get(key)
            if k is None:
                k = index[key] = len(kinds)
                kinds.append(
                    Kind(
                        piece.shape,
                        piece.dtype,
                        tails,
                        piece.zeros,
                        piece.fixup,
                        piece.chain,
                        piece.shared,
                    )
                )
            names.append(piece.name)
            kind.append(k)
            source.append(at)
            begin.append(base)
        return cls(names, kinds, kind, source, begin)

    def __len__(self) -> int:
        return len(self.names)

    def _make(self, name: str, kind: Kind, source: int, begin: int) -> PieceRead:
        new = tuple.__new__
        shape, dtype, tails, zeros, fixup, chain, shared = kind
        if len(tails) == 1:
            offset, tail = tails[0]
            runs: tuple = (new(Run, (source, begin + offset) + tail),)
        else:
            runs = tuple([new(Run, (source, begin + offset) + tail) for offset, tail in tails])
        return new(PieceRead, (name, shape, dtype, runs, zeros, fixup, chain, shared))

    def __getitem__(self, j):
        if isinstance(j, slice):
            return tuple(self[k] for k in range(*j.indices(len(self))))
        return self._make(
            self.names[j],
            self.kinds[self.kind[j]],
            self.source[j],
            self.begin[j],
        )

    def __iter__(self) -> Iterator[PieceRead]:
        make, kinds = self._make, self.kinds
        for name, k, source, begin in zip(self.names, self.kind, self.source, self.begin):
            yield make(name, kinds[k], source, begin)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Pieces, tuple, list)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<{len(self)} pieces of {len(self.kinds)} kinds>"

    def counts(self) -> list[tuple[Kind, int]]:
        """Each kind of piece this worker holds, and how many."""
        return [(self.kinds[k], n) for k, n in Counter(self.kind).items()]  # type: ignore[misc]

    def spans(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(source, first, end)``: the bytes each run of pieces ``[start, stop)`` copies
        from, first to last byte."""
        out = []
        kinds = self.kinds
        # each kind's runs as (offset, length) once: a Run per piece cost a worker process
        # 10 % of its load of 90,000 small pieces (benchmarks/bench_many.py)
        lengths: dict[int, list[tuple[int, int]]] = {}
        for k, source, begin in zip(
            self.kind[start:stop], self.source[start:stop], self.begin[start:stop]
        ):
            runs = lengths.get(k)
            if runs is None:
                tails = kinds[k].tails  # type: ignore[union-attr]
                runs = lengths[k] = [
                    (offset, Run(0, 0, nbytes, count, stride).end)
                    for offset, (nbytes, count, stride, _, _) in tails
                ]
            for offset, length in runs:
                first = begin + offset
                out.append((source, first, first + length))
        return out


@dataclass(frozen=True)
class ReadPlan:
    """Everything worker ``rank`` of ``num_shards`` reads: the byte sources (``sources.specs``:
    files, or tensors held in memory) and, in storage order, its piece of every parameter."""

    rank: int
    num_shards: int
    sources: tuple[SourceSpec, ...]
    #: a ``Pieces`` (any sequence of ``PieceRead`` given is turned into one)
    pieces: Pieces

    def __post_init__(self) -> None:
        if not isinstance(self.pieces, Pieces):
            object.__setattr__(self, "pieces", Pieces.of(self.pieces))

    @property
    def bytes_read(self) -> int:
        return sum(
            sum(tail[0] * tail[1] for _, tail in kind.tails) * n for kind, n in self.pieces.counts()
        )

    @property
    def nbytes(self) -> int:
        return sum(
            math.prod(kind.shape) * dtypes.itemsize(kind.dtype) * n
            for kind, n in self.pieces.counts()
        )

    def to_json(self) -> dict:
        """Plain JSON values, a piece at a time (``inspect --reads``; a worker process gets
        ``pieces.wire``'s compact form)."""
        return {
            "rank": self.rank,
            "num_shards": self.num_shards,
            "sources": [source.to_json() for source in self.sources],
            "pieces": [p.to_json() for p in self.pieces],
        }

    @classmethod
    def from_json(cls, data: dict) -> ReadPlan:
        return cls(
            int(data["rank"]),
            int(data["num_shards"]),
            sources_from_json(data["sources"]),
            Pieces.of(PieceRead.from_json(p) for p in data["pieces"]),
        )

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
    """Every byte a run touches lies inside its source and its destination (``Run.check``)."""
    run.check(source_len, dst_len, name)


def sources_from_json(data: object) -> tuple[SourceSpec, ...]:
    """A read plan's ``sources`` as ``to_json`` wrote them (``sources.specs``); a
    ``ValueError`` naming the source and field that is not what it must be."""
    if not isinstance(data, list):
        raise ValueError(f"a read plan's sources are not a list: {type(data).__name__}")
    return tuple(source_from_json(source, k) for k, source in enumerate(data))


def _describe_run(run: Run, sources: Sequence[SourceSpec]) -> str:
    base = sources[run.source].describe()
    if run.count == 1:
        return f"{base}[{run.offset}:{run.offset + run.nbytes}]"
    return f"{base}[{run.offset}:+{run.nbytes} x{run.count} every {run.step}]"


# ---- building ----------------------------------------------------------------------------------


def is_read(param: ParamPlan) -> bool:
    """Whether workers read their pieces of ``param`` by byte runs (replicated, or one step whose
    function declares a ``ranges`` rule) rather than computing its chain (no rule, several
    steps): the one place that decides it."""
    return param.replicated or (len(param.steps) == 1 and param.funcs[0].ranges is not None)


def worker_functions(param: ParamPlan) -> list[tuple]:
    """``(step, func)`` of the shard functions a worker itself runs for ``param``: its whole
    chain when computed, else the fixup's function if it has one (a function read by its
    ``ranges`` rule alone runs nowhere)."""
    steps = list(zip(param.steps, param.funcs))
    if not is_read(param):
        return steps
    return [(s, f) for s, f in steps if f.fixup is not None]


def _selection(param: ParamPlan, n: int, i: int, source: str | None) -> Selection | None:
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
        raise PlanError(
            f"the ranges rule of {quote(step.func)} failed for worker {i}: {exc}",
            source=source,
            param=param.name,
            step=step.index,
        ) from None
    if sel.piece_shape(meta.shape) != tuple(step.out_shape[1:]):
        raise PlanError(
            f"the ranges rule of {quote(step.func)} gives worker {i} a piece of "
            f"shape {list(sel.piece_shape(meta.shape))}, but the step declares "
            f"{list(step.out_shape[1:])}: the rule disagrees with the function",
            source=source,
            param=param.name,
            step=step.index,
        )
    return sel.coalesced()


def _runs(
    sel: Selection, shape: Sequence[int], itemsize: int, source: int, begin: int
) -> tuple[Run, ...]:
    """The strided copies that assemble selection ``sel`` of a C-order tensor at ``begin``."""
    if sel.axis is None:
        nbytes = math.prod(shape) * itemsize
        return (Run(source, begin, nbytes),) if nbytes else ()
    axis = sel.axis
    outer = math.prod(shape[:axis])
    size = shape[axis]
    inner = math.prod(shape[axis + 1 :]) * itemsize
    piece = sel.length
    runs = []
    offset = 0
    for start, length in sel.ranges:
        if start is not None and length and outer and inner:
            if outer == 1:
                runs.append(
                    Run(source, begin + start * inner, length * inner, 1, 0, offset * inner, 0)
                )
            elif length == size == piece:  # the whole axis: one contiguous block
                runs.append(Run(source, begin, outer * size * inner))
            else:
                runs.append(
                    Run(
                        source,
                        begin + start * inner,
                        length * inner,
                        outer,
                        size * inner,
                        offset * inner,
                        piece * inner,
                    )
                )
        offset += length
    return tuple(runs)


def read_plan_for(validated: ValidatedPlan, ckpt: Checkpoint, rank: int) -> ReadPlan:
    """Worker ``rank``'s read plan (see the module docstring)."""
    return build_read_plans(validated, ckpt, [rank])[0]


def build_read_plans(
    validated: ValidatedPlan, ckpt: Checkpoint, ranks: Iterable[int] | None = None
) -> list[ReadPlan]:
    """The read plans of workers ``ranks`` (default: all), in that order.

    One pass over the parameters gives each its kind (its steps, stored shape and dtype, and
    placement: every layer repeats the same steps on the same shapes) and where its tensor
    lies; these columns are shared by every worker's plan (``Pieces``). What a worker's piece
    of a kind is (its selection, and the runs it makes from the tensor's first byte) is worked
    out once per kind and worker.
    """
    with gc_paused():  # a hundred thousand and more small objects, all kept
        return _build(validated, ckpt, ranks)


def _build(
    validated: ValidatedPlan, ckpt: Checkpoint, ranks: Iterable[int] | None
) -> list[ReadPlan]:
    n = validated.num_shards
    ranks = list(range(n) if ranks is None else ranks)
    params = list(validated)
    index: dict[tuple, int] = {}
    firsts: list = []  # the first parameter of each kind
    kind = array("l")
    for param in params:
        meta = param.meta
        # parameters with the same steps share one tuple of them (``ShardInfo.from_dict``)
        key = (id(param.steps), meta.shape, meta.dtype, param.workers)
        k = index.get(key)
        if k is None:
            k = index[key] = len(firsts)
            firsts.append(param)
        kind.append(k)
    names = [param.meta.name for param in params]
    where = ckpt.locate_all(names)
    source = array("l", map(_first, where))
    begin = array("q", map(_second, where))
    sources = tuple(ckpt.sources())
    plans = []
    for rank in ranks:
        kinds = [_template(validated, param, rank) for param in firsts]
        if None in kinds:  # parameters placed on other workers: this one's alone
            held = [kinds[k] is not None for k in kind]
            pieces = Pieces(
                list(compress(names, held)),
                kinds,
                array("l", compress(kind, held)),
                array("l", compress(source, held)),
                array("q", compress(begin, held)),
            )
        else:
            pieces = Pieces(names, kinds, kind, source, begin)
        plans.append(ReadPlan(rank, n, sources, pieces))
    return plans


_first, _second = itemgetter(0), itemgetter(1)


def _template(validated: ValidatedPlan, param: ParamPlan, rank: int) -> Kind | None:
    """Rank ``rank``'s piece of ``param`` as a ``Kind``; None where it holds none."""
    if not param.held_by(rank):
        return None
    meta = param.meta
    itemsize = dtypes.itemsize(meta.dtype)
    sel = _selection(param, validated.num_shards, rank, validated.plan.source)
    if sel is None:
        chain = Chain(meta.shape, meta.dtype, tuple(tuple(s.to_json()) for s in param.steps), rank)
        return Kind(
            param.piece_shape,
            param.piece_dtype,
            _tails(_runs(Selection.whole(), meta.shape, itemsize, 0, 0)),
            False,
            None,
            chain,
            False,
        )
    step = param.steps[0] if param.steps else None
    func = param.funcs[0] if param.funcs else None
    fixup = None
    if func is not None and step is not None and func.fixup is not None:
        fixup = Fixup(func.name, tuple(step.extra))
    return Kind(
        param.piece_shape,
        param.piece_dtype,
        _tails(_runs(sel, meta.shape, itemsize, 0, 0)),
        sel.has_zeros,
        fixup,
        None,
        param.replicated and param.workers is None,
    )


def _tails(runs: tuple[Run, ...]) -> tuple:
    """Runs from the tensor's first byte as a ``Kind``'s tails."""
    return tuple((run.offset, tuple(run[2:])) for run in runs)
