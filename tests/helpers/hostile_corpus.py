"""A deterministic corpus of hostile (and a few legitimate) inputs for ``test_hostile_inputs.py``.

Not a test module. Each ``Case`` builds its files in a fresh folder and says what shardload must
answer: ``"refused"`` (exit 2 and one line from the CLI, a ``FormatError`` or ``PlanError`` from
the API) or ``"ok"`` (a legitimate input that must load). ``mentions`` are fragments the refusal
must contain (the file, the key, the value found), so a case cannot pass by failing for another
reason.

The classes follow the issue that asked for them (real-world inputs): file-system layouts, headers
that lie, config and metadata fields of the wrong type or range, metadata that disagrees with the
tensors, resource bombs, hostile plans. Bytes are written by hand (safetensors, index, plan) or
by the producing library and then patched (gguf-py's GGUFWriter, the MLC reference writer), so
the corpus is independent of the readers under test.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from .gguf_blocks import blocks
from .mlc_reference import quantize_q4f16_1, write_mlc_folder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_llama_q4"


@dataclass
class Target:
    """What a case hands shardload: a checkpoint path, and a plan file (``None``: the plan beside
    the checkpoint, or the planner)."""

    ckpt: str
    plan: str | None = None
    shards: int = 2


@dataclass(frozen=True)
class Case:
    id: str
    klass: str  # the input class (the README's table groups by it)
    build: Callable[[Path], Target]
    expect: str = "refused"
    mentions: tuple[str, ...] = ()
    commands: tuple[str, ...] = ("validate", "inspect", "load", "api")
    # Bounds per command. time_s is CPU seconds of the test process (all its threads), not wall
    # time: a busy machine stretches wall time, not the work done; a hang is caught apart, by a
    # wall-clock watchdog HANG_FACTOR times as long (test_hostile_inputs._bounded). Measured on
    # 2 shared cores: every case with the defaults needs under 0.02 s CPU and 3 MB.
    time_s: float = 20.0
    mem_mb: int = 768  # peak resident growth
    slow: bool = False  # marked slow: out of the fast subset


CASES: list[Case] = []


def case(
    id: str,
    klass: str,
    build: Callable[[Path], Target],
    expect: str = "refused",
    mentions: tuple[str, ...] = (),
    **kw: Any,
) -> None:
    CASES.append(Case(id, klass, build, expect, tuple(mentions), **kw))


# ==== safetensors, written by hand ================================================================

ST_DTYPES = {"F32": np.float32, "I32": np.int32, "F16": np.float16}


def st_header(entries: dict[str, tuple[str, list[int], bytes]]) -> tuple[dict, bytes]:
    """A header dict and data for ``{name: (dtype, shape, bytes)}``, tensors in order."""
    header, data, pos = {}, b"", 0
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        data += raw
        pos += len(raw)
    return header, data


def st_file(
    path: Path,
    header: Any,
    data: bytes,
    *,
    raw_header: bytes | None = None,
    length: int | None = None,
) -> Path:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


A = np.arange(32, dtype=np.float32).reshape(4, 8)
B = np.arange(32, dtype=np.int32).reshape(8, 4)
BASE_ENTRIES = {"a": ("F32", [4, 8], A.tobytes()), "b": ("I32", [8, 4], B.tobytes())}
BASE_PLAN = {
    "a": [["shardload.split", [["num_shards", "4 // num_shards", 8], "float32"], 0]],
    "b": [["shardload.split", [["num_shards", 8, "4 // num_shards"], "int32"], 1]],
}


def st_base(
    d: Path,
    header_edit: Callable[[dict], None] | None = None,
    *,
    data_edit: Callable[[bytes], bytes] | None = None,
    raw_header: bytes | None = None,
    length: int | None = None,
    plan: Any = BASE_PLAN,
) -> Target:
    header, data = st_header(BASE_ENTRIES)
    if header_edit:
        header_edit(header)
    if data_edit:
        data = data_edit(data)
    st_file(d / "model.safetensors", header, data, raw_header=raw_header, length=length)
    if plan is not None:
        (d / "shard_info.json").write_text(json.dumps(plan))
    return Target(str(d / "model.safetensors"), str(d / "shard_info.json") if plan else None)


def _entry(name: str, **changes: Any) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h[name].update(changes)

    return edit


def _extra(name: str, dtype: str, shape: list, offsets: list) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}

    return edit


case("st-ok", "legitimate", lambda d: st_base(d), expect="ok")
for cid, kw, frag in [
    ("st-empty-file", dict(raw_header=b"", length=0), "model.safetensors"),
    ("st-header-len-zero", dict(length=0), "header length is 0"),
    ("st-header-len-huge", dict(length=2**64 - 1), "over the"),
    ("st-header-len-past-eof", dict(length=10**6), "runs past the end"),
    ("st-header-not-utf8", dict(raw_header=b'{"a\xff": 1}'), "UTF-8"),
    ("st-header-not-json", dict(raw_header=b"{not json"), "JSON"),
    ("st-header-array", dict(raw_header=b"[1, 2]"), "object"),
    ("st-header-nan", dict(raw_header=b'{"__metadata__": {"x": NaN}}'), "NaN"),
    ("st-header-deep", dict(raw_header=b"[" * 100000 + b"]" * 100000), "model.safetensors"),
]:
    case(cid, "safetensors header", lambda d, kw=kw: st_base(d, **kw), mentions=(frag,))

_dup = json.dumps({"a": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}})[1:-1]
case(
    "st-duplicate-name",
    "safetensors header",
    lambda d: st_base(d, raw_header=("{" + _dup + ", " + _dup + "}").encode()),
    mentions=("duplicate",),
)
case(
    "st-lone-surrogate-name",
    "safetensors header",
    lambda d: st_base(
        d,
        raw_header=json.dumps(
            {
                "\ud800x": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]},
                "b": {"dtype": "I32", "shape": [8, 4], "data_offsets": [128, 256]},
            }
        ).encode(),
        plan=None,
    ),
    mentions=("model.safetensors",),
)
case(
    "st-empty-name",
    "safetensors header",
    lambda d: st_base(d, lambda h: h.update({"": h.pop("a")}), plan=None),
    mentions=("model.safetensors",),
)

for cid, change, frag in [
    ("st-dtype-unknown", dict(dtype="F99"), "F99"),
    ("st-dtype-int", dict(dtype=7), "dtype"),
    ("st-shape-negative", dict(shape=[-4, 8]), "shape"),
    ("st-shape-string", dict(shape=["4", 8]), "shape"),
    ("st-shape-float", dict(shape=[4.0, 8]), "shape"),
    ("st-shape-bool", dict(shape=[True, 8]), "shape"),
    ("st-shape-wrong-size", dict(shape=[4, 9]), "bytes"),
    ("st-offsets-reversed", dict(data_offsets=[128, 0]), "data_offsets"),
    ("st-offsets-past-end", dict(data_offsets=[0, 10**6]), "data_offsets"),
    ("st-offsets-one", dict(data_offsets=[0]), "data_offsets"),
    ("st-offsets-huge", dict(data_offsets=[0, 2**64]), "data_offsets"),
    ("st-extra-key", dict(foo=1), "foo"),
]:
    case(
        cid,
        "safetensors header",
        lambda d, c=change: st_base(d, _entry("a", **c)),
        mentions=("model.safetensors", frag),
    )
case(
    "st-entry-not-object",
    "safetensors header",
    lambda d: st_base(d, lambda h: h.update(a=[1, 2])),
    mentions=("'a'",),
)
case(
    "st-missing-dtype",
    "safetensors header",
    lambda d: st_base(d, lambda h: h["a"].pop("dtype")),
    mentions=("dtype",),
)
for dim in (2**53 + 1, 2**63, 2**64, 10**30):
    case(
        f"st-zero-size-dim-{dim}",
        "pathological sizes",
        lambda d, dim=dim: st_base(d, _extra("z", "F32", [0, dim], [256, 256])),
        mentions=("model.safetensors", "'z'"),
    )
case(
    "st-overlap",
    "safetensors header",
    lambda d: st_base(d, _entry("b", data_offsets=[64, 192]), data_edit=lambda b: b[:192]),
    mentions=("overlap",),
)
case(
    "st-gap",
    "safetensors header",
    lambda d: st_base(d, _entry("b", data_offsets=[160, 288]), data_edit=lambda b: b + bytes(32)),
    mentions=("gap",),
)
case(
    "st-trailing-bytes",
    "safetensors header",
    lambda d: st_base(d, data_edit=lambda b: b + bytes(100)),
    mentions=("trailing",),
)
case(
    "st-truncated-data",
    "truncated file",
    lambda d: st_base(d, data_edit=lambda b: b[:200]),
    mentions=("truncated",),
)
case(
    "st-metadata-not-strings",
    "safetensors header",
    lambda d: st_base(d, lambda h: h.update(__metadata__={"x": 1})),
    mentions=("__metadata__",),
)
case(
    "st-metadata-inf",
    "safetensors header",
    lambda d: st_base(d, raw_header=b'{"__metadata__": {"x": 1e400}}', plan=None),
    mentions=("model.safetensors",),
)


def _many_zero_size(count: int) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        entries = ", ".join(
            f'"t{i}": {{"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}'
            for i in range(count)
        )
        st_file(d / "model.safetensors", None, b"", raw_header=("{" + entries + "}").encode())
        (d / "shard_info.json").write_text("{}")  # replicate them all
        return Target(str(d / "model.safetensors"))

    return build


# a header that passes the 100 MB cap must be processed in time linear in its size. Measured on
# 2 shared cores: validate 1.2 s CPU and 190 MB, api (the load of 200k tensors on 2 threads)
# 12-13 s CPU and 618 MB; the bounds are over 4 times that (quadratic in 200k would be hours).
case(
    "st-200k-zero-size-tensors",
    "resource bombs",
    _many_zero_size(200_000),
    expect="ok",
    commands=("validate", "api"),
    time_s=60,
    mem_mb=2560,
    slow=True,
)


# ==== file-system layouts =========================================================================


def _fifo(d: Path, name: str) -> Path:
    path = d / name
    os.mkfifo(path)
    return path


def _loop(d: Path, name: str) -> Path:
    path = d / name
    os.symlink(name, path)  # points at itself
    return path


def _as_checkpoint(kind: str) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        if kind == "fifo":
            return Target(str(_fifo(d, "model.safetensors")))
        if kind == "fifo-gguf":
            return Target(str(_fifo(d, "model.gguf")))
        if kind == "dev-zero":
            os.symlink("/dev/zero", d / "model.safetensors")
            return Target(str(d / "model.safetensors"))
        if kind == "dev-zero-gguf":
            os.symlink("/dev/zero", d / "model.gguf")
            return Target(str(d / "model.gguf"))
        if kind == "loop":
            return Target(str(_loop(d, "model.safetensors")))
        if kind == "dangling":
            os.symlink("nowhere.safetensors", d / "model.safetensors")
            return Target(str(d / "model.safetensors"))
        if kind == "dir-named-safetensors":
            (d / "model.safetensors").mkdir()
            return Target(str(d))
        raise AssertionError(kind)

    return build


for kind in (
    "fifo",
    "fifo-gguf",
    "dev-zero",
    "dev-zero-gguf",
    "loop",
    "dangling",
    "dir-named-safetensors",
):
    # click's Path(exists=True) may refuse a dangling link or loop first: also exit 2
    case(
        f"fs-checkpoint-{kind}",
        "file-system layout",
        _as_checkpoint(kind),
        time_s=10,
        mentions=("model.",) if kind != "dir-named-safetensors" else (),
    )


def _sharded(d: Path) -> dict:
    """Two safetensors files and their index; returns the index dict."""
    header_a, data_a = st_header({"a": BASE_ENTRIES["a"]})
    header_b, data_b = st_header({"b": BASE_ENTRIES["b"]})
    st_file(d / "model-00001-of-00002.safetensors", header_a, data_a)
    st_file(d / "model-00002-of-00002.safetensors", header_b, data_b)
    (d / "shard_info.json").write_text(json.dumps(BASE_PLAN))
    return {
        "metadata": {"total_size": 256},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }


def _index(
    edit: Callable[[Path, dict], Any] | None = None, *, raw: Callable[[dict], bytes] | None = None
) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        index = _sharded(d)
        if edit:
            edit(d, index)
        text = raw(index) if raw else json.dumps(index).encode()
        (d / "model.safetensors.index.json").write_bytes(text)
        return Target(str(d))

    return build


def _name_b(name: str) -> Callable[[Path, dict], None]:
    def edit(d: Path, index: dict) -> None:
        index["weight_map"]["b"] = name

    return edit


case("index-ok", "legitimate", _index(), expect="ok")
for cid, name in [
    ("absolute", "/etc/passwd"),
    ("dotdot", "../model.safetensors"),
    ("nul", "model\x00.safetensors"),
    ("long", "m" * 6000 + ".safetensors"),
    ("backslash", "sub\\model.safetensors"),
    ("drive", "C:model.safetensors"),
    ("empty", ""),
    ("only-dots", ".//."),
    ("missing", "model-00003-of-00003.safetensors"),
]:
    case(
        f"index-name-{cid}",
        "index file names",
        _index(_name_b(name)),
        mentions=("model.safetensors.index.json" if cid != "missing" else "model-00003",),
    )


def _b_is(kind: str) -> Callable[[Path, dict], None]:
    def edit(d: Path, index: dict) -> None:
        target = d / "model-00002-of-00002.safetensors"
        target.unlink()
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", target)
        elif kind == "loop":
            os.symlink(target.name, target)
        elif kind == "dir":
            target.mkdir()
        elif kind == "dangling":
            os.symlink("gone.bin", target)

    return edit


for kind in ("fifo", "dev-zero", "loop", "dir", "dangling"):
    case(
        f"index-file-is-{kind}",
        "file-system layout",
        _index(_b_is(kind)),
        time_s=10,
        mentions=("model-00002-of-00002.safetensors",),
    )


def _rename_b(name: str) -> Callable[[Path, dict], None]:
    def edit(d: Path, index: dict) -> None:
        (d / "model-00002-of-00002.safetensors").rename(d / name)
        index["weight_map"]["b"] = name

    return edit


def _symlink_outside(d: Path, index: dict) -> None:
    """The hub cache's shape: the file is a relative symlink to a blob outside the folder."""
    blobs = d.parent / (d.name + "-blobs")
    blobs.mkdir()
    target = d / "model-00002-of-00002.safetensors"
    shutil.move(target, blobs / "0123abcd")
    os.symlink(os.path.relpath(blobs / "0123abcd", d), target)


case("index-symlink-to-blob-outside", "legitimate", _index(_symlink_outside), expect="ok")
# what a path library normalises stays inside the folder
case(
    "index-name-dot-slash-ok",
    "legitimate",
    _index(_name_b("./model-00002-of-00002.safetensors")),
    expect="ok",
)
case(
    "index-name-unicode-ok",
    "legitimate",
    _index(_rename_b("modèle 2 – 双.safetensors")),
    expect="ok",
)
case(
    "index-weight-map-list",
    "index file",
    _index(lambda d, i: i.update(weight_map=[1])),
    mentions=("weight_map",),
)
case("index-weight-map-value-int", "index file", _index(_name_b(7)), mentions=("index",))
case(
    "index-tensor-in-wrong-file",
    "index file",
    _index(lambda d, i: i["weight_map"].update(b="model-00001-of-00002.safetensors")),
    mentions=("'b'",),
)
case(
    "index-unlisted-tensor",
    "index file",
    _index(lambda d, i: i["weight_map"].pop("b")),
    mentions=("'b'",),
)
case("index-not-json", "index file", _index(raw=lambda i: b"{nope"), mentions=("JSON",))
case(
    "index-utf16",
    "index file",
    _index(raw=lambda i: json.dumps(i).encode("utf-16")),
    mentions=("model.safetensors.index.json",),
)
case("index-not-object", "index file", _index(raw=lambda i: b"[]"), mentions=("object",))


def _huge_index(d: Path, index: dict) -> None:
    with open(d / "model.safetensors.index.json", "wb") as f:
        f.truncate(1_600_000_000)  # sparse: costs no disk, must not be read


def _build_huge_index(d: Path) -> Target:
    _sharded(d)
    _huge_index(d, {})
    return Target(str(d))


case("index-1.6GB", "resource bombs", _build_huge_index, mentions=("limit",), time_s=10, mem_mb=256)


# ==== HF configs: the planner's input (the example checkpoint, no plan) ===========================


def _hf(
    edit: Callable[[dict], Any] | None = None,
    *,
    raw: bytes | None = None,
    quantize_config: dict | None = None,
) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        os.symlink(EXAMPLE / "model.safetensors", d / "model.safetensors")
        config = json.loads((EXAMPLE / "config.json").read_text())
        if edit:
            edit(config)
        (d / "config.json").write_bytes(raw if raw is not None else json.dumps(config).encode())
        if quantize_config is not None:
            (d / "quantize_config.json").write_text(json.dumps(quantize_config))
        return Target(str(d))

    return build


def set_key(path: str, value: Any) -> Callable[[dict], None]:
    """Set ``a.b.c`` in a nested dict (``...`` as value deletes it)."""

    def edit(config: dict) -> None:
        *parents, key = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        if value is ...:
            node.pop(key, None)
        else:
            node[key] = value

    return edit


case("hf-ok", "legitimate", _hf(), expect="ok")
case("hf-no-head-dim-ok", "legitimate", _hf(set_key("head_dim", ...)), expect="ok")
case(
    "hf-quantize-config-json-ok",
    "legitimate",
    _hf(
        set_key("quantization_config", ...),
        quantize_config={"bits": 4, "group_size": 32, "desc_act": False, "sym": False},
    ),
    expect="ok",
)
Q = "quantization_config"
for cid, path, value in [
    ("bits-null", f"{Q}.bits", None),
    ("bits-list", f"{Q}.bits", [4]),
    ("bits-string", f"{Q}.bits", "four"),
    ("bits-5", f"{Q}.bits", 5),
    ("bits-bool", f"{Q}.bits", True),
    ("bits-float", f"{Q}.bits", 4.0),
    ("group-string", f"{Q}.group_size", "x"),
    ("group-2e70", f"{Q}.group_size", 2**70),
    ("group-0", f"{Q}.group_size", 0),
    ("group-7", f"{Q}.group_size", 7),
    ("group-minus-2", f"{Q}.group_size", -2),
    ("desc-act-string", f"{Q}.desc_act", "yes"),
    ("quant-method-int", f"{Q}.quant_method", 3),
    ("quant-method-unknown", f"{Q}.quant_method", "magic"),
    ("checkpoint-format-marlin", f"{Q}.checkpoint_format", "marlin"),
    ("head-dim-string", "head_dim", "32"),
    ("head-dim-zero", "head_dim", 0),
    ("intermediate-string", "intermediate_size", "512"),
    ("kv-heads-string", "num_key_value_heads", "2"),
    ("kv-heads-minus-2", "num_key_value_heads", -2),
    ("kv-heads-3-of-8", "num_key_value_heads", 3),
    ("kv-heads-16-of-8", "num_key_value_heads", 16),
    ("heads-zero", "num_attention_heads", 0),
    ("heads-2e62", "num_attention_heads", 2**62),
    ("hidden-string", "hidden_size", "256"),
    ("layers-negative", "num_hidden_layers", -1),
    ("vocab-float", "vocab_size", 512.0),
    ("qconfig-int", Q, 3),
    ("qconfig-string", Q, "gptq"),
    ("qconfig-list", Q, [1]),
    ("model-type-list", "model_type", ["llama"]),
    ("model-type-unknown", "model_type", "nope"),
    ("stray-quantization-key", "quantization", 4),
    # metadata that disagrees with the tensors: silent corruption unless refused
    ("intermediate-100-vs-512-rows", "intermediate_size", 100),
    ("intermediate-1024-vs-512-rows", "intermediate_size", 1024),
    ("heads-4-vs-8", "num_attention_heads", 4),
    ("head-dim-16-vs-32", "head_dim", 16),
    ("vocab-1000-vs-512", "vocab_size", 1000),
]:
    key = path.rpartition(".")[2]
    case(
        f"hf-{cid}",
        "config fields" if "vs" not in cid else "metadata vs tensors",
        _hf(set_key(path, value)),
        mentions=("config.json", key),
    )
case("hf-config-list", "config fields", _hf(raw=b"[1, 2]"), mentions=("config.json",))
case("hf-config-not-json", "config fields", _hf(raw=b"{oops"), mentions=("config.json",))
case(
    "hf-config-utf16",
    "config fields",
    _hf(raw=json.dumps({"model_type": "llama"}).encode("utf-16")),
    mentions=("config.json",),
)
case(
    "hf-config-inf",
    "config fields",
    _hf(raw=b'{"model_type": "llama", "rope_theta": 1e400}'),
    mentions=("config.json",),
)
case(
    "hf-quantize-config-bits-string",
    "config fields",
    _hf(set_key(Q, ...), quantize_config={"bits": "4", "group_size": 32}),
    mentions=("quantize_config.json", "bits"),
)


def _config_is(kind: str) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        os.symlink(EXAMPLE / "model.safetensors", d / "model.safetensors")
        path = d / "config.json"
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", path)
        elif kind == "loop":
            os.symlink(path.name, path)
        elif kind == "dir":
            path.mkdir()
        elif kind == "huge":
            with open(path, "wb") as f:
                f.truncate(200_000_000)
        return Target(str(d))

    return build


for kind in ("fifo", "dev-zero", "loop", "dir", "huge"):
    case(
        f"hf-config-is-{kind}",
        "file-system layout",
        _config_is(kind),
        time_s=10,
        mentions=("config.json",),
        mem_mb=256,
    )

# compressed-tensors and FP8 configs (only the config is read before the refusal)
CT = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
        }
    },
}
for cid, edit, key in [
    ("config-groups-list", lambda q: q.update(config_groups=[1]), "config_groups"),
    ("weights-string", lambda q: q["config_groups"]["group_0"].update(weights="w4"), "weights"),
    (
        "num-bits-0",
        lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=0),
        "num_bits",
    ),
    (
        "group-size-string",
        lambda q: q["config_groups"]["group_0"]["weights"].update(group_size="32"),
        "group_size",
    ),
    (
        "block-structure-1",
        lambda q: (
            q.update(format="float-quantized")
            or q["config_groups"]["group_0"]["weights"].update(
                block_structure=[128], strategy="block"
            )
        ),
        "block_structure",
    ),
]:

    def _ct(config: dict, edit=edit) -> None:
        q = copy.deepcopy(CT)
        edit(q)
        config[Q] = q

    case(f"hf-ct-{cid}", "config fields", _hf(_ct), mentions=("config.json", key))
for cid, block in [("len-1", [128]), ("zero", [0, 128]), ("strings", ["128", "128"])]:
    case(
        f"hf-fp8-block-{cid}",
        "config fields",
        _hf(set_key(Q, {"quant_method": "fp8", "weight_block_size": block})),
        mentions=("config.json", "weight_block_size"),
    )


# ==== GGUF: written by gguf-py, metadata and header patched =======================================

G_HEADS, G_KV, G_HEAD_DIM, G_HIDDEN, G_FFN, G_VOCAB = 4, 2, 32, 64, 128, 32


def gguf_file(
    path: Path,
    kv: dict[str, tuple[str, Any]] | None = None,
    drop: tuple[str, ...] = (),
    ffn: int = G_FFN,
) -> Path:
    """A one-layer Llama GGUF (Q8_0 linears, MLP of ``ffn`` rows) written by gguf-py's own
    GGUFWriter; ``kv`` overrides key-values ``{key: (type, value)}``, ``drop`` leaves some out."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {
        "llama.block_count": ("u32", 1),
        "llama.embedding_length": ("u32", G_HIDDEN),
        "llama.feed_forward_length": ("u32", ffn),
        "llama.attention.head_count": ("u32", G_HEADS),
        "llama.attention.head_count_kv": ("u32", G_KV),
        "llama.attention.key_length": ("u32", G_HEAD_DIM),
        "llama.attention.value_length": ("u32", G_HEAD_DIM),
        "llama.vocab_size": ("u32", G_VOCAB),
    }
    values.update(kv or {})
    for key, (kind, value) in values.items():
        if key in drop:
            continue
        {
            "u32": writer.add_uint32,
            "i32": writer.add_int32,
            "u64": writer.add_uint64,
            "str": writer.add_string,
            "f32": writer.add_float32,
        }[kind](key, value)
    q, kvs = G_HEADS * G_HEAD_DIM, G_KV * G_HEAD_DIM
    shapes = {
        "attn_q": (q, G_HIDDEN),
        "attn_k": (kvs, G_HIDDEN),
        "attn_v": (kvs, G_HIDDEN),
        "attn_output": (G_HIDDEN, q),
        "ffn_gate": (ffn, G_HIDDEN),
        "ffn_up": (ffn, G_HIDDEN),
        "ffn_down": (G_HIDDEN, ffn),
    }
    writer.add_tensor("token_embd.weight", blocks(rng, T.Q8_0, G_VOCAB, G_HIDDEN), raw_dtype=T.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(G_HIDDEN, np.float32))
    for name, (rows, cols) in shapes.items():
        writer.add_tensor(f"blk.0.{name}.weight", blocks(rng, T.Q8_0, rows, cols), raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(G_HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf(
    kv: dict | None = None,
    drop: tuple[str, ...] = (),
    patch: Callable[[bytearray], Any] | None = None,
) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        path = gguf_file(d / "model.gguf", kv, drop)
        if patch:
            raw = bytearray(path.read_bytes())
            out = patch(raw)
            path.write_bytes(bytes(out if out is not None else raw))
        return Target(str(path))

    return build


def _info_at(raw: bytearray, name: str) -> int:
    """Offset just after the name string of tensor info ``name`` (n_dims follows)."""
    needle = struct.pack("<Q", len(name)) + name.encode()
    at = raw.find(needle)
    assert at >= 0, name
    return at + len(needle)


def _set_u64(offset: int, value: int) -> Callable[[bytearray], None]:
    return lambda raw: raw.__setitem__(slice(offset, offset + 8), struct.pack("<Q", value))


def _tensor_patch(name: str, field: str, value: int) -> Callable[[bytearray], None]:
    def patch(raw: bytearray) -> None:
        at = _info_at(raw, name)
        (n_dims,) = struct.unpack_from("<I", raw, at)
        where = {
            "n_dims": (at, "<I"),
            "ne0": (at + 4, "<Q"),
            "ne1": (at + 12, "<Q"),
            "type": (at + 4 + 8 * n_dims, "<I"),
            "offset": (at + 8 + 8 * n_dims, "<Q"),
        }
        pos, fmt = where[field]
        struct.pack_into(fmt, raw, pos, value)

    return patch


case("gguf-ok", "legitimate", _gguf(), expect="ok")
case(
    "gguf-3-shards-ok",
    "legitimate",
    lambda d: Target(_gguf()(d).ckpt, shards=3),
    expect="ok",
    commands=("validate", "load"),
)  # 4 heads / 3: zero-padded, exactly
for cid, patch, frag in [
    ("magic", lambda r: r.__setitem__(slice(0, 4), b"GGUX"), "magic"),
    ("version-1", lambda r: struct.pack_into("<I", r, 4, 1), "version"),
    ("version-big-endian", lambda r: struct.pack_into("<I", r, 4, 3 << 24), "big-endian"),
    (
        "tensor-count-minus-1",
        lambda r: struct.pack_into("<Q", r, 8, struct.unpack_from("<Q", r, 8)[0] - 1),
        "model.gguf",
    ),
    (
        "tensor-count-plus-1",
        lambda r: struct.pack_into("<Q", r, 8, struct.unpack_from("<Q", r, 8)[0] + 1),
        "model.gguf",
    ),
    ("tensor-count-huge", _set_u64(8, 2**62), "model.gguf"),
    ("kv-count-huge", _set_u64(16, 2**62), "model.gguf"),
    (
        "kv-count-minus-1",
        lambda r: struct.pack_into("<Q", r, 16, struct.unpack_from("<Q", r, 16)[0] - 1),
        "model.gguf",
    ),
    ("truncated-header", lambda r: r[:100], "model.gguf"),
    ("truncated-data", lambda r: r[:-200], "model.gguf"),
    ("trailing-garbage", lambda r: r + b"\x01" * 4096, "model.gguf"),
    ("ne0-not-block", _tensor_patch("blk.0.attn_q.weight", "ne0", 33), "attn_q"),
    ("ne1-huge", _tensor_patch("blk.0.attn_q.weight", "ne1", 2**61), "attn_q"),
    ("ne1-2e53", _tensor_patch("blk.0.attn_q.weight", "ne1", 2**53 + 1), "attn_q"),
    ("n-dims-5", _tensor_patch("blk.0.attn_q.weight", "n_dims", 5), "model.gguf"),
    ("type-unknown", _tensor_patch("blk.0.attn_q.weight", "type", 999), "999"),
    ("offset-misaligned", _tensor_patch("blk.0.attn_q.weight", "offset", 1), "attn_q"),
    ("offset-past-eof", _tensor_patch("blk.0.attn_q.weight", "offset", 2**40), "attn_q"),
    ("offset-overlap", _tensor_patch("blk.0.attn_k.weight", "offset", 0), "overlap"),
]:
    case(f"gguf-{cid}", "GGUF header", _gguf(patch=patch), mentions=(frag,))

for cid, kv, drop, key in [
    ("head-count-0", {"llama.attention.head_count": ("u32", 0)}, (), "head_count"),
    ("head-count-2e62", {"llama.attention.head_count": ("u64", 2**62)}, (), "head_count"),
    ("head-count-string", {"llama.attention.head_count": ("str", "4")}, (), "head_count"),
    ("head-count-missing", {}, ("llama.attention.head_count",), "head_count"),
    ("head-count-kv-string", {"llama.attention.head_count_kv": ("str", "2")}, (), "head_count_kv"),
    ("head-count-kv-3-of-4", {"llama.attention.head_count_kv": ("u32", 3)}, (), "head_count_kv"),
    ("head-count-kv-8-of-4", {"llama.attention.head_count_kv": ("u32", 8)}, (), "head_count_kv"),
    ("head-count-kv-0", {"llama.attention.head_count_kv": ("u32", 0)}, (), "head_count_kv"),
    ("key-length-string", {"llama.attention.key_length": ("str", "32")}, (), "key_length"),
    ("key-length-16-vs-32", {"llama.attention.key_length": ("u32", 16)}, (), "key_length"),
    ("block-count-negative", {"llama.block_count": ("i32", -1)}, (), "block_count"),
    ("embedding-length-float", {"llama.embedding_length": ("f32", 64.0)}, (), "embedding_length"),
    ("ffn-100-vs-128-rows", {"llama.feed_forward_length": ("u32", 100)}, (), "feed_forward"),
    ("ffn-256-vs-128-rows", {"llama.feed_forward_length": ("u32", 256)}, (), "feed_forward"),
    ("key-length-missing-vs-32", {}, ("llama.attention.key_length",), "key_length"),
    (
        "heads-8-vs-4",
        {"llama.attention.head_count": ("u32", 8), "llama.attention.head_count_kv": ("u32", 2)},
        (),
        "head_count",
    ),
]:
    case(
        f"gguf-{cid}",
        "GGUF metadata" if "vs" not in cid else "metadata vs tensors",
        _gguf(kv, drop),
        mentions=("model.gguf", key),
    )


# ==== MLC ========================================================================================


def _mlc(
    edit_index: Callable[[dict], Any] | None = None,
    edit_config: Callable[[dict], Any] | None = None,
    *,
    raw_index: Callable[[dict], bytes] | None = None,
) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        rng = np.random.default_rng(1)
        hidden, inter, heads, kv, hd = 64, 128, 4, 2, 16
        tensors = {}
        for module, shape in {
            "self_attn.qkv_proj": ((heads + 2 * kv) * hd, hidden),
            "self_attn.o_proj": (hidden, heads * hd),
            "mlp.gate_up_proj": (2 * inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }.items():
            qw, qs = quantize_q4f16_1((rng.standard_normal(shape) * 0.05).astype(np.float32))
            tensors[f"model.layers.0.{module}.q_weight"] = qw
            tensors[f"model.layers.0.{module}.q_scale"] = qs
        config = {
            "model_type": "llama",
            "quantization": "q4f16_1",
            "model_config": {
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "head_dim": hd,
                "num_hidden_layers": 1,
                "vocab_size": 64,
            },
        }
        if edit_config:
            edit_config(config)
        index = write_mlc_folder(d, tensors, config=config, shard_bytes=16 << 10)
        doc = json.loads(index.read_text())
        if edit_index:
            edit_index(doc)
        if edit_index or raw_index:
            index.write_bytes(raw_index(doc) if raw_index else json.dumps(doc).encode())
        return Target(str(d))

    return build


def _data_path(value: Any) -> Callable[[dict], None]:
    return lambda doc: doc["records"][0].update(dataPath=value)


case("mlc-ok", "legitimate", _mlc(), expect="ok")
for cid, value in [
    ("absolute", "/etc/passwd"),
    ("dotdot", "../params_shard_0.bin"),
    ("nul", "params\x00.bin"),
    ("long", "p" * 6000),
    ("int", 7),
    ("backslash", "a\\b.bin"),
    ("missing", "params_shard_99.bin"),
]:
    case(
        f"mlc-datapath-{cid}",
        "index file names",
        _mlc(_data_path(value)),
        mentions=("tensor-cache.json" if cid != "missing" else "params_shard_99",),
    )
for cid, edit, frag in [
    ("records-object", lambda doc: doc.update(records={}), "records"),
    ("nbytes-lie", lambda doc: doc["records"][0]["records"][0].update(nbytes=3), "nbytes"),
    ("shape-huge", lambda doc: doc["records"][0]["records"][0].update(shape=[2**63, 0]), "shape"),
    ("dtype-unknown", lambda doc: doc["records"][0]["records"][0].update(dtype="int3"), "int3"),
    (
        "offset-past-end",
        lambda doc: doc["records"][0]["records"][0].update(byteOffset=2**40),
        "byteOffset",
    ),
    (
        "file-size-lie",
        lambda doc: doc["records"][0].update(nbytes=doc["records"][0]["nbytes"] + 1),
        "nbytes",
    ),
]:
    case(f"mlc-{cid}", "MLC index", _mlc(edit), mentions=(frag,))
case(
    "mlc-index-utf16",
    "MLC index",
    _mlc(raw_index=lambda doc: json.dumps(doc).encode("utf-16")),
    mentions=("tensor-cache.json",),
)
for cid, edit, key in [
    ("model-config-list", lambda c: c.update(model_config=[1]), "model_config"),
    (
        "kv-heads-minus-2",
        lambda c: c["model_config"].update(num_key_value_heads=-2),
        "num_key_value_heads",
    ),
    (
        "heads-string",
        lambda c: c["model_config"].update(num_attention_heads="4"),
        "num_attention_heads",
    ),
    ("quantization-int", lambda c: c.update(quantization=4), "quantization"),
    (
        "intermediate-100-vs-128",
        lambda c: c["model_config"].update(intermediate_size=100),
        "intermediate_size",
    ),
]:
    case(
        f"mlc-config-{cid}",
        "config fields" if "vs" not in cid else "metadata vs tensors",
        _mlc(edit_config=edit),
        mentions=("mlc-chat-config.json", key),
    )


# ==== plans ======================================================================================


def _plan(
    plan: Any = None, *, raw: bytes | None = None, kind: str = "", shards: int = 2
) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        st_base(d, plan=None)
        path = d / "plan.json"
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", path)
        elif kind == "dir":
            path.mkdir()
        elif kind == "loop":
            os.symlink(path.name, path)
        else:
            path.write_bytes(raw if raw is not None else json.dumps(plan).encode())
        return Target(str(d / "model.safetensors"), str(path), shards)

    return build


def _step(func: str, shape: list, dtype: str, *extra: Any) -> list:
    return [func, [shape, dtype], *extra]


SPLIT_A = _step("shardload.split", ["num_shards", "4 // num_shards", 8], "float32", 0)

case("plan-ok", "legitimate", _plan(BASE_PLAN), expect="ok")
case("plan-empty-ok", "legitimate", _plan({}), expect="ok")
for kind in ("fifo", "dev-zero", "dir", "loop"):
    case(
        f"plan-is-{kind}",
        "file-system layout",
        _plan(kind=kind),
        time_s=10,
        mentions=("plan.json",),
        mem_mb=256,
    )
for cid, raw, frag in [
    ("not-json", b"{", "JSON"),
    ("utf16", json.dumps(BASE_PLAN).encode("utf-16"), "plan.json"),
    ("utf32", json.dumps(BASE_PLAN).encode("utf-32"), "plan.json"),
    ("nan", b'{"a": NaN}', "NaN"),
    ("inf-metadata", b'{"__metadata__": {"x": 1e400}}', "plan.json"),
    ("duplicate-key", b'{"a": [], "a": []}', "duplicate"),
    ("deep", b"[" * 50000 + b"]" * 50000, "plan.json"),
    ("array", b"[]", "object"),
    ("metadata-list", b'{"__metadata__": [1]}', "__metadata__"),
    ("lone-surrogate-name", b'{"\\ud800": []}', "plan.json"),
]:
    case(f"plan-{cid}", "plan file", _plan(raw=raw), mentions=(frag,))
for cid, plan, frag in [
    ("steps-not-list", {"a": 3}, "'a'"),
    ("step-not-list", {"a": [3]}, "'a'"),
    ("func-not-string", {"a": [[1, [[2, 2, 8], "float32"]]]}, "function name"),
    ("unknown-func", {"a": [_step("nope.split", [2, 2, 8], "float32", 0)]}, "nope.split"),
    ("func-100k-chars", {"a": [_step("f" * 100_000, [2, 2, 8], "float32", 0)]}, "characters"),
    ("name-unknown-param", {"zz": [SPLIT_A]}, "'zz'"),
    ("dtype-unknown", {"a": [_step("shardload.split", [2, 2, 8], "float99", 0)]}, "float99"),
    ("shape-negative", {"a": [_step("shardload.split", [2, -2, 8], "float32", 0)]}, "negative"),
    ("shape-float", {"a": [_step("shardload.split", [2, 2.0, 8], "float32", 0)]}, "out_shape"),
    ("shape-bool", {"a": [_step("shardload.split", [2, True, 8], "float32", 0)]}, "out_shape"),
    ("shape-2e53", {"a": [_step("shardload.split", [2, 2**53 + 1, 8], "float32", 0)]}, "'a'"),
    ("shape-wrong", {"a": [_step("shardload.split", [2, 3, 8], "float32", 0)]}, "'a'"),
    ("wrong-n", {"a": [_step("shardload.split", [4, 1, 8], "float32", 0)]}, "num_shards"),
    (
        "expr-eval",
        {"a": [_step("shardload.split", ["num_shards", "__import__('os')", 8], "float32", 0)]},
        "'a'",
    ),
    (
        "expr-div-zero",
        {"a": [_step("shardload.split", ["num_shards", "4 // (num_shards - 2)", 8], "float32", 0)]},
        "zero",
    ),
    (
        "expr-huge",
        {"a": [_step("shardload.split", ["num_shards", "2**64", 8], "float32", 0)]},
        "'a'",
    ),
    (
        "expr-pow-chain",
        {
            "a": [
                _step(
                    "shardload.split", ["num_shards", "9" * 200 + " * " + "9" * 50, 8], "float32", 0
                )
            ]
        },
        "'a'",
    ),
    ("arg-dim-out-of-range", {"a": [_step("shardload.split", [2, 2, 8], "float32", 5)]}, "'a'"),
    ("arg-wrong-arity", {"a": [_step("shardload.split", [2, 2, 8], "float32")]}, "'a'"),
    ("arg-object", {"a": [["shardload.split", [[2, 2, 8], "float32"], {"x": 1}]]}, "'a'"),
    (
        "constant-1e30-int64",
        {"b": [_step("shardload.constant", [2, 2], "int64", 10**30, 1)]},
        "'b'",
    ),
    ("constant-2e40-int32", {"b": [_step("shardload.constant", [2, 2], "int32", 2**40, 1)]}, "'b'"),
    (
        "replicate-chain-11",
        {"a": [_step("shardload.replicate", [2] * k + [4, 8], "float32") for k in range(1, 12)]},
        "'a'",
    ),
    (
        "replicate-chain-64",
        {"a": [_step("shardload.replicate", [2] * k + [4, 8], "float32") for k in range(1, 65)]},
        "'a'",
    ),
    ("growth-bomb", {"a": [_step("shardload.replicate", [2, 2**20, 8], "float32")]}, "'a'"),
    (
        "last-not-n",
        {
            "a": [
                _step("shardload.replicate", [2, 4, 8], "float32"),
                _step("shardload.replicate", [3, 2, 4, 8], "float32"),
            ]
        },
        "'a'",
    ),
]:
    case(f"plan-{cid}", "plan contents", _plan(plan), mentions=(frag,))

case(
    "plan-100k-shards",
    "resource bombs",
    _plan({}, shards=100_000),
    mentions=("100000",),
    time_s=10,
    mem_mb=256,
)
case(
    "plan-1000-shards-ok",
    "legitimate",
    _plan({}, shards=1000),
    expect="ok",
    commands=("validate", "inspect"),
)


def _big_plan(what: str) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        st_base(d, plan=None)
        path = d / "plan.json"
        with open(path, "w") as f:
            if what == "many-args":  # ~10 MB: 1M expression args in one step
                f.write('{"a": [["shardload.split", [[2, 2, 8], "float32"], 0')
                f.write(', "num_shards"' * 1_000_000)
                f.write("]]}")
            elif what == "many-dims":
                f.write(
                    '{"a": [["shardload.split", [[2' + ", 1" * 1_000_000 + '], "float32"], 0]]}'
                )
            elif what == "missing-names":  # 200k parameters the checkpoint lacks
                f.write("{" + ", ".join(f'"p{i}": []' for i in range(200_000)) + "}")
            elif what == "huge-name":  # a 20 MB parameter name
                f.write('{"' + "n" * 20_000_000 + '": []}')
            elif what == "over-cap":
                f.truncate(300_000_000)
        return Target(str(d / "model.safetensors"), str(path))

    return build


# measured on 2 shared cores: at most 0.92 s CPU (many-args, validate) and 124 MB per command
for what in ("many-args", "many-dims", "missing-names", "huge-name", "over-cap"):
    case(
        f"plan-big-{what}",
        "resource bombs",
        _big_plan(what),
        mentions=("plan.json",),
        commands=("validate", "api"),
        time_s=30,
        mem_mb=1536,
    )


# ==== the Hugging Face hub cache ==================================================================


def hub_cache(d: Path, files: dict[str, bytes], revision: str = "a" * 40) -> Path:
    """``models--org--name`` as huggingface_hub lays it out: content-addressed blobs, a snapshot
    of relative symlinks to them, and ``refs/main`` naming the snapshot. Returns the repo folder."""
    import hashlib

    repo = d / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snap / name)
    return repo


def hub_target(which: str) -> Callable[[Path], Target]:
    """A builder of a sharded checkpoint in a hub cache, opened as its repo folder (``"repo"``)
    or its snapshot (``"snapshot"``)."""

    def build(d: Path) -> Target:
        src = d / "src"
        src.mkdir()
        index = _sharded(src)
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        files = {p.name: p.read_bytes() for p in src.iterdir()}
        repo = hub_cache(d, files)
        return Target(str(repo if which == "repo" else repo / "snapshots" / ("a" * 40)))

    return build


case("hub-cache-snapshot", "legitimate", hub_target("snapshot"), expect="ok")
case("hub-cache-repo-folder", "legitimate", hub_target("repo"), expect="ok")


def _hub_bad_ref(ref: str) -> Callable[[Path], Target]:
    def build(d: Path) -> Target:
        repo = Path(hub_target("repo")(d).ckpt)
        (repo / "refs" / "main").write_text(ref)
        return Target(str(repo))

    return build


for cid, ref in [("missing-snapshot", "b" * 40), ("dotdot", "../../etc"), ("empty", "")]:
    case(
        f"hub-cache-ref-{cid}",
        "file-system layout",
        _hub_bad_ref(ref),
        mentions=("models--org--tiny",),
    )


def classes() -> dict[str, list[Case]]:
    out: dict[str, list[Case]] = {}
    for c in CASES:
        out.setdefault(c.klass, []).append(c)
    return out


assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
