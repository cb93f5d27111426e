"""``strict_json``'s plain parse (issue 40): orjson with no hook, a repeated key found
by counting members (``members_match``), and a large object cut into pieces
(``object_pieces``). Each is exact where it answers and declines where it cannot tell; the
precise parse (``loads``) stays the one that says why a text is refused."""

from __future__ import annotations

import json
import random

import pytest

from shardload import strict_json


def _members(value) -> int:
    if isinstance(value, dict):
        return len(value) + sum(map(_members, value.values()))
    if isinstance(value, list):
        return sum(map(_members, value))
    return 0


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def plain(text: str):
    """``loads_plain`` and the member count together: the value, or None."""
    value = strict_json.loads_plain(text)
    if value is None or not strict_json.members_match(
        text, _members(value), lambda: _strings(value)
    ):
        return None
    return value


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "a": 2}',
        '{"a": {"b": 1, "b": 2}}',
        '[{"x": 1}, {"x": 2, "x": 3}]',
        '{"k:": "v:", "k:": 1}',
        '{"a:b": 1}',
        '{"w": {"a": "x:", "b": "y"}, "m": [1, {"z": 2}]}',
        "5",
        '"x:"',
        "[]",
        '{"a": NaN}',
        '{"a": -Infinity}',
        '{"a": 1e400}',
        '{"a": 1.5}',
        '{"\\u0041": 1}',
        '{"a": "\\n"}',
        '{"a": 1} x',
        '{"a": [1, 2,]}',
        "\ufeff{}",
        '{"a": "b:c", "d": {"e:f": ["g:", {"h": "i"}]}}',
        '{"::": {"::": 1, "a": 2}, "b": ":"}',
        '{"a": "\x01"}',
        "[" * 5000 + "]" * 5000,
    ],
)
def test_plain_is_loads_or_declines(text):
    try:
        want = strict_json.loads(text)
    except ValueError:
        assert plain(text) is None
        return
    got = plain(text)
    assert got is None or (got == want and type(got) is type(want))


@pytest.mark.parametrize("depth", [1025, 500_000])
def test_deep_nesting_is_declined_not_a_crash(depth):
    """orjson refuses more than 1,024 levels (pyproject.toml requires a version that does:
    3.9.0 crashed at 500,000, which a 1 MB piece of a hostile header can hold)."""
    assert strict_json.loads_plain("[" * depth + "]" * depth) is None


def test_a_repeated_key_is_found_wherever_colons_hide_it():
    """Colons in strings make the text's count larger; a repeated key makes the parsed
    value's smaller: only both together could balance, and they are told apart."""
    assert plain('{"a:": 1, "b": 2}') == {"a:": 1, "b": 2}
    assert plain('{"a:": 1, "a:": 2}') is None
    assert plain('{"x": "::", "y": {"z": 1, "z": 2}}') is None


@pytest.mark.parametrize(
    "number", ["18446744073709551617", "-9223372036854775809", "99999999999999999999999999"]
)
def test_an_integer_beyond_64_bits_is_a_float_which_a_header_refuses(number):
    """orjson reads such an integer as a float (``loads_plain``'s one difference from the
    precise parse): a header's reader takes ints alone, so the precise reader words the
    refusal."""
    from shardload.readers.safetensors_bulk import parse_header

    assert type(strict_json.loads_plain(f"[{number}]")[0]) is float
    assert strict_json.loads(f"[{number}]") == [int(number)]
    header = f'{{"w": {{"dtype": "U8", "shape": [2], "data_offsets": [0, {number}]}}}}'
    assert parse_header(header, 1 << 62, {}) is None
    assert parse_header(header.replace(number, "2"), 1 << 62, {}) is not None


def _object(rng: random.Random, n: int) -> dict:
    """Members whose names end as a member does ('a},"...'), values nested and holding
    the same."""
    names = ["a},", "b}, ", "c", "e:f", "{}", "g]},", "h"]
    return {
        f"{i}{rng.choice(names)}": ({"v": [i, {"w": "},x"}]} if i % 3 else {"z": i})
        for i in range(n)
    }


@pytest.mark.parametrize("seed", range(5))
def test_pieces_hold_the_members_in_order(seed):
    """Where every piece parses, the pieces' members are the object's, in order; pieces
    that do not are a cut in the wrong place, declined. Large pieces always parse."""
    rng = random.Random(seed)
    value = _object(rng, 60)
    for seps in ((",", ":"), (", ", ": ")):
        text = json.dumps(value, separators=seps)
        assert "\\" not in text
        whole = 0
        for chars in (1, 13, 50, 400, len(text) // 2, len(text)):
            parsed = [strict_json.loads_plain(p) for p in strict_json.object_pieces(text, chars)]
            if all(isinstance(p, dict) for p in parsed):
                assert [kv for p in parsed for kv in p.items()] == list(value.items())
                whole += len(parsed) > 1
        assert whole >= 1  # cut in several pieces, rightly, at least once
        assert list(strict_json.object_pieces(text, len(text))) == [text]


def test_a_wrong_cut_leaves_a_piece_that_does_not_parse():
    # the '},"' in a name is not where a member ends: cut there, the piece stops in a string
    text = json.dumps({"a},": {"x": 1}, "b": {"y": 2}}, separators=(",", ":"))
    pieces = list(strict_json.object_pieces(text, 1))
    assert len(pieces) == 3
    assert strict_json.loads_plain(pieces[0]) is None
    # and a '}' closing a deeper object
    text = json.dumps({"a": {"x": {"y": 1}, "z": 2}}, separators=(",", ":"))
    assert any(strict_json.loads_plain(p) is None for p in strict_json.object_pieces(text, 1))
