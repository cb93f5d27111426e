"""Memory to open a checkpoint is bounded by its header's size (issue 21, part 5).

A safetensors file of a million zero-size tensors has a 60 MB header and no data: inspecting or
loading it once took 3.2 GB, because the parsed JSON, the reader's records and the plan's were
all held at once, as dicts of dicts. The bounds stated in docs/performance.md, checked here in a
fresh process by its peak memory over what the imports took (see ``_CHILD``):

* opening (``open_checkpoint`` and ``metadata()``): at most ``OPEN_FACTOR`` x the header;
* ``shardload validate`` and ``shardload inspect`` (table or ``--json``), which also bind and
  validate a plan and print a row per tensor: at most ``INSPECT_FACTOR`` x the header.

The file is written here (a JSON header and its 8-byte length, no data), and is one the
``safetensors`` library opens too. The million-tensor checks are slow; the 100,000-tensor ones
always run, and fail as surely on the old reader (15x to open, 27x to inspect).
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.subprocesses import subprocess_env

from shardload import open_checkpoint, strict_json

#: peak memory to open a checkpoint, as a multiple of its header's bytes (measured: 4.3x at a
#: million tensors, 4.9x at 100,000)
OPEN_FACTOR = 6
#: peak memory of ``shardload validate`` / ``inspect``, likewise (measured: 5.5x at a million,
#: 6.3x to 7.1x at 100,000)
INSPECT_FACTOR = 8

_ENTRY = '{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'


def write_zero_size_tensors(path: Path, count: int) -> int:
    """A safetensors file of ``count`` empty float32 tensors ``t.0``, ``t.1``, ... (about 60
    header bytes each, the smallest a real writer makes); returns the header's length."""
    header = ("{" + ",".join(f'"t.{i}":{_ENTRY}' for i in range(count)) + "}").encode()
    header += b" " * (-len(header) % 8)  # as the library pads it: the data starts aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
    return len(header)


# Run in a fresh interpreter: the action once on a one-tensor file first, so that every module
# it imports is in the baseline, then on the file measured. The growth is the larger of two
# measures: the peak resident size (ru_maxrss, KiB on Linux) over the baseline's, and, where
# /proc is, the peak of anonymous resident memory, sampled every few milliseconds. The first
# alone can miss: when other processes press on memory, the kernel drops pages of the mapped
# libraries (torch's, hundreds of MB resident) while ours grow, and the total stays flat.
_CHILD = r"""
import contextlib, json, os, resource, sys, threading
import shardload
from shardload.cli import cli

action, small, big, out = sys.argv[1:5]

def run(path):
    if action == "open":
        ckpt = shardload.open_checkpoint(path)
        ckpt.metadata()
        ckpt.close()
        return
    args = action.split(",") + [path]
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        cli.main(args, standalone_mode=False)

def peak():
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

def anon():
    with open("/proc/self/statm") as f:
        resident, shared = map(int, f.read().split()[1:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")

run(small)
sampled = os.path.exists("/proc/self/statm")
base, base_anon = peak(), anon() if sampled else 0
most = [base_anon]
done = threading.Event()

def sample():
    while not done.wait(0.002):
        most[0] = max(most[0], anon())

sampler = threading.Thread(target=sample, daemon=True)
if sampled:
    sampler.start()
run(big)
done.set()
if sampled:
    sampler.join()
    most[0] = max(most[0], anon())
with open(out, "w") as f:
    json.dump({"rss": peak() - base, "anon": most[0] - base_anon}, f)
"""


def _growth(tmp_path: Path, action: str, big: Path) -> int:
    small = tmp_path / "one.safetensors"
    if not small.exists():
        write_zero_size_tensors(small, 1)
    out = tmp_path / f"{action.replace(',', '_')}.json"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, action, str(small), str(big), str(out)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    measured = json.loads(out.read_text())
    return max(measured["rss"], measured["anon"])


@pytest.fixture(scope="module")
def tensors_100k(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("header") / "100k.safetensors"
    return path, write_zero_size_tensors(path, 100_000)


@pytest.fixture(scope="module")
def tensors_1m(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("header") / "1m.safetensors"
    return path, write_zero_size_tensors(path, 1_000_000)


_ACTIONS = [
    ("open", OPEN_FACTOR),
    ("validate,--replicate,--shards,2", INSPECT_FACTOR),
    ("inspect,--replicate,--shards,2", INSPECT_FACTOR),
    ("inspect,--replicate,--shards,2,--json", INSPECT_FACTOR),
]


def _check(tmp_path: Path, action: str, factor: int, path: Path, header: int) -> None:
    growth = _growth(tmp_path, action, path)
    assert growth <= factor * header, (
        f"{action}: peak memory grew {growth / 1e6:.0f} MB for a {header / 1e6:.0f} MB header "
        f"({growth / header:.1f}x); the stated bound is {factor}x"
    )


def test_the_file_is_valid_safetensors(tmp_path):
    """What is measured is a checkpoint the safetensors library opens, not a quirk of ours."""
    safetensors = pytest.importorskip("safetensors")
    path = tmp_path / "some.safetensors"
    write_zero_size_tensors(path, 1000)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert len(list(f.keys())) == 1000
        assert f.get_tensor("t.999").shape == (0,)
    with open_checkpoint(path) as ckpt:
        assert len(ckpt) == 1000
        assert ckpt.meta("t.999").shape == (0,)


@pytest.mark.parametrize("action, factor", _ACTIONS[:1] + _ACTIONS[2:3], ids=["open", "inspect"])
def test_100k_tensors(tmp_path, tensors_100k, action, factor):
    _check(tmp_path, action, factor, *tensors_100k)


@pytest.mark.slow
@pytest.mark.parametrize(
    "action, factor",
    [
        pytest.param(*_ACTIONS[0], id="open"),
        # the 100k file checks inspect's bound by default; the million under -m extended
        pytest.param(*_ACTIONS[2], id="inspect", marks=pytest.mark.extended),
        pytest.param(*_ACTIONS[3], id="inspect-json", marks=pytest.mark.extended),
    ],
)
def test_1m_tensors(tmp_path, tensors_1m, action, factor):
    """The issue's file: a million empty tensors, a 60 MB header (``validate`` is the part
    of ``inspect`` before its rows)."""
    _check(tmp_path, action, factor, *tensors_1m)


# -- what the bound rests on: a parse member by member, as strict as the whole one ---------------

_MALFORMED = [
    '{"a" 1}',
    '{"a":1 "b":2}',
    '{"a":1,}',
    '{"a":1} x',
    "{",
    '{"a":',
    "{ x",
    '{"a":1,"b"',
    '{"a',
    '{"a":1,,}',
    '{"a": [1, }',
    '{"a": tru}',
    '{"a": "\x01"}',
    '{"a": 1 , }',
]


@pytest.mark.parametrize("text", _MALFORMED)
def test_loads_object_refuses_as_json_does(text):
    """The same message, position included, as ``json.loads`` for the same text."""
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as ours:
        strict_json.loads_object(text, lambda key, value: value)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "text, phrase",
    [
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"a": {"b": 1, "b": 2}}', "duplicate key 'b'"),
        ('{"a": NaN}', "NaN is not valid JSON"),
        ('{"a": [1e400]}', "out of the float64 range"),
        ('{"\\ud800": 1}', "lone UTF-16 surrogate"),
        ('{"a": ["\\udc00"]}', "lone UTF-16 surrogate"),
        ('{"a": ' + "[" * 100_000 + "}", "nested too deeply"),
        ("\ufeff{}", "byte order mark"),
    ],
)
def test_loads_object_is_as_strict_as_loads(text, phrase):
    for parse in (strict_json.loads, lambda t: strict_json.loads_object(t, lambda k, v: v)):
        with pytest.raises(ValueError, match=phrase):
            parse(text)


def test_loads_object_keeps_what_convert_returns_in_order():
    text = ' { "b" : [1, 2] ,\n"a": {"x": "\\u00e9"}, "c": [] } '
    assert list(strict_json.loads_object(text, lambda k, v: (k, v)).items()) == [
        ("b", ("b", [1, 2])),
        ("a", ("a", {"x": "é"})),
        ("c", ("c", [])),
    ]
    assert strict_json.loads_object("{}", lambda k, v: v) == {}


@pytest.mark.parametrize(
    "text, type_name",
    [
        ("[1, 2]", "list"),
        ("7", "int"),
        ('"s"', "str"),
        ("null", "NoneType"),
        ("[" + "[]," * 500_000 + "[]]", "list"),
    ],
)
def test_loads_object_names_what_is_not_an_object(text, type_name):
    """Past 1 MiB, by its first character, without building it (a list of half a million
    lists would take 40 MB)."""
    with pytest.raises(strict_json.NotAnObjectError) as info:
        strict_json.loads_object(text, lambda k, v: v)
    assert info.value.type_name == type_name


def test_storage_order_from_any_header_order(tmp_path):
    """Offsets live in arrays and are sorted there (numpy): the tensors still come back by
    (begin, end), ties in header order, as the dict of tuples they replaced gave them."""
    entries = [(f"e{i}", [0], i, i) for i in range(0, 600, 3)]  # empty ones, tied with...
    entries += [(f"b{i}", [1], i, i + 1) for i in range(600)]  # ...one-byte ones
    random.Random(5).shuffle(entries)
    header = {
        name: {"dtype": "U8", "shape": shape, "data_offsets": [begin, end]}
        for name, shape, begin, end in entries
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "shuffled.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * 2 + bytes(88))
    want = [name for name, *_ in sorted(entries, key=lambda e: (e[2], e[3]))]
    with open_checkpoint(path) as ckpt:
        assert list(ckpt.metadata()) == want
        assert ckpt.read("b300").item() == 300 % 256
        assert ckpt.locate("b599")[1:] == (8 + len(raw) + 599, 8 + len(raw) + 600)
