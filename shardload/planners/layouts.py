"""Where the two matrix axes of a linear layer lie in each stored tensor, per format.

A linear layer ``y = x Wᵀ`` has ``W [N_out, K_in]``. Column-parallel splits N, row-parallel
splits K. A quantized layer stores W as several tensors (packed codes, scales, zero points,
group indices), each holding N and K along its own dims and in its own units. An ``Axis`` says
where one logical axis lies in one tensor: along ``dim``, every ``elems`` logical elements take
``width`` tensor units (a GPTQ 4-bit ``qweight`` holds K at 8 rows per int32 word: ``Axis(0, 8,
1)``; 3-bit holds 32 rows in 3 words: ``Axis(0, 32, 3)``; a GGUF Q4_1 row holds K at 32 elements
per 20-byte block: ``Axis(1, 32, 20)``). A tensor that does not hold an axis is replicated when
that axis is split.

The formats, their layouts, the sharding rules and their sources: ``docs/quant_formats.md``
in the repository.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from ..config_fields import MAX_GROUP, Fields
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
    """A checkpoint's quantization, as far as sharding cares.

    ``file`` is the file the quantization config came from (a name, or a function giving it:
    see ``source``) and ``keys`` the key each setting came from
    (``{"bits": "'quantization_config.bits'"}``), for messages.
    """

    #: none | gptq | awq | pack-quantized | int-quantized | nvfp4 | mxfp4 | modelopt-nvfp4 |
    #: fp8 | gguf | mlc
    method: str
    bits: int = 16
    group_size: int = -1
    act_order: bool = False
    block: tuple[int, int] = (128, 128)
    #: int-quantized: compressed-tensors' weight strategy (tensor, channel or group); fp8:
    #: ``block`` (HF fp8, DeepSeek; compressed-tensors strategy block), ``tensor`` or
    #: ``channel``, or "" (not said: the scale's shape tells)
    strategy: str = ""
    file: Any = field(default="", compare=False)
    keys: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def source(self) -> str:
        """The file the quantization config came from, for messages."""
        return self.file() if callable(self.file) else self.file

    def describe(self) -> str:
        if self.method in ("none", "gguf", "mlc", "fp8"):
            return self.method
        group = ("per-tensor" if self.strategy == "tensor" else "per-channel"
                 if self.group_size == -1 else f"group {self.group_size}")
        return f"{self.method} {self.bits}-bit {group}{', act-order' if self.act_order else ''}"

    def explain(self, *attrs: str) -> str:
        """``'quantization_config.bits' = 4, ...``: settings with the keys they came from."""
        return ", ".join(f"{self.keys[a]} = {getattr(self, a)}" for a in attrs if a in self.keys)


# ---- reading the quantization config ---------------------------------------------------------

def scheme_from_hf(config: Union[Fields, Mapping[str, Any]],
                   source: Optional[str] = None, *,
                   quant_file: Optional[Any] = None) -> Scheme:
    """The scheme an HF config's ``quantization_config`` describes.

    ``quant_file`` names the file ``quantization_config`` came from when it is not the config's
    own (``quantize_config.json``, merged in by the reader): a name, or a function giving it.
    """
    cfg = config if isinstance(config, Fields) else Fields(config, file=source or "<config>")
    if cfg.has("quantization", nullable=True):
        value = cfg.raw["quantization"]
        if isinstance(value, Mapping):
            raise PlanError("key 'quantization' holds MLX-style quantization settings: MLX packs "
                            "its weights in a layout the planner does not know, so it cannot "
                            "split them; use a GPTQ, AWQ, compressed-tensors, FP8 or GGUF "
                            "checkpoint of the model", source=cfg.file)
        raise cfg.refuse("quantization", value,
                         "absent from an HF config.json (quantization settings belong under "
                         "'quantization_config'; a top-level 'quantization' is MLC's or MLX's)")
    quant = cfg.sub("quantization_config", optional=True, file=quant_file)
    if quant is None or not quant.raw:
        return Scheme("none", file=cfg.file_label)
    method = quant.str("quant_method").lower()
    if method in ("bitsandbytes", "bnb"):
        raise PlanError("bitsandbytes checkpoints are not supported: their 4-bit weights are "
                        "flattened and their quantization state is per tensor, so they cannot "
                        "be split without re-quantizing. Use a GPTQ, AWQ, compressed-tensors, "
                        "FP8 or GGUF checkpoint of the model.", source=quant.file)
    if method == "gptq":
        fmt = quant.str("checkpoint_format", default="gptq", nullable=True).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise PlanError(f"key {quant.name('checkpoint_format')!r} is {fmt!r}: that GPTQ "
                            "format keeps weights in a tile-permuted layout that cannot be "
                            "sliced; repack it to plain GPTQ first", source=quant.file)
        return Scheme("gptq", quant.int("bits", choices=(2, 3, 4, 8), default=4),
                      quant.int("group_size", min=1, max=MAX_GROUP, also=(-1,), default=-1),
                      quant.bool("desc_act", default=False, nullable=True),
                      file=quant.file_label,
                      keys=_keys(quant, bits="bits", group_size="group_size"))
    if method == "awq":
        version = quant.str("version", default="gemm", nullable=True).lower()
        if version != "gemm":
            raise PlanError(f"key {quant.name('version')!r} is {version!r}: that AWQ version "
                            "stores a permuted layout; only GEMM checkpoints can be sliced",
                            source=quant.file)
        bits_key = "w_bit" if "w_bit" in quant and "bits" not in quant else "bits"
        group_key = ("q_group_size" if "q_group_size" in quant and "group_size" not in quant
                     else "group_size")
        return Scheme("awq", quant.int(bits_key, choices=(4,), default=4),
                      quant.int(group_key, min=1, max=MAX_GROUP, also=(-1,), default=128),
                      file=quant.file_label,
                      keys=_keys(quant, bits=bits_key, group_size=group_key))
    if method == "fp8":
        block = quant.int_list("weight_block_size", length=2, min=1, max=MAX_GROUP,
                               default=[128, 128], nullable=True)
        # transformers' FineGrainedFP8 (DeepSeek's format): always 128 x 128 blocks or as given
        return Scheme("fp8", 8, block=(block[0], block[1]), strategy="block",
                      file=quant.file_label, keys=_keys(quant, block="weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "mxfp4":
        # transformers' Mxfp4Config (gpt-oss): the fused experts' *_blocks / *_scales, one E8M0
        # scale per 32 of K; everything else is stored unquantized
        return Scheme("mxfp4", 4, 32, file=quant.file_label)
    if method == "modelopt":
        return _modelopt(quant)
    raise PlanError(f"key {quant.name('quant_method')!r} is {method!r}: that quantization method "
                    "is not supported by the planner (gptq, awq, compressed-tensors, fp8, "
                    "modelopt and mxfp4 are)", source=quant.file)


def _modelopt(quant: Fields) -> Scheme:
    """NVIDIA ModelOpt's export (``quant_algo`` in ``quantization_config``, or in
    ``hf_quant_config.json``'s ``quantization``): NVFP4 stores ``weight`` as two E2M1 codes per
    uint8 along K, ``weight_scale`` E4M3 per ``group_size`` (16) of K, and the per-module
    scalars ``weight_scale_2`` and ``input_scale``; FP8 a float8 ``weight`` with per-tensor
    scales."""
    algo = quant.str("quant_algo")
    if algo == "FP8":
        return Scheme("fp8", 8, strategy="tensor", file=quant.file_label)
    if algo != "NVFP4":
        raise PlanError(f"key {quant.name('quant_algo')!r} is {algo!r}: ModelOpt checkpoints in "
                        "NVFP4 and FP8 are supported by the planner", source=quant.file)
    group = quant.int("group_size", min=1, max=MAX_GROUP, default=16, nullable=True)
    if group != 16:
        raise PlanError(f"key {quant.name('group_size')!r} is {group}: NVFP4 stores one scale per "
                        "16 weights", source=quant.file)
    return Scheme("modelopt-nvfp4", 4, group, file=quant.file_label,
                  keys=_keys(quant, group_size="group_size") if quant.has("group_size") else {})


def _keys(fields: Fields, **keys: str) -> dict[str, str]:
    return {attr: repr(fields.name(key)) for attr, key in keys.items()}


#: compressed-tensors' activation orderings that reorder a weight's input rows (g_idx)
_ACT_ORDERS = (True, "group", "dynamic")


def _compressed_tensors(quant: Fields) -> Scheme:
    fmt = quant.str("format", default="", nullable=True)
    groups = quant.sub("config_groups")
    names = list(groups.keys())
    if not names:
        raise quant.error("config_groups", "is empty; it must name at least one scheme")
    weights = [groups.sub(name).sub("weights") for name in names]
    first = weights[0]
    if any(w.raw != first.raw for w in weights[1:]):
        raise PlanError("compressed-tensors configs with several different weight schemes are "
                        "not supported yet", source=quant.file)
    if fmt == "float-quantized":     # every field is read (type-checked) before any is judged
        bits = first.int("num_bits", min=1, max=64, default=8)
        block = _block_structure(first)
        strategy = first.str("strategy", default="", nullable=True)
        if bits != 8:
            raise PlanError(f"key {first.name('num_bits')!r} is {bits}: only 8-bit float "
                            "(FP8) weights are supported by the planner", source=quant.file)
        return Scheme("fp8", 8, block=(block[0], block[1]),
                      strategy=strategy if strategy in ("tensor", "channel", "block") else "",
                      file=quant.file_label, keys=_keys(first, block="block_structure"))
    if fmt == "pack-quantized":
        bits = first.int("num_bits", min=1, max=8)
        strategy = first.str("strategy", default="", nullable=True)
        group = (first.int("group_size", min=1, max=MAX_GROUP) if strategy == "group" else -1)
        act = first.one_of("actorder", (False, True, "group", "weight", "static", "dynamic"),
                           default=None, nullable=True) in _ACT_ORDERS
        if bits not in (2, 4, 8):
            raise PlanError(f"key {first.name('num_bits')!r} is {bits}: pack-quantized weights "
                            "of 2, 4 or 8 bits are supported (they fill 32-bit words exactly)",
                            source=quant.file)
        return Scheme("pack-quantized", bits, group, act, file=quant.file_label,
                      keys=_keys(first, bits="num_bits", group_size="group_size"))
    if fmt == "int-quantized":
        return _int_quantized(quant, first)
    if fmt in _FP4_FORMATS:
        return _fp4_packed(quant, first, fmt)
    raise PlanError(f"key {quant.name('format')!r} is {fmt!r}: that compressed-tensors format is "
                    f"not supported ({', '.join(_CT_FORMATS)} are)", source=quant.file)


#: the compressed-tensors formats the planner splits
_CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized",
               "mxfp4-pack-quantized")
#: packed FP4 (E2M1) formats: the method name, and the group every scale covers along K (the
#: only one compressed-tensors' compressor for the format packs: ``can_compress``)
_FP4_FORMATS = {"nvfp4-pack-quantized": ("nvfp4", 16), "mxfp4-pack-quantized": ("mxfp4", 32)}


def _int_quantized(quant: Fields, first: Fields) -> Scheme:
    """``int-quantized`` (W8A8 int8): one int8 element per code, ``[N, K]`` like the dense
    weight; a scale (and zero point) per tensor, per output channel or per group of K."""
    bits = first.int("num_bits", min=1, max=64, default=8)
    kind = first.str("type", default="int", nullable=True)
    group = first.int("group_size", min=1, max=MAX_GROUP, also=(-1,), default=None,
                      nullable=True)
    implied = "tensor" if group is None else "channel" if group == -1 else "group"
    strategy = first.str("strategy", default=implied, nullable=True)
    act = first.one_of("actorder", (False, True, "group", "weight", "static", "dynamic"),
                       default=None, nullable=True)
    if kind != "int" or bits > 8:
        raise PlanError(f"key {first.name('num_bits')!r} is {bits} and {first.name('type')!r} "
                        f"is {kind!r}: int-quantized weights of at most 8 bits (one int8 "
                        "element per code) are supported", source=quant.file)
    if strategy not in ("tensor", "channel", "group"):
        raise PlanError(f"key {first.name('strategy')!r} is {strategy!r}: int-quantized "
                        "weights with one scale per tensor, per channel or per group are "
                        "supported (tensor, channel, group)", source=quant.file)
    if strategy == "group" and group in (None, -1):
        raise first.refuse("group_size", group, "a positive group size for strategy 'group'")
    if act in _ACT_ORDERS:
        raise PlanError(f"key {first.name('actorder')!r} is {act!r}: act-order int-quantized "
                        "weights are not supported by the planner", source=quant.file)
    return Scheme("int-quantized", bits, group if strategy == "group" else -1,
                  strategy=strategy, file=quant.file_label,
                  keys=_keys(first, bits="num_bits", group_size="group_size"))


def _fp4_packed(quant: Fields, first: Fields, fmt: str) -> Scheme:
    """``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``: two FP4 codes per uint8 along K,
    one scale per ``group`` elements of K (FP8 E4M3 for NVFP4, E8M0 exponents for MXFP4) and,
    for NVFP4, per-tensor global scales."""
    method, want = _FP4_FORMATS[fmt]
    bits = first.int("num_bits", min=1, max=64)
    kind = first.str("type", default="float", nullable=True)
    group = first.int("group_size", min=1, max=MAX_GROUP)
    symmetric = first.bool("symmetric", default=True, nullable=True)
    if bits != 4 or kind != "float":
        raise PlanError(f"key {first.name('num_bits')!r} is {bits} and {first.name('type')!r} "
                        f"is {kind!r}: {fmt} holds 4-bit float (E2M1) weights", source=quant.file)
    if group != want:
        raise PlanError(f"key {first.name('group_size')!r} is {group}: {fmt} stores one scale "
                        f"per {want} weights (compressed-tensors packs no other group size in "
                        "this format)", source=quant.file)
    if not symmetric:
        raise PlanError(f"key {first.name('symmetric')!r} is false: asymmetric FP4 weights are "
                        "not supported (compressed-tensors does not produce them)",
                        source=quant.file)
    return Scheme(method, 4, group, file=quant.file_label,
                  keys=_keys(first, bits="num_bits", group_size="group_size"))


def _block_structure(weights: Fields) -> list[int]:
    """FP8 scale blocks ``[rows, cols]``: a list, or compressed-tensors' older ``"RxC"``."""
    raw = weights.raw.get("block_structure")
    if not isinstance(raw, str):
        return weights.int_list("block_structure", length=2, min=1, max=MAX_GROUP,
                                default=[128, 128], nullable=True)
    match = re.fullmatch(r"([0-9]{1,9})x([0-9]{1,9})", raw)
    block = [int(v) for v in match.groups()] if match else []
    if not block or not all(1 <= v <= MAX_GROUP for v in block):
        raise weights.refuse("block_structure", raw, f"a list of 2 integers from 1 to "
                             f"{MAX_GROUP} (or the string 'RxC')")
    return block


# ---- the axes of each stored tensor ------------------------------------------------------------

_GPTQ_PACK = {2: (16, 1), 3: (32, 3), 4: (8, 1), 8: (4, 1)}   # K rows per (words)


def tensor_axes(scheme: Scheme, suffix: str, meta: TensorMeta,
                fmt: Optional[Mapping[str, Any]] = None) -> Optional[TensorAxes]:
    """Where N and K lie in the tensor ``<module>.<suffix>``; ``None`` if it is not part of a
    linear layer this scheme knows (it is then replicated)."""
    if suffix == "bias":      # [rows], or [E, rows] for stacked experts (GGUF's *_exps.bias)
        return TensorAxes(Axis(len(meta.shape) - 1), None)
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
    if scheme.method == "modelopt-nvfp4":
        if suffix == "weight" and meta.dtype == "uint8":    # (lm_head, embeddings: unquantized)
            return TensorAxes(Axis(0), Axis(1, 2))          # two FP4 codes per byte along K
        if suffix == "weight_scale":
            return TensorAxes(Axis(0), Axis(1, scheme.group_size))
        if suffix in ("weight_scale_2", "input_scale"):
            return TensorAxes(None, None)                   # per module: replicated
    if suffix == "weight" and meta.dtype.startswith("float8"):
        return TensorAxes(Axis(0), Axis(1))
    if suffix in ("weight_scale", "weight_scale_inv") and scheme.method == "fp8":
        if len(meta.shape) <= 1:
            return TensorAxes(None, None)       # per tensor (or per part of a fused tensor)
        # a block grid of a layer at most one block wide has one column too: the config says
        if len(meta.shape) == 2 and meta.shape[1] == 1 and scheme.strategy != "block":
            return TensorAxes(Axis(0), None)                   # per channel
        rows, cols = scheme.block
        return TensorAxes(Axis(0, rows), Axis(1, cols))        # per block
    if suffix in ("input_scale", "k_scale", "v_scale"):   # per tensor: an FP8 KV cache's too
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
        grouped = scheme.group_size != -1     # -1: one group the whole K (AutoAWQ's meaning)
        if suffix == "qweight":
            return TensorAxes(Axis(1, 8), Axis(0))
        if suffix == "qzeros":
            return TensorAxes(Axis(1, 8), Axis(0, scheme.group_size) if grouped else None)
        if suffix == "scales":
            return TensorAxes(Axis(1), Axis(0, scheme.group_size) if grouped else None)
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
    if scheme.method == "int-quantized" and suffix in ("weight_scale", "weight_zero_point"):
        if scheme.strategy == "tensor":
            return TensorAxes(None, None)                   # replicated (per tensor)
        grouped = scheme.group_size != -1
        return TensorAxes(Axis(0), Axis(1, scheme.group_size) if grouped else None)
    if scheme.method in ("nvfp4", "mxfp4"):
        if suffix == "weight_packed":
            return TensorAxes(Axis(0), Axis(1, 2))          # two FP4 codes per byte along K
        if suffix == "weight_scale":
            return TensorAxes(Axis(0), Axis(1, scheme.group_size))
        if suffix in ("weight_global_scale", "input_global_scale"):
            return TensorAxes(None, None)                   # per tensor (per module): replicated
    return None
