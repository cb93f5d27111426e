"""What every quantization format is made of: axes, a scheme, and the ``QuantFormat`` protocol.

A linear layer ``y = x Wᵀ`` has ``W [N_out, K_in]``. Column-parallel splits N, row-parallel
splits K. A quantized layer stores W as several tensors (packed codes, scales, zero points,
group indices), each holding N and K along its own dims and in its own units. An ``Axis`` says
where one logical axis lies in one tensor: along ``dim``, every ``elems`` logical elements take
``width`` tensor units (a GPTQ 4-bit ``qweight`` holds K at 8 rows per int32 word: ``Axis(0, 8,
1)``; 3-bit holds 32 rows in 3 words: ``Axis(0, 32, 3)``; a GGUF Q4_1 row holds K at 32 elements
per 20-byte block: ``Axis(1, 32, 20)``). A tensor that does not hold an axis is replicated when
that axis is split.

A format (``QuantFormat``) is one module of ``shardload/formats/`` and owns everything the rest
of shardload needs to know of it:

1. **its config**: the ``quantization_config`` it recognises, read through ``Fields`` into a
   ``Scheme`` (``configs``: config key -> reader; ``formats.config`` dispatches);
2. **the tensors a module stores** and their axes (``axes``), with the flags the planner's
   split rules ask (``TensorAxes``);
3. **dequantization** of one module's stored tensors, whole or one worker's pieces
   (``dequantize``), and which tensors mark a module as stored quantized.

Formats are registered by name in one table (``formats.register_format``); nothing else in
shardload branches on a format's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config_fields import Fields
    from ..readers.base import TensorMeta
    from .scheme import Scheme

__all__ = ["ACTIVATION_PARTS", "Axis", "ConfigReader", "QuantFormat", "TensorAxes"]


@dataclass(frozen=True)
class Axis:
    dim: int
    elems: int = 1
    width: int = 1


@dataclass(frozen=True)
class TensorAxes:
    """Where N and K lie in one stored tensor, and what the planner's split rules must know of
    it beyond that:

    * ``special``: ``"g_idx"`` (a row's quantization group: whole on a column split, sliced
      and rebased, or with act-order only sliced, on a row split) or ``"shape"`` (the layer's
      ``[N, K]`` as data: rewritten per worker);
    * ``grouped``: K is stored in quantization groups of the scheme's ``group_size``, which
      must tile the layer's K;
    * ``act_order``: per-group scales or zero points that an act-order ``g_idx`` indexes: with
      act-order, any input row may use any group, so a row split keeps them all (replicated);
    * ``per_part``: a per-tensor scale; a fused layer storing one per part (``[q, k, v]`` ->
      3 scales) has them expanded to one per output row, exactly, and split like the rows.
    """

    n: Axis | None
    k: Axis | None
    special: str = ""
    grouped: bool = False
    act_order: bool = False
    per_part: bool = False


#: tensors of activation (or KV-cache) quantization stored beside a weight: not the weight's
ACTIVATION_PARTS = (
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "k_scale",
    "v_scale",
)


#: reads one config (a ``quantization_config``, or the part of it a family hands on) into a
#: ``Scheme``; extra keyword arguments are what the family found (compressed-tensors: the
#: ``weights`` of its config groups)
ConfigReader = Callable[..., "Scheme"]


class QuantFormat:
    """One quantization format. Subclass it in a module of ``shardload/formats/`` and register
    an instance (``formats.register_format``).

    ``name`` is ``Scheme.method``. ``parts`` are the tensors (suffixes) one module stores,
    besides ``bias`` and the activation scales; ``quantized_parts`` those whose presence marks a
    module as stored quantized (a module with a non-float ``weight`` is too). ``configs`` maps a
    config key (``"gptq"``, ``"compressed-tensors/pack-quantized"``, ``"modelopt/NVFP4"``) to
    the reader of that config; ``hf_style`` formats store linear layers with HF's suffixes, so
    the common tensors (``weight``, ``bias``, activation scales) are placed for them too.

    >>> class Toy(QuantFormat):                                          # doctest: +SKIP
    ...     name, parts, quantized_parts = "toy", ("codes", "scale"), ("codes",)
    ...     def tensor_axes(self, scheme, suffix, meta, fmt):
    ...         return {"codes": TensorAxes(Axis(0), Axis(1, 2)),
    ...                 "scale": TensorAxes(Axis(0), None)}.get(suffix)
    ...     def dense(self, parts, scheme, ggml_types):
    ...         ...
    """

    name: str = ""
    description: str = ""
    parts: tuple[str, ...] = ()
    quantized_parts: tuple[str, ...] = ()
    configs: Mapping[str, ConfigReader] = {}
    hf_style: bool = True
    #: the tensor holding a row's group (``g_idx``), if the format stores one
    g_idx_part: str | None = None
    #: how a checkpoint is known to be in this format when no config names it (for people)
    recognised_by: str = ""

    # -- 2. the tensors of a module, and their axes

    def axes(
        self, scheme: Scheme, suffix: str, meta: TensorMeta, fmt: Mapping[str, Any] | None = None
    ) -> TensorAxes | None:
        """Where N and K lie in the tensor ``<module>.<suffix>``; ``None`` if it is not part of
        a linear layer this format knows (it is then replicated). ``fmt`` is the reader's
        per-tensor format record (GGUF: its block type)."""
        if suffix == "bias":  # [rows], or [E, rows] for stacked experts (GGUF's *_exps.bias)
            return TensorAxes(Axis(len(meta.shape) - 1), None)
        found = self.tensor_axes(scheme, suffix, meta, fmt)
        if found is not None or not self.hf_style:
            return found
        return _common_axes(suffix, meta)

    def tensor_axes(
        self, scheme: Scheme, suffix: str, meta: TensorMeta, fmt: Mapping[str, Any] | None
    ) -> TensorAxes | None:
        """The format's own tensors' axes (``axes`` adds ``bias`` and the common ones)."""
        return None

    def zero_weight_fill(
        self, scheme: Scheme, parts: set[str], read: Callable[[str], torch.Tensor]
    ) -> int | None:
        """The stored element (a code, or a word of packed codes) that dequantizes to 0 in
        every column of a module storing ``parts`` (suffixes; ``read(suffix)`` reads one), or
        ``None`` where no one element does (zero points that differ by column).

        Zero-padded rows of a layer quantized per channel, on a row split, share their
        column's scale with the real rows: they are zero weights only when filled with this
        (``shardload.take_units_fill``). 0 where a stored 0 is a zero weight; codes with a zero
        point or an offset (GPTQ, AWQ, compressed-tensors' packed ints) say theirs."""
        return 0

    def stored_as(self, fmt: Mapping[str, Any] | None) -> str | None:
        """How the tensor stores its blocks when the tensor itself says (GGUF: ``Q4_K
        blocks``); ``None``: the scheme's settings say (bits, group size, block)."""
        return None

    def describe(self, scheme: Scheme) -> str:
        group = (
            "per-tensor"
            if scheme.strategy == "tensor"
            else "per-channel"
            if scheme.group_size == -1
            else f"group {scheme.group_size}"
        )
        act = ", act-order" if scheme.act_order else ""
        return f"{scheme.method} {scheme.bits}-bit {group}{act}"

    # -- 3. dequantization

    def is_quantized(self, parts: Mapping[str, Any]) -> bool:
        """Whether a module's stored ``parts`` (suffix -> tensor) hold quantized weights."""
        if set(self.quantized_parts).intersection(parts):
            return True
        weight = parts.get("weight")
        return weight is not None and not weight.is_floating_point()

    def dequantize(
        self,
        parts: Mapping[str, Any],
        scheme: Scheme,
        dtype: Any,
        ggml_types: Mapping[str, Any] | None = None,
    ) -> dict:
        """The dense parameters of one module: ``{"weight": [N, K]}`` (and ``"bias"``), cast to
        ``dtype``. An unknown part is refused, never silently dropped."""
        check_parts(self.name, parts, self.parts)
        weight = self.dense(parts, scheme, ggml_types or {})
        out = {"weight": weight.to(dtype).contiguous()}
        if "bias" in parts:
            out["bias"] = parts["bias"].to(dtype)
        return out

    def dense(self, parts: Mapping[str, Any], scheme: Scheme, ggml_types: Mapping[str, Any]) -> Any:
        """The float32 weight ``[N, K]`` of one module's stored ``parts``."""
        raise NotImplementedError(f"{self.name} cannot be dequantized")

    @property
    def module(self) -> str:
        """Where the format is defined (for the table's "already registered" message)."""
        return type(self).__module__

    def __repr__(self) -> str:
        return f"<quantization format {self.name!r}>"


def _common_axes(suffix: str, meta: TensorMeta) -> TensorAxes | None:
    """Tensors every HF-style checkpoint stores the same way, whatever its format."""
    if suffix in ("input_scale", "k_scale", "v_scale"):  # per tensor: an FP8 KV cache's too
        return TensorAxes(None, None)
    if suffix == "weight":
        return TensorAxes(Axis(0), Axis(1))
    return None


def check_parts(name: str, parts: Mapping[str, Any], known) -> None:
    """A part nobody reads would be silently lost: refuse it (activation scales excepted)."""
    unknown = sorted(set(parts) - set(known) - set(ACTIVATION_PARTS) - {"bias"})
    if unknown:
        raise ValueError(
            f"{name}: unknown parts {unknown} (this format stores {', '.join(known)}, bias)"
        )


def need(parts: Mapping[str, Any], name: str) -> Any:
    if name not in parts:
        raise ValueError(f"missing part {name!r} (got {', '.join(sorted(parts)) or 'none'})")
    return parts[name]


def keys_of(fields: Fields, **keys: str) -> dict[str, str]:
    """``{attr: "'quantization_config.bits'"}``: the key each setting came from, for messages."""
    return {attr: repr(fields.name(key)) for attr, key in keys.items()}
