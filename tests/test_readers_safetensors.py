"""The safetensors reader, checked against the safetensors library as the independent reference.

Good files are written by ``safetensors.torch.save_file``; bad ones byte by byte with ``raw_file``.
For every bad file we also record what the library does with it, so that any place where we are
stricter than the library is a decision written down here, not an accident.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import threading
import warnings
from pathlib import Path

import pytest
import torch
from helpers.reader_checks import check_close_while_a_read_is_in_flight, narrow_cases, same
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from shardload.errors import FormatError
from shardload.readers.base import TensorMeta
from shardload.readers.safetensors import INDEX_NAME, SafetensorsCheckpoint, open_safetensors

# ----------------------------------------------------------------------------------------------
# helpers


def raw_file(
    path: Path,
    header: dict | None = None,
    data: bytes = b"",
    *,
    header_bytes: bytes | None = None,
    length: int | None = None,
) -> Path:
    """A safetensors file made by hand: the u64 length, the header JSON, the data buffer.

    ``header_bytes`` replaces the JSON text, ``length`` the length field (to make it lie).
    """
    text = header_bytes if header_bytes is not None else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


def f32(shape: list, begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def library_loads(path: Path) -> bool:
    try:
        load_file(str(path))
    except Exception:  # noqa: BLE001 - the library raises its own SafetensorError
        return False
    return True


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    return {
        "f16": r(3, 5).half(),
        "bf16": r(4, 2, 3).bfloat16(),
        "f32_3d": r(2, 3, 4),
        "f32_scalar": torch.tensor(1.5),
        "f32_empty": torch.empty(0, 3),
        "f64": r(5).double(),
        "i8": torch.randint(-128, 128, (7,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 256, (2, 9), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-1000, 1000, (3,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=g),
        "i64_scalar": torch.tensor(-(2**40), dtype=torch.int64),
        "i64": torch.randint(-(2**62), 2**62, (3, 1, 2), dtype=torch.int64, generator=g),
        "u32": torch.randint(0, 2**31, (5,), dtype=torch.int64, generator=g).to(torch.uint32),
        "fp8": r(6, 2).to(torch.float8_e4m3fn),
        "fp8_e5m2": r(3).to(torch.float8_e5m2),
        "bool": r(2, 5) > 0,
        "bool_empty": torch.empty(2, 0, dtype=torch.bool),
    }


@pytest.fixture
def sample_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(sample_tensors(), str(path), metadata={"format": "pt", "quant": "q4f16_1"})
    return path


# ----------------------------------------------------------------------------------------------
# good files


def test_round_trip_against_library(sample_file: Path) -> None:
    expected = load_file(str(sample_file))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable buffer" warning
        with open_safetensors(sample_file) as ckpt:
            assert isinstance(ckpt, SafetensorsCheckpoint)
            assert ckpt.source == str(sample_file)
            assert set(ckpt.names()) == set(expected)
            for name, want in expected.items():
                got = ckpt.read(name)
                assert same(got, want), name
                assert got.is_contiguous() and got.device.type == "cpu"
                assert ckpt.meta(name) == TensorMeta(
                    name, tuple(want.shape), str(want.dtype).removeprefix("torch.")
                )
            assert ckpt.bytes_read == sum(t.numel() * t.element_size() for t in expected.values())
            assert ckpt.file_metadata == {str(sample_file): {"format": "pt", "quant": "q4f16_1"}}
            assert ckpt.index_metadata == {}


def test_metadata_in_storage_order_and_locate(tmp_path: Path) -> None:
    # header order b, a; storage order a, b
    path = raw_file(
        tmp_path / "m.safetensors",
        {"b": f32([1], 8, 12), "a": f32([2], 0, 8)},
        struct.pack("<3f", 1, 2, 3),
    )
    with open_safetensors(path) as ckpt:
        assert list(ckpt.metadata()) == ["a", "b"]
        _, start, end = ckpt.locate("b")
        assert path.read_bytes()[start:end] == struct.pack("<f", 3)
        with pytest.raises(KeyError, match="no tensor named"):
            ckpt.read("c")


def test_unaligned_offsets(tmp_path: Path) -> None:
    # a 3-byte tensor first puts the float32 and int64 ones at odd offsets
    data = bytes([1, 2, 3]) + struct.pack("<2f", 0.5, -2.0) + struct.pack("<q", -7)
    header = {
        "u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "f": f32([2], 3, 11),
        "i": {"dtype": "I64", "shape": [], "data_offsets": [11, 19]},
    }
    path = raw_file(tmp_path / "odd.safetensors", header, data)
    expected = load_file(str(path))
    with open_safetensors(path) as ckpt:
        for name in header:
            assert same(ckpt.read(name), expected[name])
        assert ckpt.read("f").tolist() == [0.5, -2.0]
        assert same(ckpt.read_narrow("f", 0, 1, 1), torch.tensor([-2.0]))


def test_zero_size_tensors_share_offsets(tmp_path: Path) -> None:
    header = {
        "e1": f32([0], 0, 0),
        "e2": f32([0, 5], 0, 0),
        "x": f32([1], 0, 4),
        "e3": f32([3, 0], 4, 4),
    }
    path = raw_file(tmp_path / "z.safetensors", header, struct.pack("<f", 9))
    assert library_loads(path)
    with open_safetensors(path) as ckpt:
        assert ckpt.read("e2").shape == (0, 5)
        assert ckpt.read("x").tolist() == [9.0]
        assert ckpt.read_narrow("e3", 0, 1, 2).shape == (2, 0)
        assert ckpt.bytes_read == 4


def test_empty_header_is_a_checkpoint_without_tensors(tmp_path: Path) -> None:
    path = raw_file(tmp_path / "e.safetensors", {})
    assert library_loads(path)
    with open_safetensors(path) as ckpt:
        assert len(ckpt) == 0


def test_folder_with_one_file(sample_file: Path) -> None:
    with open_safetensors(sample_file.parent) as ckpt:
        assert ckpt.files == [str(sample_file)]
        assert len(ckpt) == len(sample_tensors())


# ----------------------------------------------------------------------------------------------
# read_narrow


def test_read_narrow_every_dim(sample_file: Path) -> None:
    with open_safetensors(sample_file) as ckpt:
        for name, meta in ckpt.metadata().items():
            full = ckpt.read(name)
            for dim, size in enumerate(meta.shape):
                for start, length in [
                    (0, size),
                    (0, 0),
                    (size, 0),
                    (size // 2, size - size // 2),
                    (1, max(size - 2, 0)),
                ]:
                    if start + length > size:
                        continue
                    before = ckpt.bytes_read
                    piece = ckpt.read_narrow(name, dim, start, length)
                    assert same(piece, full.narrow(dim, start, length)), (name, dim, start)
                    assert piece.is_contiguous()
                    assert ckpt.bytes_read - before == piece.numel() * piece.element_size()


_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]
_counter = itertools.count()


@settings(max_examples=50, deadline=None)
@given(case=narrow_cases(_DTYPES), pad=st.integers(0, 7))
def test_read_narrow_property(tmp_path_factory, case, pad) -> None:
    shape, dtype, dim, start, length = case
    itemsize = torch.empty(0, dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    t = torch.randint(0, high, (*shape, itemsize), dtype=torch.uint8).view(dtype).reshape(shape)
    # a padding tensor in front moves t to an offset that need not be aligned
    tensors = {"pad": torch.zeros(pad, dtype=torch.uint8), "t": t}
    path = tmp_path_factory.getbasetemp() / f"narrow{next(_counter)}.safetensors"
    save_file(tensors, str(path))
    with open_safetensors(path) as ckpt:
        piece = ckpt.read_narrow("t", dim, start, length)
        want = t.narrow(dim, start, length)
        assert same(piece, want)
        assert ckpt.bytes_read == want.numel() * want.element_size()
    path.unlink()


def test_read_narrow_refuses_bad_arguments(sample_file: Path) -> None:
    with open_safetensors(sample_file) as ckpt:  # f16 is (3, 5)
        with pytest.raises(IndexError, match="dim 2 is out of range"):
            ckpt.read_narrow("f16", 2, 0, 1)
        with pytest.raises(IndexError, match="dim 0 is out of range"):
            ckpt.read_narrow("f32_scalar", 0, 0, 1)
        with pytest.raises(IndexError, match="start 6 is out of range"):
            ckpt.read_narrow("f16", 1, 6, 0)
        with pytest.raises(IndexError, match="start -4 is out of range"):
            ckpt.read_narrow("f16", 0, -4, 0)
        with pytest.raises(ValueError, match="cannot take 3 elements from 1"):
            ckpt.read_narrow("f16", 0, 1, 3)
        with pytest.raises(ValueError, match="cannot take -1"):
            ckpt.read_narrow("f16", 0, 0, -1)
        with pytest.raises(TypeError):
            ckpt.read_narrow("f16", 0, 0.5, 1)
        assert ckpt.bytes_read == 0


def test_concurrent_reads_count_every_byte(sample_file: Path) -> None:
    expected = load_file(str(sample_file))
    errors: list[BaseException] = []
    with open_safetensors(sample_file) as ckpt:

        def work() -> None:
            try:
                for _ in range(20):
                    for name, want in expected.items():
                        assert same(ckpt.read(name), want)
                    assert same(ckpt.read_narrow("i32", 1, 1, 2), expected["i32"][:, 1:3])
            except BaseException as e:  # noqa: BLE001  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        per_round = sum(t.numel() * t.element_size() for t in expected.values()) + 4 * 2 * 4
        assert ckpt.bytes_read == 8 * 20 * per_round


# ----------------------------------------------------------------------------------------------
# close


def test_read_array_is_the_library_s_tensor_as_numpy(sample_file: Path) -> None:
    """``read_array`` (what a planner reads without torch) holds the bytes the safetensors
    library reads, numpy's dtype where it has one, else the same-width integer; after close it
    refuses as ``read`` does."""
    expected = load_file(str(sample_file))
    with open_safetensors(sample_file) as ckpt:
        for name, want in expected.items():
            got = ckpt.read_array(name)
            assert got.shape == tuple(want.shape), name
            assert got.flags.owndata or (got.base is not None and got.base.flags.owndata), name
            if want.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                want = want.view({1: torch.uint8, 2: torch.int16}[want.element_size()])
            assert got.tobytes() == want.contiguous().numpy().tobytes(), name
            assert got.dtype == want.numpy().dtype, name
        assert ckpt.bytes_read == sum(t.numel() * t.element_size() for t in expected.values())
    with pytest.raises(ValueError, match="closed"):
        ckpt.read_array("i32")


def test_tensors_outlive_close_and_reading_after_close_raises(sample_file: Path) -> None:
    expected = load_file(str(sample_file))
    ckpt = open_safetensors(sample_file)
    kept = {name: ckpt.read(name) for name in ckpt.names()}
    piece = ckpt.read_narrow("f32_3d", 1, 1, 2)
    ckpt.close()
    ckpt.close()  # idempotent
    for name, t in kept.items():
        assert same(t, expected[name])
    assert same(piece, expected["f32_3d"][:, 1:3])
    with pytest.raises(ValueError, match="closed"):
        ckpt.read("f16")
    with pytest.raises(ValueError, match="closed"):
        ckpt.read_narrow("f16", 0, 0, 1)
    assert "f16" in ckpt  # metadata stays available


def test_view_is_the_tensor_in_place_in_the_mapping_and_outlives_close(sample_file: Path) -> None:
    expected = load_file(str(sample_file))
    ckpt = open_safetensors(sample_file)
    mapping = ckpt.source_bytes(0)
    views = {name: ckpt.view(name) for name in ckpt.names()}
    for name, view in views.items():
        assert view is not None and same(view, expected[name]), name
        if view.numel():  # a view of the file's mapping, not a copy
            assert view.untyped_storage().data_ptr() == mapping.untyped_storage().data_ptr()
    assert ckpt.bytes_read == 0  # nothing was copied
    views["f32_3d"][0, 0, 0] = 7.0  # a private mapping: the write stays in this process
    assert load_file(str(sample_file))["f32_3d"][0, 0, 0] != 7.0
    ckpt.close()
    del mapping
    assert same(views["i64"], expected["i64"])  # the pages stay mapped while a view lives
    with pytest.raises(ValueError, match="closed"):
        ckpt.view("f16")


def test_view_of_a_tensor_not_aligned_for_its_dtype_is_none(tmp_path: Path) -> None:
    data = bytes([1, 2, 3]) + struct.pack("<2f", 0.5, -2.0)
    header = {"u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}, "f": f32([2], 3, 11)}
    path = raw_file(tmp_path / "odd.safetensors", header, data)
    with open_safetensors(path) as ckpt:
        assert ckpt.view("u").tolist() == [1, 2, 3]
        _, begin, _ = ckpt.locate("f")
        assert begin % 4 and ckpt.view("f") is None  # read() copies it as bytes instead


def test_view_refuses_a_file_changed_since_it_was_opened(sample_file: Path) -> None:
    with open_safetensors(sample_file) as ckpt:
        os.utime(sample_file, ns=(1, 1))
        with pytest.raises(FormatError, match="the file changed while loading"):
            ckpt.view("f16")


def test_close_while_a_read_is_in_flight(sample_file: Path, monkeypatch) -> None:
    expected = load_file(str(sample_file))["f32_3d"]  # 96 bytes
    check_close_while_a_read_is_in_flight(
        open_safetensors(sample_file), "f32_3d", expected, same, monkeypatch
    )


# ----------------------------------------------------------------------------------------------
# bad files: (id, build(tmp_path) -> path, tensor named, phrase, does the library load it?)


def _truncated(tmp: Path) -> Path:
    path = tmp / "cut.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(8)}, str(path))
    path.write_bytes(path.read_bytes()[:-3])
    return path


def _bytes(content: bytes):
    def build(tmp: Path) -> Path:
        path = tmp / "bad.safetensors"
        path.write_bytes(content)
        return path

    return build


def _raw(header=None, data=b"", **kw):
    return lambda tmp: raw_file(tmp / "bad.safetensors", header, data, **kw)


_ONE = {"a": f32([1], 0, 4)}
_Z4, _Z8 = b"\0" * 4, b"\0" * 8

BAD_FILES = [
    ("truncated", _truncated, "b", "truncated", False),
    ("shorter than 8 bytes", _bytes(b"\x05\0\0"), None, "too short", False),
    ("header length 0", _raw(header_bytes=b""), None, "header length is 0", False),
    ("header over 100 MB", _raw(header_bytes=b"{}", length=100_000_001), None, "over the", False),
    ("header past end of file", _raw(_ONE, _Z4, length=200), None, "runs past the end", False),
    ("trailing bytes", _raw(_ONE, _Z8), None, "4 trailing bytes", False),
    ("overlap", _raw({"a": f32([2], 0, 8), "b": f32([1], 4, 8)}, _Z8), "b", "overlap", False),
    (
        "zero-size inside another",
        _raw({"a": f32([2], 0, 8), "b": f32([0], 4, 4)}, _Z8),
        "b",
        "overlap",
        False,
    ),
    (
        "out of bounds",
        _raw({"a": f32([1], 0, 4), "b": f32([2], 4, 12)}, _Z8),
        "b",
        "run past the end",
        False,
    ),
    ("gap", _raw({"a": f32([1], 0, 4), "b": f32([1], 8, 12)}, b"\0" * 12), "b", "gap of 4", False),
    ("gap at start", _raw({"a": f32([1], 4, 8)}, _Z8), "a", "start of the buffer", False),
    ("size mismatch", _raw({"a": f32([3], 0, 8)}, _Z8), "a", "lies about the size", False),
    (
        "unknown dtype",
        _raw({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, _Z4),
        "a",
        "unknown dtype 'F99'",
        False,
    ),
    ("negative shape", _raw({"a": f32([-1], 0, 4)}, _Z4), "a", "non-negative integers", False),
    ("float shape", _raw({"a": f32([1.0], 0, 4)}, _Z4), "a", "non-negative integers", False),
    ("bool shape", _raw({"a": f32([True], 0, 4)}, _Z4), "a", "non-negative integers", False),
    ("shape not a list", _raw({"a": f32(1, 0, 4)}, _Z4), "a", "non-negative integers", False),
    (
        "three offsets",
        _raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}}, _Z4),
        "a",
        "[begin, end]",
        False,
    ),
    ("begin after end", _raw({"a": f32([0], 4, 0)}, _Z4), "a", "end before they begin", False),
    ("entry not an object", _raw({"a": 5}), "a", "must be an object", False),
    (
        "duplicate field in entry",
        _raw(
            header_bytes=b'{"a": {"dtype": "F32", "dtype": "F32", '
            b'"shape": [1], "data_offsets": [0, 4]}}',
            data=_Z4,
        ),
        None,
        "duplicate key 'dtype'",
        False,
    ),
    (
        "NaN",
        _raw(
            header_bytes=b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
            data=_Z4,
        ),
        None,
        "NaN",
        False,
    ),
    (
        "Infinity",
        _raw(header_bytes=b'{"__metadata__": {}, "x": Infinity}'),
        None,
        "Infinity",
        False,
    ),
    ("not an object", _raw([1, 2]), None, "must be a JSON object", False),
    ("not JSON", _raw(header_bytes=b'{"a": '), None, "not valid JSON", False),
    ("not UTF-8", _raw(header_bytes=b'{"\xff": 1}'), None, "not valid UTF-8", False),
    ("nested too deeply", _raw(header_bytes=b"[" * 100_000), None, "nested too deeply", False),
    (
        "metadata not str->str",
        _raw({"__metadata__": {"x": 1}, **_ONE}, _Z4),
        None,
        "__metadata__ must be",
        False,
    ),
    # -- stricter than the library, which loads these --
    # two entries with one name: the library keeps the last one, silently
    (
        "duplicate tensor name",
        _raw(
            header_bytes=b'{"a": {"dtype": "F32", "shape": [1], '
            b'"data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], '
            b'"data_offsets": [0, 4]}}',
            data=_Z4,
        ),
        None,
        "duplicate key 'a'",
        True,
    ),
    # an unknown key in an entry: the library ignores it
    (
        "extra key in entry",
        _raw({"a": {**f32([1], 0, 4), "strides": [1]}}, _Z4),
        "a",
        "exactly dtype, shape and data_offsets",
        True,
    ),
    # "__metadata__": null: the library takes it as no metadata
    (
        "metadata null",
        _raw({"__metadata__": None, **_ONE}, _Z4),
        None,
        "__metadata__ must be",
        True,
    ),
]


@pytest.mark.parametrize(
    "build, tensor, phrase, library_accepts",
    [case[1:] for case in BAD_FILES],
    ids=[case[0] for case in BAD_FILES],
)
def test_bad_file(tmp_path: Path, build, tensor, phrase, library_accepts) -> None:
    path = build(tmp_path)
    with pytest.raises(FormatError) as info:
        open_safetensors(path)
    assert info.value.file == str(path)
    assert info.value.tensor == tensor
    assert phrase in str(info.value)
    assert library_loads(path) == library_accepts


# ----------------------------------------------------------------------------------------------
# HF-sharded folders


def write_sharded(
    folder: Path,
    files: dict[str, dict[str, torch.Tensor]],
    weight_map: dict[str, str] | None = None,
) -> Path:
    folder.mkdir(exist_ok=True)
    for name, tensors in files.items():
        save_file(tensors, str(folder / name), metadata={"shard": name})
    if weight_map is None:
        weight_map = {t: name for name, tensors in files.items() for t in tensors}
    (folder / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map})
    )
    return folder


SHARDS = {
    "model-00001-of-00002.safetensors": {
        "embed": torch.arange(12.0).reshape(3, 4),
        "layer0.w": torch.arange(6, dtype=torch.int32),
    },
    "model-00002-of-00002.safetensors": {
        "layer1.w": torch.ones(2, 2).half(),
        "lm_head": torch.zeros(4, 3).bfloat16(),
    },
}


def test_sharded_folder(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    for path in [folder, folder / INDEX_NAME]:  # the folder, or the index file itself
        with open_safetensors(path) as ckpt:
            assert ckpt.source == str(path)
            assert ckpt.index_metadata == {"total_size": 123}
            assert ckpt.files == [str(folder / name) for name in SHARDS]
            assert ckpt.file_metadata[str(folder / "model-00002-of-00002.safetensors")] == {
                "shard": "model-00002-of-00002.safetensors"
            }
            everything = {n: t for tensors in SHARDS.values() for n, t in tensors.items()}
            assert set(ckpt.metadata()) == set(everything)
            for name, want in everything.items():
                assert same(ckpt.read(name), want)
                assert ckpt.meta(name).shape == tuple(want.shape)


def test_sharded_folder_ignores_unlisted_files_and_follows_inner_symlinks(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    save_file({"stray": torch.ones(1)}, str(folder / "consolidated.safetensors"))
    real = folder / "model-00002-of-00002.safetensors"
    real.rename(folder / "real.safetensors")
    os.symlink("real.safetensors", real)  # a link that stays inside the folder is fine
    with open_safetensors(folder) as ckpt:
        assert "stray" not in ckpt
        assert same(ckpt.read("lm_head"), SHARDS[real.name]["lm_head"])


def test_index_naming_a_missing_file(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FormatError, match="file is missing") as info:
        open_safetensors(folder)
    assert info.value.file == str(folder / "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_index_naming_a_file_outside_the_folder(tmp_path: Path, kind: str) -> None:
    outside = tmp_path / "evil.safetensors"
    save_file(
        {"lm_head": torch.zeros(4, 3).bfloat16(), "layer1.w": torch.ones(2, 2).half()}, str(outside)
    )
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    name = {"dotdot": "../evil.safetensors", "absolute": str(outside)}[kind]
    weight_map = {t: f for f, ts in SHARDS.items() for t in ts}
    weight_map["lm_head"] = weight_map["layer1.w"] = name
    (folder / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    why = {"dotdot": "has a '..' component", "absolute": "is an absolute path"}[kind]
    with pytest.raises(
        FormatError,
        match=f"{why}; a checkpoint may only name files by plain "
        f"relative paths inside its own folder",
    ) as info:
        open_safetensors(folder)
    assert info.value.file == str(folder / INDEX_NAME)
    assert info.value.tensor in {"lm_head", "layer1.w"}


def test_index_name_may_be_a_symlink_to_anywhere(tmp_path: Path) -> None:
    # The rule is about the names a checkpoint carries, not where the user's file system keeps
    # the bytes (the Hugging Face hub cache links every file to ../../blobs/<sha256>).
    outside = tmp_path / "elsewhere" / "blob"
    outside.parent.mkdir()
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.rename(outside)
    os.symlink(os.path.relpath(outside, folder), shard)
    with open_safetensors(folder) as ckpt:
        assert same(ckpt.read("lm_head"), SHARDS[shard.name]["lm_head"])


def test_index_tensor_missing_from_its_file(tmp_path: Path) -> None:
    weight_map = {t: f for f, ts in SHARDS.items() for t in ts}
    weight_map["ghost"] = "model-00001-of-00002.safetensors"
    folder = write_sharded(tmp_path / "ckpt", SHARDS, weight_map)
    with pytest.raises(FormatError, match="does not hold it") as info:
        open_safetensors(folder)
    assert info.value.file == str(folder / "model-00001-of-00002.safetensors")
    assert info.value.tensor == "ghost"


def test_tensor_in_file_but_not_in_index(tmp_path: Path) -> None:
    weight_map = {t: f for f, ts in SHARDS.items() for t in ts}
    del weight_map["layer1.w"]
    folder = write_sharded(tmp_path / "ckpt", SHARDS, weight_map)
    with pytest.raises(FormatError, match="does not list it") as info:
        open_safetensors(folder)
    assert info.value.file == str(folder / "model-00002-of-00002.safetensors")
    assert info.value.tensor == "layer1.w"


def test_tensor_in_two_files(tmp_path: Path) -> None:
    files = {name: dict(tensors) for name, tensors in SHARDS.items()}
    files["model-00002-of-00002.safetensors"]["embed"] = torch.zeros(3, 4)
    weight_map = {t: f for f, ts in SHARDS.items() for t in ts}  # embed -> file 1
    folder = write_sharded(tmp_path / "ckpt", files, weight_map)
    with pytest.raises(FormatError, match="must be in one file only") as info:
        open_safetensors(folder)
    assert info.value.file == str(folder / "model-00002-of-00002.safetensors")
    assert info.value.tensor == "embed"


@pytest.mark.parametrize(
    "index, phrase",
    [
        ("[]", "must be a JSON object"),
        ("{}", "weight_map"),
        ('{"weight_map": {"a": 1}}', "weight_map"),
        ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "duplicate key 'a'"),
        ('{"weight_map": {}, "metadata": 3}', '"metadata" must be an object'),
        ("{", "not valid JSON"),
    ],
)
def test_bad_index(tmp_path: Path, index: str, phrase: str) -> None:
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    (folder / INDEX_NAME).write_text(index)
    with pytest.raises(FormatError) as info:
        open_safetensors(folder)
    assert info.value.file == str(folder / INDEX_NAME)
    assert phrase in str(info.value)


def test_bad_shard_in_index_names_the_shard(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path / "ckpt", SHARDS)
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(FormatError, match="truncated") as info:
        open_safetensors(folder)
    assert info.value.file == str(shard)


# ----------------------------------------------------------------------------------------------
# paths


def test_several_files_without_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"b": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(FormatError, match="2 .safetensors files .* but no") as info:
        open_safetensors(tmp_path)
    assert info.value.file == str(tmp_path)


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="no \\*.safetensors file") as info:
        open_safetensors(tmp_path)
    assert info.value.file == str(tmp_path)


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FormatError, match="no such file") as info:
        open_safetensors(missing)
    assert info.value.file == str(missing)


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(FormatError, match="not a .safetensors file") as info:
        open_safetensors(path)
    assert info.value.file == str(path)


def test_read_ranges_concatenates_slices_with_one_copy(tmp_path):
    # what a worker's piece of a fused [q, k, v] tensor is: several slices of one dim
    from safetensors.torch import save_file

    from shardload.readers import open_checkpoint

    x = torch.arange(4 * 12 * 3, dtype=torch.int32).reshape(4, 12, 3)
    save_file({"x": x}, str(tmp_path / "m.safetensors"))
    with open_checkpoint(tmp_path / "m.safetensors") as ckpt:
        for dim, ranges in (
            (1, [(0, 4), (8, 2), (10, 2)]),
            (0, [(3, 1), (0, 2)]),
            (2, [(2, 1), (0, 1)]),
            (1, [(5, 0)]),
        ):
            before = ckpt.bytes_read
            got = ckpt.read_ranges("x", dim, ranges)
            want = torch.cat([x.narrow(dim, s, n) for s, n in ranges], dim=dim)
            assert torch.equal(got, want) and got.is_contiguous()
            assert ckpt.bytes_read - before == want.numel() * 4


def test_a_checkpoint_reads_through_one_byte_source_per_file(tmp_path):
    """Each file is a ``ByteSource`` the checkpoint asks (``sources.bytesource``): its spec is
    the read plans' source, another process reaches the same bytes from it, and it refuses a
    file changed since it was mapped."""
    from shardload.readers.mapped import open_sources
    from shardload.sources.bytesource import MappedFile, fetched_objects
    from shardload.sources.specs import FileSource

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    with open_safetensors(path) as ckpt:
        (source,) = ckpt.byte_sources
        assert isinstance(source, MappedFile) and source.viewable
        assert ckpt.sources() == [source.spec()] and isinstance(source.spec(), FileSource)
        assert fetched_objects(ckpt.byte_sources) == {}
        _, begin, end = ckpt.locate("w")
        with open_sources(ckpt.sources()) as elsewhere:
            assert bytes(elsewhere.source_bytes(0)[begin:end].numpy()) == bytes(
                ckpt.read("w").numpy()
            )
        os.utime(path, ns=(1, 1))
        with pytest.raises(FormatError, match="changed while loading"):
            source.check_unchanged("w")
