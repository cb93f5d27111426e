"""The bulk header check (``readers.safetensors_bulk``, issue 40) is a faster way to the same
answer, never a looser one.

For every header text here, crafted or fuzzed, the bulk check either declines (``None``: the
entry-by-entry reader then decides and words any refusal) or returns exactly what the
entry-by-entry reader returns; and where that reader refuses, the bulk check declines. The
crafted valid headers must also be accepted by the bulk check, so that it is the way actually
taken. Speed is measured in ``benchmarks`` (``shardbench.scale``), not here.
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest

from shardload import open_checkpoint, strict_json
from shardload.errors import FormatError
from shardload.readers import safetensors as st
from shardload.readers import safetensors_bulk as bulk
from shardload.readers.base import TensorMeta

_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I64": 8, "F8_E4M3": 1, "BOOL": 1}


def _header(
    specs: list[tuple[str, str, list[int]]], metadata=None, *, order=None, compact: bool = True
) -> tuple[str, int]:
    """A header text for ``(name, dtype, shape)`` specs laid out back to back, and its data
    length."""
    entries, offset = {}, 0
    for name, dtype, shape in specs:
        n = _ITEM[dtype]
        for d in shape:
            n *= d
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    if order is not None:
        entries = {k: entries[k] for k in order}
    if metadata is not None:
        entries = {"__metadata__": metadata, **entries}
    seps = (",", ":") if compact else (", ", ": ")
    return json.dumps(entries, separators=seps, ensure_ascii=False), offset


def _exact(text: str, data_len: int):
    """What the entry-by-entry reader makes of ``text``, or the ``FormatError`` it raises."""
    begins, ends = st.array("q"), st.array("q")
    try:
        tensors = strict_json.loads_object(
            text, st._entry_reader(Path("h.safetensors"), data_len, begins, ends, {})
        )
    except strict_json.NotAnObjectError:
        return FormatError("not an object")
    except (ValueError, FormatError) as exc:
        return exc if isinstance(exc, FormatError) else FormatError(str(exc))
    metadata = tensors.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        return FormatError("metadata")
    return metadata, list(tensors.items()), list(begins), list(ends)


def _agree(text: str, data_len: int) -> bool:
    """Assert the bulk check agrees with the exact reader on ``text``; True if it accepted."""
    fast = bulk.parse_header(text, data_len, {})
    exact = _exact(text, data_len)
    if isinstance(exact, FormatError):
        assert fast is None, f"bulk accepted what the reader refuses ({exact}): {text!r}"
        return False
    if fast is None:
        return False
    metadata, tensors, begins, ends = fast
    assert (metadata, list(tensors.items()), list(begins), list(ends)) == exact, text
    return True


SPECS = [
    ("model.embed.weight", "BF16", [16, 8]),
    ("layers.0.w", "F8_E4M3", [8, 16]),
    ("layers.0.w_scale", "F32", [1]),
    ("layers.0.empty", "F16", [0, 4]),
    ("scalar", "I64", []),
    ("mask", "BOOL", [3, 1, 2]),
    ("layers.1.w", "U8", [5]),
]
VALID = {
    "compact": _header(SPECS),
    "spaced": _header(SPECS, compact=False),
    "metadata": _header(SPECS, {"format": "pt", "note": "a: b, c"}),
    "metadata last": (lambda t: (t[0][:-1] + ',"__metadata__":{"format":"pt"}}', t[1]))(
        _header(SPECS)
    ),
    "empty metadata": _header(SPECS, {}),
    "no tensors": ('{"__metadata__":{"format":"pt"}}', 0),
    "empty object": ("{}", 0),
    "padded": (_header(SPECS)[0] + "    ", _header(SPECS)[1]),
    "colon in a name": _header([("a:b", "F32", [2]), ("c::d", "U8", [1])]),
    # a name ending in '},' looks like where a member ends: '"a},":...'
    "cut trap in a name": _header(
        [("a},", "F32", [2]), ("b}, ", "U8", [3]), ("x" * 40, "F16", [1]), ("c},", "F32", [1])]
    ),
    "not ASCII": _header([("gewicht.ä", "F32", [1]), ("权重", "U8", [2])]),
    "zero dims": _header([("z", "F32", [0]), ("zz", "U8", [0, 0, 7])]),
    "many": _header([(f"t.{i}", "F16", [i % 7, 3]) for i in range(3000)]),
}


@pytest.mark.parametrize("name", VALID)
def test_valid_headers_are_taken_the_fast_way(name):
    text, data_len = VALID[name]
    assert _agree(text, data_len), "the bulk check declined a valid header"


@pytest.mark.parametrize("name", VALID)
def test_valid_headers_cut_in_small_pieces(monkeypatch, name):
    """Pieces far smaller than a real one: every cut, right or wrong (a ``},"`` in a name),
    is exercised."""
    text, data_len = VALID[name]
    for chars in (1, 7, 40, 200):
        monkeypatch.setattr(bulk, "PIECE_CHARS", chars)
        _agree(text, data_len)
    monkeypatch.setattr(bulk, "PIECE_CHARS", 40)
    if "trap" not in name and "no tensors" not in name:
        assert _agree(text, data_len)


def _entry_text(dtype="F32", shape="[2]", offsets="[0,8]", extra=""):
    return f'{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}{extra}}}'


E = _entry_text()
REFUSED = {
    "duplicate name": '{"a":%s,"a":%s}' % (E, E),
    # (416 bytes of data: in pieces of 30 characters, the two are in different pieces)
    "duplicate name, far apart": (
        "{"
        + ",".join(
            [f'"a":{_entry_text(offsets="[0,8]")}']
            + [f'"t{i}":{_entry_text(offsets=f"[{8 + 8 * i},{16 + 8 * i}]")}' for i in range(50)]
            + [f'"a":{_entry_text(offsets="[408,416]")}']
        )
        + "}",
        416,
    ),
    "duplicate field": '{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "duplicate metadata key": '{"__metadata__":{"k":"v","k":"w"},"a":%s}' % E,
    "duplicate metadata": '{"__metadata__":{},"a":%s,"__metadata__":{}}' % E,
    "duplicate and a colon": '{"__metadata__":{"k:":"v:"},"a":%s,"a":%s}' % (E, E),
    "float dim": '{"a":%s}' % _entry_text(shape="[2.0]"),
    "exponent dim": '{"a":%s}' % _entry_text(shape="[2e0]"),
    "bool dim": '{"a":%s,"b":%s}'
    % (_entry_text(shape="[1]", offsets="[0,4]"), _entry_text(shape="[true]", offsets="[4,8]")),
    "bool offset": '{"a":%s}' % _entry_text(shape="[1]", offsets="[false,4]"),
    "null dim": '{"a":%s}' % _entry_text(shape="[null]"),
    "string dim": '{"a":%s}' % _entry_text(shape='["2"]'),
    "nested dim": '{"a":%s}' % _entry_text(shape="[[2]]"),
    "negative dim": '{"a":%s}' % _entry_text(shape="[-2]"),
    "dim past 2**53": '{"a":%s}' % _entry_text(shape=f"[{2**53 + 1}]", offsets="[0,0]"),
    "65 dims": '{"a":%s}' % _entry_text(shape="[" + ",".join(["1"] * 65) + "]", offsets="[0,4]"),
    "empty but overflowing": '{"a":%s}'
    % _entry_text(shape=f"[0,{2**40},{2**30}]", offsets="[0,0]"),
    "shape a string": '{"a":%s}' % _entry_text(shape='""', offsets="[0,4]"),
    "shape an object": '{"a":%s}' % _entry_text(shape="{}", offsets="[0,4]"),
    "offsets a string": '{"a":%s}' % _entry_text(offsets='"08"'),
    "offsets of three": '{"a":%s}' % _entry_text(offsets="[0,8,8]"),
    "offsets backwards": '{"a":%s}' % _entry_text(shape="[0]", offsets="[8,0]"),
    "negative offset": '{"a":%s}' % _entry_text(shape="[0]", offsets="[-1,-1]"),
    "size lies": '{"a":%s}' % _entry_text(offsets="[0,9]"),
    "past the end": '{"a":%s}' % _entry_text(offsets="[8,16]"),
    "unknown dtype": '{"a":%s}' % _entry_text(dtype="F12"),
    "dtype a list": '{"a":{"dtype":["F32"],"shape":[2],"data_offsets":[0,8]}}',
    "extra field": '{"a":%s}' % _entry_text(extra=',"x":1'),
    "missing field": '{"a":{"dtype":"F32","shape":[2]}}',
    "three wrong fields": '{"a":{"dtype":"F32","shape":[2],"offsets":[0,8]}}',
    "entry a list": '{"a":["F32",[2],[0,8]]}',
    "entry a string": '{"a":"abc"}',
    "entry a number": '{"a":3}',
    "empty name": '{"":%s}' % E,
    "NaN": '{"a":%s}' % _entry_text(shape="[NaN]"),
    "huge number": '{"a":%s}' % _entry_text(shape="[1e400]"),
    "lone surrogate": '{"\\ud800":%s}' % E,
    "metadata not strings": '{"__metadata__":{"k":1},"a":%s}' % E,
    "metadata null": '{"__metadata__":null,"a":%s}' % E,
    "not an object": "[1, 2]",
    "trailing data": '{"a":%s} x' % E,
    "bom": '\ufeff{"a":%s}' % E,
    "unterminated": '{"a":%s' % E,
    "control character": '{"a\x01":%s}' % E,
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_reader_refuses_the_bulk_check_declines(monkeypatch, name):
    text, data_len = REFUSED[name] if isinstance(REFUSED[name], tuple) else (REFUSED[name], 8)
    assert isinstance(_exact(text, data_len), FormatError)
    for chars in (bulk.PIECE_CHARS, 30):
        monkeypatch.setattr(bulk, "PIECE_CHARS", chars)
        assert bulk.parse_header(text, data_len, {}) is None


_ALPHABET = '{}[]:,"0129-.eEtrufalsn \\\x01'
_MEMBER = re.compile(r'"[^"\\]*":\{[^{}]*\}')


def _mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.25:  # a member copied elsewhere: a repeated key
            members = _MEMBER.findall(text)
            if members:
                at = rng.choice([m.end() for m in re.finditer(r"\},", text)] or [1])
                text = text[:at] + rng.choice(members) + "," + text[at:]
                continue
        i = rng.randrange(len(text) + 1)
        if kind < 0.6:
            text = text[:i] + rng.choice(_ALPHABET) + text[i + 1 :]
        elif kind < 0.8:
            text = text[:i] + rng.choice(_ALPHABET) + text[i:]
        else:
            text = text[:i] + text[i + rng.randint(1, 4) :]
    return text


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_headers_agree(monkeypatch, seed):
    """Thousands of small edits of valid headers (a character changed, added or dropped, a
    member repeated), in pieces large and small: the bulk check never accepts what the reader
    refuses, and what it accepts it reads the same."""
    rng = random.Random(seed)
    bases = [
        VALID[k]
        for k in (
            "compact",
            "spaced",
            "metadata",
            "colon in a name",
            "cut trap in a name",
            "zero dims",
        )
    ]
    accepted = 0
    for _ in range(600):
        text, data_len = rng.choice(bases)
        monkeypatch.setattr(bulk, "PIECE_CHARS", rng.choice([16, 64, 1 << 17]))
        accepted += _agree(_mutate(text, rng), data_len)
    assert accepted  # some edits keep the header valid (a digit for a digit in a name)


def test_a_checkpoint_opens_the_same_either_way(tmp_path, monkeypatch):
    """A sharded checkpoint (index, several files, metadata, a file out of storage order)
    opened through the bulk check and through the entry-by-entry reader: the same tensors,
    byte ranges and metadata."""
    weight_map = {}
    for k in range(4):
        specs = [(f"layers.{k}.{j}.w", "F16", [k + 1, j + 2]) for j in range(30)]
        text, data_len = _header(
            specs,
            {"format": "pt", "shard": str(k)},
            order=[s[0] for s in reversed(specs)] if k == 2 else None,
        )
        raw = text.encode()
        name = f"model-{k:05d}-of-00004.safetensors"
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
        weight_map.update((s[0], name) for s in specs)
    (tmp_path / st.INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
    )

    def opened():
        with open_checkpoint(tmp_path) as ckpt:
            return (
                list(ckpt.metadata().items()),
                [ckpt.locate(n) for n in ckpt.metadata()],
                ckpt.file_metadata,
                ckpt.index_metadata,
            )

    fast = opened()
    monkeypatch.setattr(st, "parse_header", lambda *args: None)
    assert opened() == fast
    assert len(fast[0]) == 120


def test_an_index_that_lies_is_still_named(tmp_path):
    """The index is checked against each file by counting (in C); where the count is off the
    message names the tensor, as before."""
    text, data_len = _header([("a", "F32", [1]), ("b", "F32", [1])])
    raw = text.encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    (tmp_path / st.INDEX_NAME).write_text(
        json.dumps({"weight_map": {"a": "m.safetensors", "c": "m.safetensors"}})
    )
    with pytest.raises(FormatError, match="puts this tensor in 'm.safetensors'") as info:
        open_checkpoint(tmp_path)
    assert info.value.tensor == "c"
    (tmp_path / st.INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "m.safetensors"}}))
    with pytest.raises(FormatError, match="does not list it") as info:
        open_checkpoint(tmp_path)
    assert info.value.tensor == "b"


def test_tensor_meta_many_is_the_constructor():
    made = TensorMeta.many(["a", "b"], [(2, 3), ()], ["float16", "int8"])
    assert made == [TensorMeta("a", (2, 3), "float16"), TensorMeta("b", (), "int8")]
    assert hash(made[0]) == hash(TensorMeta("a", (2, 3), "float16"))
    with pytest.raises(AttributeError):  # still frozen (FrozenInstanceError)
        made[0].name = "c"
