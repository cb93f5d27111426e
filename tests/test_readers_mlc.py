"""The MLC-LLM reader (``shardload.readers.mlc``) and the q4f16_1 reference it is checked with.

Good folders are written by ``helpers.mlc_reference.write_mlc_folder`` (laid out as TVM's dumper
lays them out); bad ones by editing a good folder's index or files, one defect at a time. Every
defect must be a ``FormatError`` naming the file to blame and, where one is concerned, the tensor.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.mlc_reference import (
    dequantize_q4f16_1,
    f32_to_bf16_bits,
    pack_int4,
    quantize_q4f16_1,
    unpack_int4,
    write_mlc_folder,
)
from helpers.reader_checks import check_close_while_a_read_is_in_flight, narrow_cases, same
from hypothesis import given, settings
from hypothesis import strategies as st

from shardload.errors import FormatError
from shardload.readers import open_checkpoint
from shardload.readers.base import TensorMeta
from shardload.readers.mlc import MLCCheckpoint, open_mlc

INDEX = "tensor-cache.json"


# ----------------------------------------------------------------------------------------------
# helpers


def to_torch(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))  # keeps 0-d


def load_index(folder: Path, name: str = INDEX) -> dict:
    return json.loads((folder / name).read_text())


def save_index(folder: Path, doc: dict, name: str = INDEX) -> None:
    (folder / name).write_text(json.dumps(doc))


def sample_tensors() -> dict:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    return {
        "f16": rng.standard_normal((3, 5)).astype(np.float16),
        "bf16": torch.randn(4, 2, 3, generator=g).bfloat16(),
        "f32_3d": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "f32_scalar": np.array(1.5, np.float32),
        "f32_empty": np.empty((0, 3), np.float32),
        "f64": rng.standard_normal(5),
        "i8": rng.integers(-128, 128, 7, dtype=np.int8),
        "u8": rng.integers(0, 256, (2, 9), dtype=np.uint8),
        "i16": rng.integers(-1000, 1000, 3, dtype=np.int16),
        "u16": rng.integers(0, 2**16, (2, 2), dtype=np.uint16),
        "i32": rng.integers(-(2**31), 2**31 - 1, (4, 4), dtype=np.int32),
        "u32": rng.integers(0, 2**32, (6, 4), dtype=np.uint32),
        "i64": rng.integers(-(2**62), 2**62, (3, 1, 2), dtype=np.int64),
        "u64": rng.integers(0, 2**63, 3, dtype=np.uint64),
        "fp8": torch.randn(6, 2, generator=g).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(3, generator=g).to(torch.float8_e5m2),
        "bool": rng.standard_normal((2, 5)) > 0,
        "bool_empty": np.empty((2, 0), bool),
        "nan": np.array([np.nan, -np.inf, np.inf, -0.0], np.float32),
    }


@pytest.fixture
def sample_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model-q4f16_1-MLC"
    write_mlc_folder(
        folder,
        sample_tensors(),
        shard_bytes=128,
        align=16,
        pad_byte=0xEE,
        config={"model_type": "llama", "quantization": "q4f16_1", "tensor_parallel_shards": 1},
    )
    return folder


# ----------------------------------------------------------------------------------------------
# good folders


def test_round_trip_many_dtypes(sample_folder: Path) -> None:
    tensors = sample_tensors()
    doc = load_index(sample_folder)
    assert len(doc["records"]) > 3  # several shards, and gaps (align 16) inside them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable buffer" warning
        with open_mlc(sample_folder) as ckpt:
            assert isinstance(ckpt, MLCCheckpoint)
            assert ckpt.source == str(sample_folder)
            assert ckpt.path == os.path.abspath(sample_folder)
            assert ckpt.names() == list(tensors)  # the writer stores them in dict order
            assert ckpt.files == [str(sample_folder / s["dataPath"]) for s in doc["records"]]
            for name, value in tensors.items():
                want = to_torch(value)
                got = ckpt.read(name)
                assert same(got, want), name
                assert got.is_contiguous() and got.device.type == "cpu"
                assert ckpt.meta(name) == TensorMeta(
                    name, tuple(want.shape), str(want.dtype).removeprefix("torch.")
                )
                assert ckpt.tensor_format(name) == {"mlc_format": "raw"}
            assert ckpt.bytes_read == sum(
                to_torch(v).numel() * to_torch(v).element_size() for v in tensors.values()
            )
            config = ckpt.config
            assert config["quantization"] == "q4f16_1"
            assert config["tensor_cache_metadata"] == doc["metadata"]
            config["quantization"] = "changed"  # a copy: the checkpoint's stays as it was
            assert ckpt.config["quantization"] == "q4f16_1"
            # locate points at the tensor's bytes in its shard file
            index, begin, end = ckpt.locate("u32")
            file = ckpt.files[index]
            raw = Path(file).read_bytes()[begin:end]
            assert raw == tensors["u32"].astype("<u4").tobytes()
            assert ckpt.md5sums[file] is not None


def test_open_checkpoint_dispatches_and_reopens_by_path(sample_folder: Path) -> None:
    ckpt = open_checkpoint(sample_folder)
    assert isinstance(ckpt, MLCCheckpoint)
    again = open_checkpoint(ckpt.path)
    assert isinstance(again, MLCCheckpoint) and again.names() == ckpt.names()
    assert "u32" in ckpt and len(ckpt) == len(sample_tensors())
    ckpt.close()
    again.close()


def test_config_without_chat_config(tmp_path: Path) -> None:
    write_mlc_folder(tmp_path, {"w": np.ones(4, np.float16)}, metadata={"ParamSize": 1})
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.config == {"tensor_cache_metadata": {"ParamSize": 1}}


def test_index_without_metadata_key(tmp_path: Path) -> None:
    write_mlc_folder(tmp_path, {"w": np.ones(4, np.float16)})
    doc = load_index(tmp_path)
    del doc["metadata"]
    save_index(tmp_path, doc)
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.config == {"tensor_cache_metadata": {}}


def test_older_index_name(tmp_path: Path) -> None:
    tensors = {"a": np.arange(6, dtype=np.uint32).reshape(2, 3), "b": np.ones(3, np.float16)}
    write_mlc_folder(tmp_path, tensors, index_name="ndarray-cache.json")
    assert not (tmp_path / INDEX).exists()
    with open_checkpoint(tmp_path) as ckpt:
        assert isinstance(ckpt, MLCCheckpoint)
        assert ckpt.index_file == str(tmp_path / "ndarray-cache.json")
        for name, value in tensors.items():
            assert same(ckpt.read(name), to_torch(value))


def test_new_index_name_preferred(tmp_path: Path) -> None:
    write_mlc_folder(tmp_path, {"a": np.ones(2, np.float16)})
    (tmp_path / "ndarray-cache.json").write_text("not json at all")  # a stale leftover
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.index_file == str(tmp_path / INDEX)
        assert ckpt.names() == ["a"]


def test_storage_order_follows_shards_then_offsets(tmp_path: Path) -> None:
    tensors = {f"t{i}": np.full(4, i, np.int32) for i in range(6)}
    write_mlc_folder(tmp_path, tensors, shard_bytes=48)  # three tensors per shard
    doc = load_index(tmp_path)
    assert [len(s["records"]) for s in doc["records"]] == [3, 3]
    doc["records"].reverse()  # shard order is the index's order...
    for s in doc["records"]:
        s["records"].reverse()  # ...but within a shard, byte order rules
    save_index(tmp_path, doc)
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.names() == ["t3", "t4", "t5", "t0", "t1", "t2"]
        for name, value in tensors.items():
            assert same(ckpt.read(name), to_torch(value))


def test_f32_to_bf16_records(tmp_path: Path) -> None:
    """MLC labels every record "f32-to-bf16"; only float32 ones are stored as bfloat16 bits."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    w[0, :4] = [1e-40, np.float32(3.3895314e38), -np.inf, 0.0]  # subnormal, near the top, inf
    q = rng.integers(0, 2**32, (8, 2), dtype=np.uint32)
    s = rng.standard_normal((8, 1)).astype(np.float16)
    write_mlc_folder(
        tmp_path, {"norm": w, "q_weight": q, "q_scale": s}, encode_format="f32-to-bf16", align=4
    )
    rec = load_index(tmp_path)["records"][0]["records"][0]
    assert (rec["dtype"], rec["format"], rec["nbytes"]) == ("float32", "f32-to-bf16", 8 * 16 * 2)
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.meta("norm") == TensorMeta("norm", (8, 16), "bfloat16")
        assert ckpt.meta("q_weight").dtype == "uint32"
        assert ckpt.meta("q_scale").dtype == "float16"
        for name in ckpt:
            assert ckpt.tensor_format(name) == {"mlc_format": "f32-to-bf16"}
        norm = ckpt.read("norm")
        # the stored bits, which torch's own round-to-nearest-even conversion agrees with
        assert np.array_equal(norm.view(torch.int16).numpy().view(np.uint16), f32_to_bf16_bits(w))
        assert same(norm, torch.from_numpy(w).to(torch.bfloat16))
        assert same(ckpt.read_narrow("norm", 1, 4, 8), torch.from_numpy(w[:, 4:12]).bfloat16())
        assert same(ckpt.read("q_weight"), torch.from_numpy(q))
        assert same(ckpt.read("q_scale"), torch.from_numpy(s))


def test_f32_to_bf16_bits_clips_like_tvm() -> None:
    top = np.finfo(np.float32).max  # rounds past the largest bfloat16: TVM truncates instead
    bits = f32_to_bf16_bits(np.array([top, -top, 1.0, np.nan], np.float32))
    assert [hex(b) for b in bits[:3]] == ["0x7f7f", "0xff7f", "0x3f80"]
    assert (bits[3] & 0x7F80) == 0x7F80 and (bits[3] & 0x7F) != 0  # still a NaN


def test_zero_size_tensors_and_an_empty_shard(tmp_path: Path) -> None:
    write_mlc_folder(tmp_path, {"e1": np.empty((0, 4), np.float16), "e2": np.empty(0, np.int8)})
    assert (tmp_path / "params_shard_0.bin").stat().st_size == 0
    with open_mlc(tmp_path) as ckpt:
        assert same(ckpt.read("e1"), torch.empty(0, 4, dtype=torch.float16))
        assert same(ckpt.read_narrow("e1", 1, 1, 2), torch.empty(0, 2, dtype=torch.float16))
        assert ckpt.bytes_read == 0


def test_zero_size_tensor_may_sit_inside_another(tmp_path: Path) -> None:
    write_mlc_folder(tmp_path, {"a": np.arange(8, dtype=np.int32), "e": np.empty(0, np.int32)})
    doc = load_index(tmp_path)
    doc["records"][0]["records"][1]["byteOffset"] = 8  # inside a's bytes: it holds none
    save_index(tmp_path, doc)
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.read("e").shape == (0,)


def test_shard_may_be_a_symlink_to_anywhere(tmp_path: Path) -> None:
    # names are checked by name; where the user's file system keeps the bytes (the hub cache's
    # blobs/) is not the checkpoint's business
    folder = base_folder(tmp_path / "m")
    outside = tmp_path / "blobs" / "0123abcd"
    outside.parent.mkdir()
    (folder / "params_shard_1.bin").rename(outside)
    (folder / "params_shard_1.bin").symlink_to(os.path.relpath(outside, folder))
    with open_mlc(folder) as ckpt, open_mlc(base_folder(tmp_path / "plain")) as plain:
        for name in plain.names():
            assert same(ckpt.read(name), plain.read(name))


def test_shard_in_a_subfolder_and_symlinks_inside_the_folder(tmp_path: Path) -> None:
    write_mlc_folder(
        tmp_path, {"a": np.arange(4, dtype=np.int16), "b": np.ones(3, np.float32)}, shard_bytes=8
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "params_shard_0.bin").rename(tmp_path / "sub" / "s0.bin")
    (tmp_path / "link.bin").symlink_to(tmp_path / "params_shard_1.bin")
    doc = load_index(tmp_path)
    doc["records"][0]["dataPath"] = "sub/s0.bin"
    doc["records"][1]["dataPath"] = "link.bin"
    save_index(tmp_path, doc)
    with open_mlc(tmp_path) as ckpt:
        assert same(ckpt.read("a"), torch.arange(4, dtype=torch.int16))
        assert same(ckpt.read("b"), torch.ones(3))


def test_unaligned_offsets(tmp_path: Path) -> None:
    tensors = {
        "pad": np.zeros(3, np.uint8),
        "f64": np.linspace(0, 1, 7),
        "u32": np.arange(5, dtype=np.uint32),
    }
    write_mlc_folder(tmp_path, tensors)
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.locate("f64")[1] == 3
        for name, value in tensors.items():
            assert same(ckpt.read(name), to_torch(value))
        assert same(ckpt.read_narrow("f64", 0, 2, 3), torch.from_numpy(tensors["f64"][2:5]))


# ----------------------------------------------------------------------------------------------
# read_narrow


_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.uint32,
]
_counter = itertools.count()


@settings(max_examples=50, deadline=None)
@given(case=narrow_cases(_DTYPES), pad=st.integers(0, 7), align=st.sampled_from([1, 8, 64]))
def test_read_narrow_property(tmp_path_factory, case, pad, align) -> None:
    shape, dtype, dim, start, length = case
    itemsize = torch.empty(0, dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    t = torch.randint(0, high, (*shape, itemsize), dtype=torch.uint8).view(dtype).reshape(shape)
    folder = tmp_path_factory.getbasetemp() / f"narrow{next(_counter)}"
    # a tensor in front (and the alignment) moves t to offsets that need not be aligned
    write_mlc_folder(
        folder, {"pad": torch.zeros(pad, dtype=torch.uint8), "t": t}, align=align, pad_byte=0xA5
    )
    with open_mlc(folder) as ckpt:
        piece = ckpt.read_narrow("t", dim, start, length)
        want = t.narrow(dim, start, length)
        assert same(piece, want)
        assert piece.is_contiguous()
        assert ckpt.bytes_read == want.numel() * want.element_size()


def test_read_narrow_every_dim(sample_folder: Path) -> None:
    with open_mlc(sample_folder) as ckpt:
        for name, meta in ckpt.metadata().items():
            full = ckpt.read(name)
            for dim, size in enumerate(meta.shape):
                for start, length in [
                    (0, size),
                    (size, 0),
                    (size // 2, size - size // 2),
                    (1, max(size - 2, 0)),
                ]:
                    if start + length > size:
                        continue
                    before = ckpt.bytes_read
                    piece = ckpt.read_narrow(name, dim, start, length)
                    assert same(piece, full.narrow(dim, start, length)), (name, dim, start)
                    assert ckpt.bytes_read - before == piece.numel() * piece.element_size()


def test_read_narrow_refuses_bad_arguments(sample_folder: Path) -> None:
    with open_mlc(sample_folder) as ckpt:  # f16 is (3, 5)
        with pytest.raises(IndexError, match="dim 2 is out of range"):
            ckpt.read_narrow("f16", 2, 0, 1)
        with pytest.raises(IndexError, match="dim 0 is out of range"):
            ckpt.read_narrow("f32_scalar", 0, 0, 1)
        with pytest.raises(IndexError, match="start 6 is out of range"):
            ckpt.read_narrow("f16", 1, 6, 0)
        with pytest.raises(ValueError, match="cannot take 3 elements from 1"):
            ckpt.read_narrow("f16", 0, 1, 3)
        with pytest.raises(ValueError, match="cannot take -1"):
            ckpt.read_narrow("f16", 0, 0, -1)
        with pytest.raises(TypeError):
            ckpt.read_narrow("f16", 0, 0.5, 1)
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            ckpt.read("nope")
        assert ckpt.bytes_read == 0


def test_concurrent_reads_count_every_byte(sample_folder: Path) -> None:
    expected = {k: to_torch(v) for k, v in sample_tensors().items()}
    errors: list[BaseException] = []
    with open_mlc(sample_folder) as ckpt:

        def work() -> None:
            try:
                for _ in range(10):
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
        assert ckpt.bytes_read == 8 * 10 * per_round


def test_tensors_outlive_close_and_reading_after_close_raises(sample_folder: Path) -> None:
    expected = {k: to_torch(v) for k, v in sample_tensors().items()}
    ckpt = open_mlc(sample_folder)
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


def test_close_while_a_read_is_in_flight(sample_folder: Path, monkeypatch) -> None:
    expected = to_torch(sample_tensors()["f32_3d"])  # 96 bytes
    check_close_while_a_read_is_in_flight(
        open_mlc(sample_folder), "f32_3d", expected, same, monkeypatch
    )


def test_writes_to_a_read_tensor_do_not_reach_the_file(sample_folder: Path) -> None:
    before = {p.name: p.read_bytes() for p in sample_folder.glob("*.bin")}
    expected = to_torch(sample_tensors()["u8"])  # [2, 9]
    with open_mlc(sample_folder) as ckpt:
        # whatever a read returns owns its memory: writing to it changes neither the mapping
        # (the next read sees the stored bytes) nor the file
        for t in (
            ckpt.read("u8"),
            ckpt.read_narrow("u8", 1, 2, 5),
            ckpt.read_ranges("u8", 1, [(0, 2), (6, 3)]),
        ):
            t.fill_(7)
        assert same(ckpt.read("u8"), expected)
        assert same(ckpt.read_narrow("u8", 1, 2, 5), expected[:, 2:7])
    assert {p.name: p.read_bytes() for p in sample_folder.glob("*.bin")} == before


# ----------------------------------------------------------------------------------------------
# q4f16_1


def test_pack_order_is_lsb_first_along_k() -> None:
    codes = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 15, 14, 13, 12, 11, 10, 9, 8]], np.uint8)
    words = pack_int4(codes)
    assert words.dtype == np.uint32 and words.shape == (1, 2)
    assert [hex(w) for w in words[0]] == ["0x76543210", "0x89abcdef"]
    assert np.array_equal(unpack_int4(words), codes)


def test_quantize_known_values() -> None:
    # a row whose values sit exactly on the grid of scale 0.5: codes are w / 0.5 + 7
    steps = np.array(list(range(-7, 8)) * 3)[:32]
    w = (steps * 0.5).astype(np.float32)[None, :]
    q, s = quantize_q4f16_1(w)
    assert q.shape == (1, 4) and s.shape == (1, 1) and s.dtype == np.float16
    assert s[0, 0] == np.float16(0.5)
    assert np.array_equal(unpack_int4(q)[0], (steps + 7).astype(np.uint8))
    assert np.array_equal(dequantize_q4f16_1(q, s), w)
    # an all-zero group: scale 0, codes 7, dequantizes to 0
    q0, s0 = quantize_q4f16_1(np.zeros((2, 32), np.float32))
    assert np.all(s0 == 0) and np.all(unpack_int4(q0) == 7)
    assert np.array_equal(dequantize_q4f16_1(q0, s0), np.zeros((2, 32), np.float32))


def test_quantize_error_bound_and_code_range() -> None:
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((16, 96)) * rng.uniform(0.01, 3, (16, 1))).astype(np.float32)
    q, s = quantize_q4f16_1(w)
    codes = unpack_int4(q)
    assert codes.max() <= 14 and codes.min() >= 0
    # the largest |w| of each group maps to code 0 or 14
    g = np.abs(w.astype(np.float16).astype(np.float32)).reshape(16, 3, 32)
    at_max = np.take_along_axis(codes.reshape(16, 3, 32), g.argmax(-1)[..., None], -1)
    assert np.all((at_max == 0) | (at_max == 14))
    err = np.abs(dequantize_q4f16_1(q, s) - w)
    half_step = np.repeat(s.astype(np.float32), 32, axis=1) / 2
    assert np.all(err <= half_step * 1.01 + 1e-3 * np.abs(w))  # + float16 rounding of w


def test_quantize_pads_a_partial_group() -> None:
    w = np.random.default_rng(3).standard_normal((4, 40)).astype(np.float32)
    q, s = quantize_q4f16_1(w)
    assert q.shape == (4, 8) and s.shape == (4, 2)
    assert np.all(unpack_int4(q)[:, 40:] == 0)  # padding codes are 0, as MLC packs them
    # the second group's scale covers its 8 real elements only
    w16 = w.astype(np.float16)
    assert np.array_equal(s[:, 1], (np.abs(w16[:, 32:]).max(1) / np.float16(7)).astype(np.float16))
    assert dequantize_q4f16_1(q, s, k=40).shape == (4, 40)


def test_q4f16_1_through_the_reader(tmp_path: Path) -> None:
    n, k = 48, 256  # 8 groups, 32 words per row
    rng = np.random.default_rng(4)
    w = rng.standard_normal((n, k)).astype(np.float32)
    q_weight, q_scale = quantize_q4f16_1(w)
    assert q_weight.shape == (n, k // 8) and q_weight.dtype == np.uint32
    assert q_scale.shape == (n, k // 32) and q_scale.dtype == np.float16
    prefix = "model.layers.0.self_attn.qkv_proj"
    write_mlc_folder(
        tmp_path,
        {f"{prefix}.q_weight": q_weight, f"{prefix}.q_scale": q_scale},
        shard_bytes=4096,
        align=64,
        encode_format="f32-to-bf16",
        config={"quantization": "q4f16_1"},
    )
    reference = dequantize_q4f16_1(q_weight, q_scale)
    with open_mlc(tmp_path) as ckpt:
        assert ckpt.meta(f"{prefix}.q_weight") == TensorMeta(
            f"{prefix}.q_weight", (n, k // 8), "uint32"
        )
        qw = ckpt.read(f"{prefix}.q_weight")
        qs = ckpt.read(f"{prefix}.q_scale")
        assert np.array_equal(dequantize_q4f16_1(qw.numpy(), qs.numpy()), reference)
        # K splits on group boundaries (a, b in words, multiples of 4) are exact
        for a, b in [(0, 4), (4, 12), (12, 32), (0, 32), (28, 32)]:
            before = ckpt.bytes_read
            qw_part = ckpt.read_narrow(f"{prefix}.q_weight", 1, a, b - a)
            qs_part = ckpt.read_narrow(f"{prefix}.q_scale", 1, a // 4, (b - a) // 4)
            assert ckpt.bytes_read - before == n * (b - a) * 4 + n * (b - a) // 4 * 2
            assert np.array_equal(
                dequantize_q4f16_1(qw_part.numpy(), qs_part.numpy()), reference[:, 8 * a : 8 * b]
            )
        # N splits (rows) are exact at any row
        for r0, r1 in [(0, 16), (16, 48), (5, 6)]:
            qw_rows = ckpt.read_narrow(f"{prefix}.q_weight", 0, r0, r1 - r0)
            qs_rows = ckpt.read_narrow(f"{prefix}.q_scale", 0, r0, r1 - r0)
            assert np.array_equal(
                dequantize_q4f16_1(qw_rows.numpy(), qs_rows.numpy()), reference[r0:r1]
            )


# ----------------------------------------------------------------------------------------------
# bad folders


def base_folder(folder: Path) -> Path:
    """shard 0: a (f16 [4, 8], 64 B) at 0, b (u32 [4, 2], 32 B) at 64; shard 1: c (f32 [3]) at 0,
    d (i8 [5]) at 16."""
    write_mlc_folder(
        folder,
        {
            "a": np.ones((4, 8), np.float16),
            "b": np.arange(8, dtype=np.uint32).reshape(4, 2),
            "c": np.ones(3, np.float32),
            "d": np.ones(5, np.int8),
        },
        shard_bytes=100,
        align=16,
        config={"model_type": "llama"},
    )
    return folder


def edit(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    """A defect made by editing the parsed index."""

    def apply(folder: Path) -> None:
        doc = load_index(folder)
        fn(doc)
        save_index(folder, doc)

    return apply


def text(s: str, name: str = INDEX) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        (folder / name).write_text(s)

    return apply


def shard(i: int, **changes) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        doc["records"][i].update(changes)

    return fn


def tensor(i: int, j: int, **changes) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        doc["records"][i]["records"][j].update(changes)

    return fn


def drop(i: int, j: int | None, key: str) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        rec = doc["records"][i] if j is None else doc["records"][i]["records"][j]
        del rec[key]

    return fn


def resize(name: str, delta: int) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(
            data[: len(data) + delta] if delta < 0 else data + b"\0" * delta
        )

    return apply


def _set(path: list, value) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        obj = doc
        for p in path[:-1]:
            obj = obj[p]
        obj[path[-1]] = value

    return fn


# (defect, file to blame: "index" | a shard file name | "config", tensor, phrase)
BAD = {
    "not json": (text("{"), "index", None, "not valid JSON"),
    "duplicate key": (text('{"records": [], "records": []}'), "index", None, "duplicate key"),
    "nan": (text('{"metadata": {"x": NaN}, "records": []}'), "index", None, "NaN"),
    "not utf-8": (
        lambda f: (f / INDEX).write_bytes(b'{"records": [], "metadata": {"\xff": 1}}'),
        "index",
        None,
        "UTF-8",
    ),
    "top is a list": (text("[]"), "index", None, "must be a JSON object"),
    "no records": (text('{"metadata": {}}'), "index", None, "missing ['records']"),
    "unknown top key": (edit(_set(["extra"], 1)), "index", None, "unexpected ['extra']"),
    "metadata not object": (edit(_set(["metadata"], [1])), "index", None, '"metadata" must be'),
    "records not list": (edit(_set(["records"], {})), "index", None, '"records" must be a list'),
    "shard not object": (edit(_set(["records", 1], "x")), "index", None, "must be an object"),
    "shard no dataPath": (edit(drop(1, None, "dataPath")), "index", None, "missing ['dataPath']"),
    "shard unknown key": (
        edit(shard(0, compression="zstd")),
        "index",
        None,
        "unexpected ['compression']",
    ),
    "shard format": (
        edit(shard(0, format="zip-shard")),
        "index",
        None,
        "unknown shard format 'zip-shard'",
    ),
    "shard nbytes bool": (edit(shard(0, nbytes=True)), "index", None, "nbytes must be"),
    "shard md5 not str": (edit(shard(0, md5sum=5)), "index", None, "md5sum must be a string"),
    "shard records not list": (
        edit(shard(0, records={})),
        "index",
        None,
        '"records" must be a list of tensor records',
    ),
    "tensor not object": (
        edit(_set(["records", 0, "records", 1], [])),
        "index",
        None,
        "tensor record must be an object",
    ),
    "tensor no byteOffset": (
        edit(drop(0, 1, "byteOffset")),
        "index",
        "b",
        "missing ['byteOffset']",
    ),
    "tensor unknown key": (edit(tensor(0, 1, strides=[1])), "index", "b", "unexpected ['strides']"),
    "tensor name empty": (edit(tensor(0, 0, name="")), "index", "", "non-empty string"),
    "tensor name int": (edit(tensor(0, 0, name=3)), "index", None, "non-empty string"),
    "shape negative": (edit(tensor(0, 1, shape=[-4, 2])), "index", "b", "shape must be"),
    "shape bool": (edit(tensor(0, 1, shape=[True, 8])), "index", "b", "shape must be"),
    "shape not list": (edit(tensor(0, 1, shape=8)), "index", "b", "shape must be"),
    "dtype unknown": (edit(tensor(0, 1, dtype="int4")), "index", "b", "unknown dtype 'int4'"),
    "dtype alias": (edit(tensor(0, 0, dtype="half")), "index", "a", "unknown dtype 'half'"),
    "format unknown": (edit(tensor(0, 1, format="zstd")), "index", "b", "unknown format 'zstd'"),
    "nbytes lies": (edit(tensor(0, 1, nbytes=31)), "index", "b", "lies about the size"),
    "nbytes vs shape": (edit(tensor(0, 1, shape=[4, 3])), "index", "b", "lies about the size"),
    "f32-to-bf16 nbytes": (
        edit(tensor(1, 0, format="f32-to-bf16")),
        "index",
        "c",
        "stored as bfloat16",
    ),
    "offset negative": (edit(tensor(0, 1, byteOffset=-1)), "index", "b", "byteOffset must be"),
    "past the end": (edit(tensor(1, 1, byteOffset=30)), "index", "d", "runs past the end"),
    "overlap": (edit(tensor(0, 1, byteOffset=48)), "index", "b", "overlap tensor 'a'"),
    "duplicate in shard": (edit(tensor(0, 1, name="a")), "index", "a", "listed twice"),
    "duplicate across shards": (edit(tensor(1, 1, name="a")), "index", "a", "listed twice"),
    "absolute path": (edit(shard(1, dataPath="/etc/passwd")), "index", None, "absolute path"),
    "dotdot": (
        edit(shard(1, dataPath="../params_shard_1.bin")),
        "index",
        None,
        "has a '..' component",
    ),
    "dotdot inside": (
        edit(shard(1, dataPath="sub/../params_shard_1.bin")),
        "index",
        None,
        "has a '..' component",
    ),
    "drive letter": (
        edit(shard(1, dataPath="C:params_shard_1.bin")),
        "index",
        None,
        "drive letter",
    ),
    "backslash": (edit(shard(1, dataPath="sub\\params_shard_1.bin")), "index", None, "backslash"),
    "empty path": (edit(shard(1, dataPath="")), "index", None, "is empty"),
    "nul in path": (edit(shard(1, dataPath="params\x00.bin")), "index", None, "NUL"),
    "path is folder": (edit(shard(1, dataPath=".")), "index", None, "names the folder itself"),
    "path is a subfolder": (
        lambda f: ((f / "sub").mkdir(), edit(shard(1, dataPath="sub"))(f)),
        "sub",
        None,
        "is a directory, not a regular file",
    ),
    "path not str": (edit(shard(1, dataPath=["x"])), "index", None, "dataPath must be a string"),
    "name too long": (
        edit(shard(1, dataPath="a" * 6000)),
        "index",
        None,
        "is 6000 characters long (at most 1024)",
    ),
    "file listed twice": (
        edit(shard(1, dataPath="params_shard_0.bin")),
        "index",
        None,
        "names the same file as shard record 0",
    ),
    "missing shard": (
        lambda f: (f / "params_shard_1.bin").unlink(),
        "params_shard_1.bin",
        None,
        "shard file is missing",
    ),
    "truncated shard": (resize("params_shard_1.bin", -1), "params_shard_1.bin", None, "truncated"),
    "appended shard": (
        resize("params_shard_0.bin", 3),
        "params_shard_0.bin",
        None,
        "longer than listed",
    ),
    "config not json": (text("{", "mlc-chat-config.json"), "config", None, "not valid JSON"),
    "config not object": (
        text("[1]", "mlc-chat-config.json"),
        "config",
        None,
        "must be a JSON object",
    ),
}


@pytest.mark.parametrize("defect", list(BAD))
def test_bad_folder(tmp_path: Path, defect: str) -> None:
    make, blame, tensor_name, phrase = BAD[defect]
    folder = base_folder(tmp_path / "m")
    make(folder)
    with pytest.raises(FormatError) as info:
        open_mlc(folder)
    err = info.value
    assert phrase in str(err), str(err)
    want_file = {"index": folder / INDEX, "config": folder / "mlc-chat-config.json"}.get(
        blame, folder / blame
    )
    assert err.file == str(want_file), str(err)
    assert err.tensor == tensor_name, str(err)
    if tensor_name:
        assert f"tensor {tensor_name!r}" in str(err)


def test_the_base_folder_is_good(tmp_path: Path) -> None:
    folder = base_folder(tmp_path / "m")
    doc = load_index(folder)
    assert [[(r["name"], r["byteOffset"]) for r in s["records"]] for s in doc["records"]] == [
        [("a", 0), ("b", 64)],
        [("c", 0), ("d", 16)],
    ]
    with open_mlc(folder) as ckpt:
        assert ckpt.names() == ["a", "b", "c", "d"]


def test_not_an_mlc_folder(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="neither tensor-cache.json nor ndarray-cache.json") as e:
        open_mlc(tmp_path)
    assert e.value.file == str(tmp_path)
    with pytest.raises(FormatError, match="no such file") as e:
        open_mlc(tmp_path / "missing")
    assert e.value.file == str(tmp_path / "missing")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(FormatError, match="is a folder") as e:
        open_mlc(tmp_path / "x.bin")
    assert e.value.file == str(tmp_path / "x.bin")


def test_a_failed_open_leaves_no_mapping_behind(tmp_path: Path, monkeypatch) -> None:
    folder = base_folder(tmp_path / "m")
    resize("params_shard_1.bin", -1)(folder)
    from shardload.sources.bytesource import MappedFile

    closed: list = []
    real_close = MappedFile.close

    def close(source: MappedFile) -> None:
        mapping = source.map
        real_close(source)
        closed.append(mapping)

    monkeypatch.setattr(MappedFile, "close", close)
    with pytest.raises(FormatError, match="truncated"):
        open_mlc(folder)
    # shard 0 was mapped, then unmapped, and the truncated shard, mapped to be sized
    assert len(closed) == 2 and all(m is None or m.closed for m in closed)
