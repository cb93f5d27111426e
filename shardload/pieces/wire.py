"""A read plan as the loader sends it to a worker process: compact JSON, made and read in a
few passes.

``ReadPlan.to_json`` writes an object per piece and a list per run: at 100,000 tensors that
is millions of JSON values per worker, made, checked, sent and parsed again, which cost a
load on worker processes more than the pieces themselves. But a plan's pieces are few kinds
repeated (every layer alike): a piece's kind is everything but its name and where its runs
start. So the plan travels as its kinds (each written as ``PieceRead.to_json`` writes a
piece, its runs given as their fields after ``(source, offset)``), then per piece its name,
its kind, and each run's ``(source, offset)``, in flat lists:

    {"rank": 1, "num_shards": 2, "sources": [...],
     "kinds": [{"shape": [2, 3], "dtype": "float16", "tails": [[6, 4, 12, 0, 6]]}, ...],
     "names": ["w", ...], "kind": [0, ...], "at": [0, 6, ...]}

``decode(encode(plan)) == plan``, field for field.
"""

from __future__ import annotations

from itertools import chain as chained
from functools import partial
from operator import itemgetter
from typing import Any

from ..readplan import PieceRead, ReadPlan, Run

__all__ = ["encode", "decode"]

_tail = itemgetter(slice(2, None))   # a run's fields after (source, offset)
_at = itemgetter(0, 1)               # a run's (source, offset)
_name, _runs = itemgetter(0), itemgetter(3)
_head = itemgetter(1, 2, 4, 7)       # shape, dtype, zeros, shared
_fixup, _chain = itemgetter(5), itemgetter(6)
_first = itemgetter(0)


def encode(plan: ReadPlan) -> dict:
    """``plan`` as compact JSON values (see the module docstring). Made in passes that run in
    C (``map``, ``zip``, ``dict``), not a Python loop per piece."""
    pieces = plan.pieces
    runs = list(map(_runs, pieces))
    # a piece's kind: a fixup or chain is shared by the pieces made from one template, so it
    # is told apart by identity (a chain's steps hold lists, which do not hash); every piece
    # is alive while the plan is, so no identity is reused meanwhile
    if runs and min(map(len, runs)) == max(map(len, runs)) == 1:  # most plans: one run each
        tails = zip(map(_tail, map(_first, runs)))  # zip of one: each tail in a 1-tuple
    else:
        tails = map(tuple, map(partial(map, _tail), runs))
    keys = list(zip(map(_head, pieces), map(id, map(_fixup, pieces)),
                    map(id, map(_chain, pieces)), tails))
    first = dict(zip(reversed(keys), reversed(pieces)))  # a piece of each kind: its first
    number = {key: k for k, key in enumerate(first)}
    table = []
    for key, piece in first.items():
        fields = piece.to_json()
        del fields["name"], fields["runs"]
        fields["tails"] = [list(t) for t in key[3]]
        table.append(fields)
    return {"rank": plan.rank, "num_shards": plan.num_shards, "sources": list(plan.sources),
            "kinds": table, "names": list(map(_name, pieces)),
            "kind": list(map(number.__getitem__, keys)),
            "at": list(chained.from_iterable(map(_at, chained.from_iterable(runs))))}


def decode(data: dict[str, Any]) -> ReadPlan:
    """The ``ReadPlan`` ``encode`` wrote; ``ValueError`` where its parts do not fit together."""
    templates = []
    for fields in data["kinds"]:
        tails = [tuple(t) for t in fields["tails"]]
        # the kind's fields read as PieceRead.from_json reads a piece's
        piece = PieceRead.from_json({**fields, "name": "", "runs": [(0, 0, *t) for t in tails]})
        templates.append((piece.shape, piece.dtype, tails, piece[4:]))
    names, kinds, at = data["names"], data["kind"], data["at"]
    if len(names) != len(kinds) or kinds and not 0 <= min(kinds) <= max(kinds) < len(templates):
        raise ValueError(f"a read plan of {len(names)} names and {len(kinds)} kinds, of "
                         f"{len(templates)}")
    new = tuple.__new__
    pieces = []
    k = 0
    try:
        for name, index in zip(names, kinds):
            shape, dtype, tails, after = templates[index]
            if len(tails) == 1:  # most pieces: one run
                runs: tuple = (new(Run, (at[k], at[k + 1]) + tails[0]),)
                k += 2
            else:
                runs = tuple([new(Run, (at[k + 2 * r], at[k + 2 * r + 1]) + tail)
                              for r, tail in enumerate(tails)])
                k += 2 * len(tails)
            pieces.append(new(PieceRead, (name, shape, dtype, runs) + after))
    except (IndexError, TypeError) as exc:
        raise ValueError(f"a read plan whose pieces and runs do not fit together: "
                         f"{exc}") from None
    if k != len(at):
        raise ValueError(f"a read plan with {len(at) - k} numbers left over after its runs")
    return ReadPlan(int(data["rank"]), int(data["num_shards"]), tuple(data["sources"]),
                    tuple(pieces))
