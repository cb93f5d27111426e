"""The GGUF reader: metadata, raw-block reads and slices checked against gguf-py, key-values,
every way a file can be refused, and a real published model."""

from __future__ import annotations

import gc
import struct
import sys
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf.quants import dequantize, quantize
from helpers.gguf_blocks import K_TYPES, blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from shardload import dtypes
from shardload.errors import FormatError
from shardload.readers import open_checkpoint
from shardload.readers.gguf import CONFIG_MAX_ARRAY, GGUFCheckpoint, open_gguf

BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
BIG = 2000  # items in the big key-value arrays (over CONFIG_MAX_ARRAY)
assert BIG > CONFIG_MAX_ARRAY


def _tensors(rng: np.random.Generator) -> dict[str, tuple[T, np.ndarray, tuple[int, ...]]]:
    """name -> (ggml type, the array written, the numpy-order element shape)."""
    out: dict[str, tuple[T, np.ndarray, tuple[int, ...]]] = {}
    x = rng.standard_normal((6, 128)).astype(np.float32)
    out["token_embd.weight"] = (T.F32, x, (6, 128))
    out["blk.0.attn_norm.weight"] = (T.F16, rng.standard_normal(128).astype(np.float16), (128,))
    out["blk.0.ffn_norm.weight"] = (T.BF16, quantize(x, T.BF16), (6, 128))
    out["blk.0.cube.weight"] = (T.F32, rng.standard_normal((2, 3, 8)).astype(np.float32), (2, 3, 8))
    out["blk.0.ids"] = (T.I32, rng.integers(-100, 100, (5, 4), dtype=np.int32), (5, 4))
    out["blk.0.bytes"] = (T.I8, rng.integers(-100, 100, (3, 4), dtype=np.int8), (3, 4))
    out["blk.0.f64"] = (T.F64, rng.standard_normal(7), (7,))
    for qtype in BLOCK_TYPES:
        rows, cols = (4, 768) if qtype in K_TYPES else (6, 128)
        out[f"blk.1.{qtype.name.lower()}.weight"] = (
            qtype,
            blocks(rng, qtype, rows, cols),
            (rows, cols),
        )
    q = quantize(rng.standard_normal((2, 3, 64)).astype(np.float32), T.Q8_0)
    out["blk.2.q8_0_3d.weight"] = (T.Q8_0, q, (2, 3, 64))
    out["blk.2.tq2_0.weight"] = (
        T.TQ2_0,
        quantize(rng.standard_normal((2, 256)).astype(np.float32), T.TQ2_0),
        (2, 256),
    )
    return out


def _write(path, tensors, *, big: int = BIG) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.attention.head_count", 8)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_uint32("llama.embedding_length", 128)
    w.add_uint32("llama.feed_forward_length", 384)
    w.add_uint32("llama.block_count", 3)
    w.add_uint32("llama.vocab_size", big)
    w.add_uint32("general.file_type", 3)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float64("test.f64", 0.25)
    w.add_int64("test.i64", -(2**40))
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int8("test.i8", -3)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("general.name", "tiny llamá ✓")
    w.add_array("general.languages", ["en", "fr", "日本語"])
    w.add_array("test.small_ints", [1, 2, 3])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(big)])
    w.add_array("tokenizer.ggml.token_type", [i % 5 for i in range(big)])
    for name, (qtype, arr, _) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qtype if arr.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(path, tensors written, gguf-py's reader of the file)."""
    tensors = _tensors(np.random.default_rng(1234))
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write(path, tensors)
    return str(path), tensors, gguf.GGUFReader(str(path))


@pytest.fixture
def ckpt(written):
    with open_gguf(written[0]) as c:
        yield c


def _ref(reader: gguf.GGUFReader, name: str):
    (t,) = [t for t in reader.tensors if t.name == name]
    return t


# ----------------------------------------------------------------------------------------------
# metadata


def test_open_checkpoint_dispatches_and_names_the_file(written):
    path = written[0]
    with open_checkpoint(path) as c:
        assert isinstance(c, GGUFCheckpoint)
        assert c.source == path and c.path == path  # tmp paths are absolute
        assert c.version == 3 and c.alignment == 32
        assert repr(c).startswith("GGUFCheckpoint(")


def test_names_shapes_dtypes_and_formats(ckpt, written):
    _, tensors, reader = written
    assert ckpt.names() == [t.name for t in reader.tensors]  # GGUF names, storage order
    assert len(ckpt) == len(tensors)
    element_dtypes = {
        T.F32: "float32",
        T.F16: "float16",
        T.BF16: "bfloat16",
        T.I32: "int32",
        T.I8: "int8",
        T.F64: "float64",
    }
    for name, (qtype, arr, shape) in tensors.items():
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        meta = ckpt.meta(name)
        fmt = ckpt.tensor_format(name)
        assert fmt == {
            "ggml_type": qtype.name,
            "block_size": block_size,
            "type_size": type_size,
            "ne": list(reversed(shape)),
        }, name
        if qtype in element_dtypes:
            assert (meta.shape, meta.dtype) == (shape, element_dtypes[qtype]), name
            assert (
                block_size == 1
                and type_size == np.dtype(meta.dtype.replace("bfloat16", "float16")).itemsize
            )
        else:
            row_bytes = shape[-1] // block_size * type_size
            assert (meta.shape, meta.dtype) == (shape[:-1] + (row_bytes,), "uint8"), name
            assert meta.shape == arr.shape == _ref(reader, name).data.shape
        assert meta.nbytes == _ref(reader, name).data.nbytes
        _, begin, end = ckpt.locate(name)
        assert begin == _ref(reader, name).data_offset and end - begin == meta.nbytes
    fmt = ckpt.tensor_format("blk.1.q4_1.weight")
    fmt["ne"].append(9)  # a copy: changing it changes nothing
    assert ckpt.tensor_format("blk.1.q4_1.weight")["ne"] == [128, 6]
    with pytest.raises(KeyError, match="no tensor named"):
        ckpt.tensor_format("nope")


# ----------------------------------------------------------------------------------------------
# reads


def test_read_is_gguf_py_bytes_exactly_and_counts(ckpt, written):
    _, tensors, reader = written
    total = 0
    for name, (_qtype, arr, _) in tensors.items():
        got = ckpt.read(name)
        meta = ckpt.meta(name)
        assert tuple(got.shape) == meta.shape and str(got.dtype) == f"torch.{meta.dtype}"
        assert got.is_contiguous()
        raw = got.view(torch.uint8) if got.dtype == torch.bfloat16 else got
        assert raw.numpy().tobytes() == _ref(reader, name).data.tobytes() == arr.tobytes(), name
        total += meta.nbytes
        assert ckpt.bytes_read == total
    # owned memory: writing to it does not reach the mapping
    got = ckpt.read("token_embd.weight")
    got.fill_(7.0)
    again = ckpt.read("token_embd.weight").numpy()
    assert again.tobytes() == tensors["token_embd.weight"][1].tobytes()


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [T.BF16, T.F16], ids=lambda t: t.name)
def test_dequantized_read_equals_gguf_dequantize(ckpt, written, qtype):
    _, tensors, reader = written
    for name, (t, _arr, shape) in tensors.items():
        if t != qtype:
            continue
        got = ckpt.read(name)
        raw = got.view(torch.uint8).numpy() if got.dtype == torch.bfloat16 else got.numpy()
        ref = _ref(reader, name)
        ours = dequantize(raw, qtype)
        theirs = dequantize(ref.data, ref.tensor_type)
        assert ours.shape == theirs.shape == shape and ours.dtype == np.float32
        assert np.isfinite(ours).all()
        np.testing.assert_array_equal(ours, theirs)


def _narrow_cases(ckpt, name):
    """(dim, start, length) cases: rows, and the last dim at block (or element) boundaries."""
    meta, fmt = ckpt.meta(name), ckpt.tensor_format(name)
    unit = fmt["type_size"] if meta.dtype == "uint8" else 1  # one block, in the last dim
    last = meta.shape[-1] // unit
    cases = [
        (-1, unit, (last - 1) * unit),
        (-1, 0, unit),
        (-1, (last - 1) * unit, unit),
        (len(meta.shape) - 1, 0, 0),
    ]
    if len(meta.shape) > 1:
        rows = meta.shape[0]
        cases += [(0, 1, rows - 1), (0, 0, 1), (0, rows - 1, 1), (0, -2, 2), (0, 0, 0)]
    if len(meta.shape) > 2:
        cases += [(1, 1, meta.shape[1] - 1)]
    return cases


def test_read_narrow_is_slicing_and_reads_only_the_slice(ckpt, written):
    _, tensors, _ = written
    for name in tensors:
        full = ckpt.read(name)
        for dim, start, length in _narrow_cases(ckpt, name):
            before = ckpt.bytes_read
            got = ckpt.read_narrow(name, dim, start, length)
            want = full.narrow(dim, start, length)
            assert got.is_contiguous() and got.dtype == full.dtype
            assert torch.equal(
                got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                want.view(torch.uint8) if want.dtype == torch.bfloat16 else want,
            )
            assert ckpt.bytes_read - before == got.numel() * got.element_size(), (name, dim)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_byte_slice_at_block_boundaries_dequantizes_to_column_slice(ckpt, written, qtype):
    """What row-parallel GGUF splits rely on: whole blocks of a row are whole columns."""
    _, tensors, _ = written
    (name,) = [n for n, (t, arr, shape) in tensors.items() if t == qtype and len(shape) == 2]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    full = dequantize(ckpt.read(name).numpy(), qtype)
    n_blocks = full.shape[1] // block_size
    for b0 in range(n_blocks):
        for b1 in range(b0 + 1, n_blocks + 1):
            piece = ckpt.read_narrow(name, -1, b0 * type_size, (b1 - b0) * type_size)
            np.testing.assert_array_equal(
                dequantize(piece.numpy(), qtype), full[:, b0 * block_size : b1 * block_size]
            )
    # and a tensor-parallel split of both: rows of a column split
    piece = ckpt.read_narrow(name, 0, 1, 2).numpy()[:, type_size : 2 * type_size]
    np.testing.assert_array_equal(
        dequantize(np.ascontiguousarray(piece), qtype), full[1:3, block_size : 2 * block_size]
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_read_narrow_any_slice(written, data):
    path, tensors, _ = written
    name = data.draw(st.sampled_from(sorted(tensors)))
    with open_gguf(path) as c:
        shape = c.meta(name).shape
        dim = data.draw(st.integers(-len(shape), len(shape) - 1))
        size = shape[dim]
        start = data.draw(st.integers(0, size))
        length = data.draw(st.integers(0, size - start))
        if data.draw(st.booleans()) and start < size:
            start -= size  # negative start, as torch.narrow takes
        got = c.read_narrow(name, dim, start, length)
        full = c.read(name)
        want = full.narrow(dim, start, length)
        assert torch.equal(
            got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
            want.view(torch.uint8) if want.dtype == torch.bfloat16 else want,
        )


def test_read_narrow_refuses_bad_arguments(ckpt):
    name = "blk.1.q4_0.weight"  # (6, 72)
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        ckpt.read_narrow(name, 2, 0, 1)
    with pytest.raises(IndexError, match="start 7 is out of range"):
        ckpt.read_narrow(name, 0, 7, 0)
    with pytest.raises(ValueError, match="cannot take 3 elements from 4"):
        ckpt.read_narrow(name, 0, 4, 3)
    with pytest.raises(ValueError, match="cannot take -1"):
        ckpt.read_narrow(name, 1, 0, -1)
    with pytest.raises(KeyError, match="no tensor named"):
        ckpt.read_narrow("nope", 0, 0, 1)
    assert ckpt.bytes_read == 0


def test_concurrent_reads_count_every_byte(written):
    path, tensors, reader = written
    names = sorted(tensors)
    errors: list[BaseException] = []
    with open_gguf(path) as c:
        expected = 0
        for name in names:
            expected += 20 * c.meta(name).nbytes

        def work(offset: int) -> None:
            try:
                for i in range(20):
                    name = names[(i + offset) % len(names)]
                    got = c.read(name)
                    raw = got.view(torch.uint8) if got.dtype == torch.bfloat16 else got
                    assert raw.numpy().tobytes() == _ref(reader, name).data.tobytes()
            except BaseException as e:  # noqa: BLE001  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(names))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert c.bytes_read == expected


def test_close(tmp_path):
    path = tmp_path / "close.gguf"
    tensors = _tensors(np.random.default_rng(5))
    _write(path, tensors)
    c = open_gguf(path)
    kept = c.read("blk.1.q4_1.weight")
    c.close()
    c.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        c.read("blk.1.q4_1.weight")
    with pytest.raises(ValueError, match="closed"):
        c.read_narrow("blk.1.q4_1.weight", 0, 0, 1)
    with pytest.raises(ValueError, match="closed"):
        c.field("tokenizer.ggml.tokens")
    assert c.config["llama.block_count"] == 3  # built at close, still there
    assert kept.numpy().tobytes() == tensors["blk.1.q4_1.weight"][1].tobytes()
    assert c.meta("blk.1.q4_1.weight").dtype == "uint8"  # metadata stays
    if sys.platform.startswith("linux"):
        gc.collect()
        with open("/proc/self/maps") as f:
            assert str(path) not in f.read()  # unmapped


# ----------------------------------------------------------------------------------------------
# key-values


def test_config_has_scalars_and_small_arrays_only(ckpt, written):
    reader = written[2]
    cfg = ckpt.config
    assert cfg["general.architecture"] == "llama"
    assert cfg["llama.attention.head_count"] == 8 and type(cfg["llama.attention.head_count"]) is int
    assert cfg["llama.attention.head_count_kv"] == 2
    assert cfg["llama.embedding_length"] == 128 and cfg["llama.feed_forward_length"] == 384
    assert cfg["llama.block_count"] == 3 and cfg["llama.vocab_size"] == BIG
    assert cfg["general.file_type"] == 3
    assert cfg["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert cfg["llama.attention.layer_norm_rms_epsilon"] == float(np.float32(1e-5))
    assert cfg["test.f64"] == 0.25 and cfg["test.i64"] == -(2**40) and cfg["test.u64"] == 2**63 + 5
    assert cfg["test.i8"] == -3
    assert cfg["tokenizer.ggml.add_bos_token"] is True
    assert cfg["general.name"] == "tiny llamá ✓"
    assert cfg["general.languages"] == ["en", "fr", "日本語"]
    assert cfg["test.small_ints"] == [1, 2, 3]
    assert "tokenizer.ggml.tokens" not in cfg and "tokenizer.ggml.token_type" not in cfg
    assert not any(k.startswith("GGUF.") for k in cfg)
    # the same values gguf-py decodes
    for key, value in cfg.items():
        assert value == reader.fields[key].contents(), key
    cfg["general.architecture"] = "changed"  # a copy
    assert ckpt.config["general.architecture"] == "llama"


def test_field_returns_any_key_in_full(ckpt, written):
    reader = written[2]
    assert ckpt.field("tokenizer.ggml.tokens") == [f"tok{i}" for i in range(BIG)]
    assert ckpt.field("tokenizer.ggml.token_type") == [i % 5 for i in range(BIG)]
    assert ckpt.field("llama.attention.head_count") == 8
    assert ckpt.field("general.languages") == ["en", "fr", "日本語"]
    assert ckpt.field_names() == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key in ckpt.field_names():
        assert ckpt.field(key) == reader.fields[key].contents(), key
    with pytest.raises(KeyError, match="no key named 'nope'"):
        ckpt.field("nope")


# ----------------------------------------------------------------------------------------------
# refusals: files written by hand, byte by byte


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _kv_str(key: str, value: str) -> bytes:
    return _kv(key, V.STRING, _str(value))


def _info(name: str | bytes, ne: list[int], code: int, offset: int) -> bytes:
    return (
        _str(name)
        + struct.pack("<I", len(ne))
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", code, offset)
    )


def _file(
    kvs: list[bytes],
    infos: list[bytes],
    data: bytes,
    *,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
    magic: bytes = b"GGUF",
    endian: str = "<",
) -> bytes:
    head = magic + struct.pack(
        f"{endian}IQQ",
        version,
        len(infos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    body = head + b"".join(kvs) + b"".join(infos)
    body += bytes(-len(body) % alignment)
    return body + data


ARCH = _kv_str("general.architecture", "llama")
A = _info("a", [8, 2], T.F32, 0)  # 64 bytes at 0
B = _info("b", [32, 2], T.Q8_0, 64)  # 2 blocks of 34 bytes at 64
DATA = bytes(range(64)) + bytes(68) + bytes(-132 % 32)


def test_hand_written_file_is_valid_and_gguf_py_agrees(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(_file([ARCH], [A, B], DATA))
    with open_gguf(path) as c:
        assert c.meta("a").shape == (2, 8) and c.meta("b").shape == (2, 34)
        assert c.read("a").numpy().tobytes() == bytes(range(64))
        ref = gguf.GGUFReader(str(path))
        for t in ref.tensors:
            assert c.read(t.name).numpy().tobytes() == t.data.tobytes()
        assert c.config == {"general.architecture": "llama"}


REFUSED = {
    # name: (file bytes, expected tensor, message fragment)
    "empty": (b"", None, "file is empty"),
    "short": (b"GGUF\x03\x00", None, "too short"),
    "garbage magic": (b"GGML" + _file([ARCH], [A, B], DATA)[4:], None, "not a GGUF file"),
    "random bytes": (bytes(range(256)) * 2, None, "not a GGUF file"),
    "version 1": (_file([ARCH], [A, B], DATA, version=1), None, "version 1 is not supported"),
    "version 4": (_file([ARCH], [A, B], DATA, version=4), None, "version 4 is not supported"),
    "big-endian": (_file([ARCH], [A, B], DATA, endian=">"), None, "big-endian"),
    "kv section cut": (
        _file([ARCH, _kv_str("general.name", "x" * 40)], [], b"")[:70],
        None,
        "runs past the end",
    ),
    "tensor info cut": (_file([ARCH], [A, B], b"")[:-40], "b", "runs past the end"),
    "huge kv count": (_file([ARCH], [A, B], DATA, n_kv=2**62), None, "more than the"),
    "huge tensor count": (_file([ARCH], [A, B], DATA, n_tensors=2**40), None, "more than the"),
    "huge string length": (
        _file([_kv("general.name", V.STRING, struct.pack("<Q", 2**62))], [A, B], DATA),
        None,
        "runs past the end",
    ),
    "huge string array": (
        _file(
            [_kv("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, 2**60))],
            [A, B],
            DATA,
        ),
        None,
        "runs past the end",
    ),
    "huge int array": (
        _file(
            [_kv("tokenizer.ggml.token_type", V.ARRAY, struct.pack("<IQ", V.INT32, 2**61))],
            [A, B],
            DATA,
        ),
        None,
        "runs past the end",
    ),
    "nested array": (
        _file(
            [
                _kv(
                    "x",
                    V.ARRAY,
                    struct.pack("<IQ", V.ARRAY, 1)
                    + struct.pack("<IQ", V.INT32, 1)
                    + struct.pack("<i", 5),
                )
            ],
            [A, B],
            DATA,
        ),
        None,
        "nested arrays",
    ),
    "unknown value type": (
        _file([_kv("x", 13, b"\0" * 8)], [A, B], DATA),
        None,
        "unknown value type 13",
    ),
    "unknown array type": (
        _file([_kv("x", V.ARRAY, struct.pack("<IQ", 77, 1))], [A, B], DATA),
        None,
        "unknown value type 77",
    ),
    "bool not 0 or 1": (_file([_kv("x", V.BOOL, b"\x02")], [A, B], DATA), None, "0 or 1"),
    "bool array not 0 or 1": (
        _file([_kv("x", V.ARRAY, struct.pack("<IQ", V.BOOL, 3) + b"\x01\x00\x09")], [A, B], DATA),
        None,
        "0 or 1",
    ),
    "key not utf-8": (
        _file([_kv(b"\xff\xfe", V.UINT8, b"\x01")], [A, B], DATA),
        None,
        "not valid UTF-8",
    ),
    "string not utf-8": (
        _file([_kv("general.name", V.STRING, _str(b"\xc3\x28"))], [A, B], DATA),
        None,
        "not valid UTF-8",
    ),
    "duplicate key": (_file([ARCH, ARCH], [A, B], DATA), None, "appears twice"),
    "alignment not u32": (
        _file([_kv("general.alignment", V.UINT64, struct.pack("<Q", 32))], [A, B], DATA),
        None,
        "must be a UINT32",
    ),
    "alignment not a power of two": (
        _file(
            [_kv("general.alignment", V.UINT32, struct.pack("<I", 24))], [A, B], DATA, alignment=24
        ),
        None,
        "power of two",
    ),
    "tensor name not utf-8": (
        _file([ARCH], [A, _info(b"b\xff", [32, 2], T.Q8_0, 64)], DATA),
        None,
        "not valid UTF-8",
    ),
    "empty tensor name": (
        _file([ARCH], [A, _info("", [32, 2], T.Q8_0, 64)], DATA),
        None,
        "empty name",
    ),
    "duplicate tensor": (
        _file([ARCH], [A, _info("a", [32, 2], T.Q8_0, 64)], DATA),
        "a",
        "two tensors have this name",
    ),
    "five dims": (
        _file([ARCH], [A, _info("b", [32, 1, 1, 1, 2], T.Q8_0, 64)], DATA),
        "b",
        "5 dimensions",
    ),
    "unknown type code": (
        _file([ARCH], [A, _info("b", [32, 2], 99, 64)], DATA),
        "b",
        "unknown ggml tensor type 99",
    ),
    "removed type code (Q4_2)": (
        _file([ARCH], [A, _info("b", [32, 2], 4, 64)], DATA),
        "b",
        "unknown ggml tensor type 4",
    ),
    "row not whole blocks": (
        _file([ARCH], [A, _info("b", [48, 2], T.Q8_0, 64)], DATA),
        "b",
        "not a multiple of the Q8_0 block size 32",
    ),
    "dims overflow": (
        _file([ARCH], [A, _info("b", [32, 2**40, 2**40], T.Q8_0, 64)], DATA),
        "b",
        "overflow",
    ),
    "offset past the end": (
        _file([ARCH], [A, _info("b", [32, 2], T.Q8_0, 2**40)], DATA),
        "b",
        "runs past the end",
    ),
    "offset not aligned": (
        _file([ARCH], [A, _info("b", [32, 2], T.Q8_0, 40)], DATA),
        "b",
        "not a multiple of the file's alignment 32",
    ),
    "overlap": (
        _file([ARCH], [A, _info("b", [32, 2], T.Q8_0, 32)], DATA),
        "b",
        "overlaps tensor 'a'",
    ),
    "overlap, listed first": (
        _file([ARCH], [_info("b", [32, 2], T.Q8_0, 32), A], DATA),
        "b",
        "overlaps tensor 'a'",
    ),
    "tensor data cut": (_file([ARCH], [A, B], DATA)[:-40], "b", "runs past the end"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(tmp_path, case):
    blob, tensor, fragment = REFUSED[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(FormatError, match=fragment) as info:
        open_checkpoint(path)
    err = info.value
    assert err.file == str(path)
    assert err.tensor == tensor
    assert str(path) in str(err)


def test_refuses_a_folder_and_a_missing_file(tmp_path):
    with pytest.raises(FormatError, match="not a file") as info:
        open_gguf(tmp_path)
    assert info.value.file == str(tmp_path)
    with pytest.raises(FormatError, match="no such file"):
        open_gguf(tmp_path / "missing.gguf")


def _info_position(reader: gguf.GGUFReader, name: str, part: int) -> int:
    """The file offset of part ``part`` of tensor ``name``'s info (4: type code, 5: offset)."""
    (t,) = [t for t in reader.tensors if t.name == name]
    return t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:part])


@pytest.mark.parametrize(
    "patch, fragment",
    [
        ("offset", "runs past the end"),
        ("type", "unknown ggml tensor type 123"),
        ("overlap", "overlaps tensor"),
        ("truncate", "runs past the end"),
    ],
)
def test_refused_written_by_gguf_py(tmp_path, written, patch, fragment):
    """A real GGUFWriter file, patched where gguf-py's own reader says the bytes are."""
    src, _, reader = written
    with open(src, "rb") as f:
        blob = bytearray(f.read())
    last = reader.tensors[-1]
    if patch == "offset":
        at = _info_position(reader, last.name, 5)
        blob[at : at + 8] = struct.pack("<Q", len(blob) + 64 * 1024)
    elif patch == "type":
        at = _info_position(reader, last.name, 4)
        blob[at : at + 4] = struct.pack("<I", 123)
    elif patch == "overlap":
        at = _info_position(reader, last.name, 5)
        prev = reader.tensors[-2]
        blob[at : at + 8] = struct.pack("<Q", prev.data_offset - reader.data_offset)
    else:
        del blob[last.data_offset + 8 :]
    path = tmp_path / "patched.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match=fragment) as info:
        open_gguf(path)
    assert info.value.file == str(path)
    if patch == "overlap":  # both start at one offset: either may be the one named
        names = {last.name, reader.tensors[-2].name}
        assert info.value.tensor in names and all(n in str(info.value) for n in names)
    else:
        assert info.value.tensor == last.name


# ----------------------------------------------------------------------------------------------
# a real model


@pytest.fixture(scope="module")
def smollm2_reader(smollm2):
    """The published SmolLM2 GGUF's path and gguf-py's reader of it."""
    return smollm2, gguf.GGUFReader(smollm2)


def test_real_model_smollm2_q4_1(smollm2_reader):
    path, reader = smollm2_reader
    with open_checkpoint(path) as c:
        assert isinstance(c, GGUFCheckpoint) and len(c) == 272
        cfg = c.config
        assert cfg["general.architecture"] == "llama"
        assert cfg["llama.attention.head_count"] == 9
        assert cfg["llama.attention.head_count_kv"] == 3
        assert cfg["llama.embedding_length"] == 576 and cfg["llama.block_count"] == 30
        assert "tokenizer.ggml.tokens" not in cfg
        assert len(c.field("tokenizer.ggml.tokens")) == 49152
        assert len(c.field("tokenizer.ggml.merges")) == 48900

        name = "blk.0.attn_q.weight"
        assert c.meta(name).shape == (576, 360) and c.meta(name).dtype == "uint8"
        assert c.tensor_format(name) == {
            "ggml_type": "Q4_1",
            "block_size": 32,
            "type_size": 20,
            "ne": [576, 576],
        }
        ref = _ref(reader, name)
        raw = c.read(name).numpy()
        ours = dequantize(raw, T.Q4_1)
        assert ours.shape == (576, 576) and ours.dtype == np.float32
        np.testing.assert_array_equal(ours, dequantize(ref.data, ref.tensor_type))
        # a row-parallel half: the second 288 columns are the second 9 blocks of each row
        half = dequantize(c.read_narrow(name, 1, 180, 180).numpy(), T.Q4_1)
        np.testing.assert_array_equal(half, ours[:, 288:])

        # every tensor: same names, types and bytes as gguf-py
        assert c.names() == [t.name for t in reader.tensors]
        for t in reader.tensors:
            assert c.tensor_format(t.name)["ggml_type"] == t.tensor_type.name
            assert c.meta(t.name).nbytes == t.data.nbytes
            assert c.read(t.name).numpy().tobytes() == t.data.tobytes(), t.name
        assert c.bytes_read == 576 * 360 + 576 * 180 + sum(t.data.nbytes for t in reader.tensors)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupt_headers_are_refused_or_read_safely(fuzz_dir, data):
    """Any damage to the header is a FormatError, or a file whose every tensor reads in full."""
    blob = bytearray(
        _file(
            [
                ARCH,
                _kv(
                    "general.languages",
                    V.ARRAY,
                    struct.pack("<IQ", V.STRING, 2) + _str("en") + _str("fr"),
                ),
                _kv("x", V.ARRAY, struct.pack("<IQ", V.BOOL, 2) + b"\x01\x00"),
            ],
            [A, B],
            DATA,
        )
    )
    header_end = len(blob) - len(DATA)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header_end - 1))
        blob[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del blob[data.draw(st.integers(0, len(blob))) :]
    path = fuzz_dir / "f.gguf"
    path.write_bytes(bytes(blob))
    try:
        c = open_gguf(path)
    except FormatError as e:
        assert e.file == str(path)
        return
    with c:
        for name in c.names():
            meta = c.meta(name)
            assert c.read(name).numel() * dtypes.itemsize(meta.dtype) == meta.nbytes
        for key in c.field_names():
            c.field(key)
        _ = c.config
