"""A safetensors header checked in bulk: every rule of ``safetensors._entry_reader``, at C speed.

Opening DeepSeek-V3 (91,991 tensors in 139 files) once took 0.8 s, most of it Python code run
for every tensor: a member-by-member parse with a hook per object, then a dozen checks. Here a
header is parsed by orjson with no hook (``strict_json.loads_plain``; a repeated key is found
by counting members, ``strict_json.members_match``), in pieces of about
``PIECE_CHARS`` (``strict_json.object_pieces``), and each piece's entries are checked together:
a rule is one pass of builtins over a list (``set(map(type, ...))``, ``map(sub, ends,
begins)``), not Python statements per entry, and each distinct shape is checked once.

This is only the fast way through. It answers ``None`` for anything it does not accept, and the
entry-by-entry reader then refuses the header with the reason, or accepts what this one would
not (a ``\\u`` escape in a name, a header out of storage order). So it may be stricter than the
rules, never looser, and never words an error itself.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Iterator
from math import prod
from operator import itemgetter, mul, sub

from .. import dtypes, strict_json
from ..limits import MAX_DIM, MAX_NDIM
from .base import TensorMeta

__all__ = ["PIECE_CHARS", "SHAPES_KEPT", "parse_header"]

#: a header is parsed a piece of about this many characters at a time: the parsed JSON of a
#: piece takes about 8 times its text, which must stay small beside the text itself
#: (docs/performance.md: opening takes at most 6x a header's bytes)
PIECE_CHARS = 1 << 17
#: a piece longer than this (no place to cut it: one enormous entry) goes to the exact reader,
#: which parses member by member
MOST_CHARS = 1 << 20

_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_ITEMSIZE = {code: dtypes.itemsize(name) for code, name in dtypes.SAFETENSORS.items()}
_CANONICAL = dict(dtypes.SAFETENSORS)
_LARGEST_ITEM = max(_ITEMSIZE.values())
_LIST, _STR, _INT = {list}, {str}, {int}
#: shapes kept once per distinct shape across a checkpoint's files; a header of more distinct
#: ones than this empties it now and then rather than let it grow
SHAPES_KEPT = 4096

Header = tuple[dict, dict[str, TensorMeta], array, array]


def parse_header(
    text: str, data_len: int, shapes: dict[tuple[int, ...], tuple[int, ...]]
) -> Header | None:
    """``(__metadata__, tensors by name in header order, begins, ends)`` of a header that
    keeps every rule, its ``__metadata__`` an object of strings (``{}`` if it has none); or
    ``None``. ``shapes`` shares equal shape tuples between the files of a checkpoint."""
    if "true" in text or "false" in text:
        return None  # a JSON boolean is an int to arithmetic and to ==: see _entries
    metadata: dict | None = None
    tensors: dict[str, TensorMeta] = {}
    begins, ends = array("q"), array("q")
    for piece in strict_json.object_pieces(text, PIECE_CHARS):
        if len(piece) > MOST_CHARS:
            return None
        obj = strict_json.loads_plain(piece)
        if type(obj) is not dict:
            return None
        members, here = len(obj), None  # here: this piece's __metadata__
        if "__metadata__" in obj:
            if metadata is not None:
                return None  # a second __metadata__
            metadata = here = obj.pop("__metadata__")
            if type(here) is not dict or not set(map(type, here.values())) <= _STR:
                return None
            members += len(here)
        entries = _entries(obj, data_len, shapes)
        if entries is None:
            return None
        members += 3 * len(obj)
        if not strict_json.members_match(piece, members, functools.partial(_strings, obj, here)):
            return None  # a key repeated in the piece
        had = len(tensors)
        tensors.update(zip(obj, TensorMeta.many(obj, entries[0], entries[1])))
        if len(tensors) != had + len(obj):
            return None  # a name repeated in another piece
        begins += entries[2]
        ends += entries[3]
    return metadata or {}, tensors, begins, ends


def _strings(obj: dict, metadata: dict | None) -> Iterator[str]:
    """The strings of a piece whose entries passed ``_entries``: names, and its
    ``__metadata__``'s (an entry's keys and dtype hold no colon)."""
    yield from obj
    if metadata:
        yield from metadata
        yield from metadata.values()


def _entries(obj: dict, data_len: int, shapes: dict) -> tuple[list, list, array, array] | None:
    """The entries of one piece (``__metadata__`` taken out) checked, each rule a pass over
    them all: ``(shape tuples, canonical dtypes, begins, ends)``; ``None``
    unless every entry keeps every rule of ``safetensors._entry_reader``. (No value in the
    piece is NaN or a boolean: ``parse_header`` let none through; a float is refused here.)"""
    if not obj:
        return [], [], array("q"), array("q")
    if "" in obj:
        return None
    values = list(obj.values())
    try:
        # A value that is not a dict, or lacks a field, fails a getter; three fields and the
        # right three are exactly the right keys.
        if set(map(len, values)) != {3}:
            return None
        dts = list(map(_DTYPE, values))
        shape_lists = list(map(_SHAPE, values))
        offsets = list(map(_OFFSETS, values))
        if not set(dts) <= _ITEMSIZE.keys():  # (an unhashable dtype raises TypeError)
            return None
        if set(map(type, shape_lists)) != _LIST or set(map(len, offsets)) != {2}:
            return None
        begins, ends = zip(*offsets)
        # ints alone: not a float (a number beyond 64 bits is one: strict_json.loads_plain)
        if set(map(type, begins)) | set(map(type, ends)) != _INT:
            return None
        sizes = list(map(sub, ends, begins))
        tuples = list(map(tuple, shape_lists))
        # each distinct shape checked once (a shape holding a list is unhashable: TypeError)
        numel_of = {shape: _numel(shape) for shape in dict.fromkeys(tuples)}
    except (TypeError, KeyError):
        return None
    if None in numel_of.values():
        return None
    numels = list(map(numel_of.__getitem__, tuples))
    # end - begin is exactly the bytes of the shape and dtype: so begin <= end too
    if sizes != list(map(mul, numels, map(_ITEMSIZE.__getitem__, dts))):
        return None
    if min(begins) < 0 or max(ends) > data_len:
        return None
    if len(shapes) >= SHAPES_KEPT:
        shapes.clear()
    shared = {shape: shapes.setdefault(shape, shape) for shape in numel_of}
    return (
        list(map(shared.__getitem__, tuples)),
        list(map(_CANONICAL.__getitem__, dts)),
        array("q", begins),
        array("q", ends),
    )


def _numel(shape: tuple) -> int | None:
    """The elements of a shape that keeps the rules (ints from 0 to ``MAX_DIM``, at most
    ``MAX_NDIM`` of them, and an empty one's other dims within 64-bit strides), else None."""
    if len(shape) > MAX_NDIM:
        return None
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            return None
    numel = prod(shape)
    if numel == 0 and len(shape) > 1 and dtypes.shape_problem(shape, _LARGEST_ITEM):
        return None
    return numel
