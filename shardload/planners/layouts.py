"""Where the two matrix axes of a linear layer lie in each stored tensor, per format.

A linear layer ``y = x Wᵀ`` has ``W [N_out, K_in]``. Column-parallel splits N, row-parallel
splits K. A quantized layer stores W as several tensors (packed codes, scales, zero points,
group indices), each holding N and K along its own dims and in its own units. An ``Axis`` says
where one logical axis lies in one tensor: along ``dim``, every ``elems`` logical elements take
``width`` tensor units (a GPTQ 4-bit ``qweight`` holds K at 8 rows per int32 word: ``Axis(0, 8,
1)``; 3-bit holds 32 rows in 3 words: ``Axis(0, 32, 3)``; a GGUF Q4_1 row holds K at 32 elements
per 20-byte block: ``Axis(1, 32, 20)``). A tensor that does not hold an axis is replicated when
that axis is split.

The formats, their layouts and their sources: ``QUANT_FORMATS.md`` beside the design notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..errors import PlanError
from ..readers.base import TensorMeta


@dataclass(frozen=True)
class Axis:
    dim: int
    elems: int = 1
    width: int = 1


@dataclass(frozen=True)
class TensorAxes:
    """Where N and K lie in one stored tensor; ``special`` names tensors needing their own
    rule (``g_idx``, ``shape``)."""

    n: Optional[Axis]
    k: Optional[Axis]
    special: str = ""


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization, as far as sharding cares."""

    method: str                 # none | gptq | awq | pack-quantized | fp8 | gguf | mlc
    bits: int = 16
    group_size: int = -1
    act_order: bool = False
    block: tuple[int, int] = (128, 128)

    def describe(self) -> str:
        if self.method in ("none", "gguf", "mlc", "fp8"):
            return self.method
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.method} {self.bits}-bit {group}{', act-order' if self.act_order else ''}"


# ---- reading the quantization config ---------------------------------------------------------

def scheme_from_hf(config: Mapping[str, Any], source: str) -> Scheme:
    """The scheme an HF config's ``quantization_config`` describes."""
    quant = config.get("quantization_config")
    if not quant:
        return Scheme("none")
    method = str(quant.get("quant_method", "")).lower()
    if method in ("bitsandbytes", "bnb"):
        raise PlanError("bitsandbytes checkpoints are not supported: their 4-bit weights are "
                        "flattened and their quantization state is per tensor, so they cannot "
                        "be split without re-quantizing. Use a GPTQ, AWQ, compressed-tensors, "
                        "FP8 or GGUF checkpoint of the model.", source=source)
    if method == "gptq":
        fmt = str(quant.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise PlanError(f"GPTQ checkpoint_format {fmt!r} keeps weights in a tile-permuted "
                            "layout that cannot be sliced; repack it to plain GPTQ first",
                            source=source)
        bits = int(quant.get("bits", 4))
        if bits not in (2, 3, 4, 8):
            raise PlanError(f"GPTQ with {bits} bits is not supported (2, 3, 4, 8 are)",
                            source=source)
        return Scheme("gptq", bits, int(quant.get("group_size", -1)),
                      bool(quant.get("desc_act", False)))
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise PlanError(f"AWQ version {version!r} stores a permuted layout; only GEMM "
                            "checkpoints can be sliced", source=source)
        return Scheme("awq", int(quant.get("bits", quant.get("w_bit", 4))),
                      int(quant.get("group_size", quant.get("q_group_size", 128))))
    if method == "fp8":
        block = quant.get("weight_block_size") or (128, 128)
        return Scheme("fp8", 8, block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    raise PlanError(f"quantization method {method!r} is not supported by the planner (gptq, "
                    "awq, compressed-tensors and fp8 are)", source=source)


def _compressed_tensors(quant: Mapping[str, Any], source: str) -> Scheme:
    fmt = quant.get("format")
    groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    if not groups:
        raise PlanError("compressed-tensors config has no config_groups", source=source)
    weights = groups[0]
    if any(g != weights for g in groups[1:]):
        raise PlanError("compressed-tensors configs with several different weight schemes are "
                        "not supported yet", source=source)
    if fmt == "float-quantized":
        block = weights.get("block_structure") or [128, 128]
        return Scheme("fp8", 8, block=(int(block[0]), int(block[1])))
    if fmt == "pack-quantized":
        strategy = weights.get("strategy")
        group = int(weights.get("group_size") or -1) if strategy == "group" else -1
        act = weights.get("actorder") not in (None, False, "static", "weight")
        return Scheme("pack-quantized", int(weights.get("num_bits", 4)), group, act)
    raise PlanError(f"compressed-tensors format {fmt!r} is not supported (pack-quantized and "
                    "float-quantized are)", source=source)


# ---- the axes of each stored tensor ------------------------------------------------------------

_GPTQ_PACK = {2: (16, 1), 3: (32, 3), 4: (8, 1), 8: (4, 1)}   # K rows per (words)


def tensor_axes(scheme: Scheme, suffix: str, meta: TensorMeta,
                fmt: Optional[Mapping[str, Any]] = None) -> Optional[TensorAxes]:
    """Where N and K lie in the tensor ``<module>.<suffix>``; ``None`` if it is not part of a
    linear layer this scheme knows (it is then replicated)."""
    if suffix == "bias":
        return TensorAxes(Axis(0), None)
    if scheme.method == "gguf":
        lead = len(meta.shape) - 2           # 3-D expert tensors carry the experts first
        if lead < 0:
            return None
        block, size = (fmt or {}).get("block_size", 1), (fmt or {}).get("type_size", 1)
        quantized = (fmt or {}).get("block_size", 1) > 1
        return TensorAxes(Axis(lead), Axis(lead + 1, block, size) if quantized
                          else Axis(lead + 1))
    if scheme.method == "mlc":
        if suffix == "q_weight":
            return TensorAxes(Axis(0), Axis(1, 8, 1))
        if suffix == "q_scale":
            return TensorAxes(Axis(0), Axis(1, 32, 1))
        if suffix == "weight":
            return TensorAxes(Axis(0), Axis(1))
        return None
    if suffix == "weight" and meta.dtype.startswith("float8"):
        return TensorAxes(Axis(0), Axis(1))
    if suffix in ("weight_scale", "weight_scale_inv") and scheme.method == "fp8":
        if len(meta.shape) <= 1:
            return TensorAxes(None, None)       # per tensor (or per part of a fused tensor)
        if len(meta.shape) == 2 and meta.shape[1] == 1:
            return TensorAxes(Axis(0), None)                   # per channel
        rows, cols = scheme.block
        return TensorAxes(Axis(0, rows), Axis(1, cols))        # per block
    if suffix == "input_scale":
        return TensorAxes(None, None)
    if suffix == "weight":
        return TensorAxes(Axis(0), Axis(1))
    if scheme.method == "gptq":
        elems, width = _GPTQ_PACK[scheme.bits]
        grouped = scheme.group_size != -1
        if suffix == "qweight":
            return TensorAxes(Axis(1), Axis(0, elems, width))
        if suffix == "qzeros":
            return TensorAxes(Axis(1, elems, width),
                              Axis(0, scheme.group_size) if grouped else None)
        if suffix == "scales":
            return TensorAxes(Axis(1), Axis(0, scheme.group_size) if grouped else None)
        if suffix == "g_idx":
            return TensorAxes(None, Axis(0), special="g_idx")
    if scheme.method == "awq":
        if suffix == "qweight":
            return TensorAxes(Axis(1, 8), Axis(0))
        if suffix == "qzeros":
            return TensorAxes(Axis(1, 8), Axis(0, scheme.group_size))
        if suffix == "scales":
            return TensorAxes(Axis(1), Axis(0, scheme.group_size))
    if scheme.method == "pack-quantized":
        pack = 32 // scheme.bits
        grouped = scheme.group_size != -1
        if suffix == "weight_packed":
            return TensorAxes(Axis(0), Axis(1, pack))
        if suffix == "weight_scale":
            return TensorAxes(Axis(0), Axis(1, scheme.group_size) if grouped else None)
        if suffix == "weight_zero_point":
            return TensorAxes(Axis(0, pack), Axis(1, scheme.group_size) if grouped else None)
        if suffix == "weight_g_idx":
            return TensorAxes(None, Axis(0), special="g_idx")
        if suffix == "weight_shape":
            return TensorAxes(None, None, special="shape")
    return None
