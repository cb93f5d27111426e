"""A read plan as the loader sends it to a worker process: compact JSON, made and read in a
few passes.

``ReadPlan.to_json`` writes an object per piece and a list per run: at 100,000 tensors that
is millions of JSON values per worker, made, checked, sent and parsed again, which cost a
load on worker processes more than the pieces themselves. A plan's pieces are its columns
(``readplan.Pieces``): a table of kinds of piece (each written as ``PieceRead.to_json``
writes a piece, its runs as their offsets from the tensor's first byte and their other
fields; ``null`` for a kind this worker holds none of), and per piece its name, its kind and
where its tensor lies:

    {"rank": 1, "num_shards": 2, "sources": [...],
     "kinds": [{"shape": [2, 3], "dtype": "float16", "tails": [[6, 6, 4, 12, 0, 6]]}, ...],
     "names": ["w", ...], "kind": [0, ...], "source": [0, ...], "begin": [128, ...]}

``decode(encode(plan)) == plan``, field for field.
"""

from __future__ import annotations

from array import array
from typing import Any

from ..readplan import Kind, PieceRead, Pieces, ReadPlan, sources_from_json

__all__ = ["decode", "encode"]


def encode(plan: ReadPlan) -> dict:
    """``plan`` as compact JSON values (see the module docstring): its columns as lists."""
    pieces = plan.pieces
    return {
        "rank": plan.rank,
        "num_shards": plan.num_shards,
        "sources": [source.to_json() for source in plan.sources],
        "kinds": [_kind_json(kind) for kind in pieces.kinds],
        "names": list(pieces.names),
        "kind": list(pieces.kind),
        "source": list(pieces.source),
        "begin": list(pieces.begin),
    }


def _kind_json(kind: Kind | None) -> dict | None:
    if kind is None:
        return None
    fields = PieceRead(
        "", kind.shape, kind.dtype, (), kind.zeros, kind.fixup, kind.chain, kind.shared
    ).to_json()
    del fields["name"], fields["runs"]
    fields["tails"] = [[offset, *tail] for offset, tail in kind.tails]
    return fields


def decode(data: dict[str, Any]) -> ReadPlan:
    """The ``ReadPlan`` ``encode`` wrote; ``ValueError`` where its parts do not fit together."""
    kinds: list[Kind | None] = []
    for fields in data["kinds"]:
        if fields is None:
            kinds.append(None)
            continue
        tails = tuple((int(t[0]), tuple(map(int, t[1:]))) for t in fields["tails"])
        if any(len(tail) != 5 for _, tail in tails):
            raise ValueError("a read plan's run is not 6 numbers")
        # the kind's fields read as PieceRead.from_json reads a piece's
        piece = PieceRead.from_json({**fields, "name": "", "runs": []})
        kinds.append(
            Kind(
                piece.shape, piece.dtype, tails, piece.zeros, piece.fixup, piece.chain, piece.shared
            )
        )
    names, kind = data["names"], data["kind"]
    try:
        pieces = Pieces(
            names, kinds, array("l", kind), array("l", data["source"]), array("q", data["begin"])
        )
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"a read plan whose columns are not integers: {exc}") from None
    held = {k for k, known in enumerate(kinds) if known is not None}
    if not set(pieces.kind) <= held or not set(map(type, names)) <= {str}:
        raise ValueError(
            f"a read plan of {len(names)} names whose kinds are not among its {len(held)}"
        )
    sources = sources_from_json(data["sources"])
    return ReadPlan(int(data["rank"]), int(data["num_shards"]), sources, pieces)
