"""A checkpoint's quantization as one value: the format's name and its settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .table import get_format

if TYPE_CHECKING:  # pragma: no cover
    from .base import QuantFormat

__all__ = ["Scheme"]


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization, as far as sharding and dequantization care.

    ``method`` names the format (``formats.get_format(method)``). ``file`` is the file the
    quantization config came from (a name, or a function giving it: see ``source``) and
    ``keys`` the key each setting came from (``{"bits": "'quantization_config.bits'"}``), for
    messages.
    """

    method: str
    bits: int = 16
    group_size: int = -1
    act_order: bool = False
    block: tuple[int, int] = (128, 128)
    #: int-quantized: compressed-tensors' weight strategy (tensor, channel or group); fp8:
    #: ``block`` (HF fp8, DeepSeek; compressed-tensors strategy block), ``tensor`` or
    #: ``channel``, or "" (not said: the scale's shape tells)
    strategy: str = ""
    #: GPTQ: 1 (AutoGPTQ: zeros stored minus one) or 2 (``checkpoint_format: gptq_v2``)
    gptq_version: int = 1
    file: Any = field(default="", compare=False)
    keys: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def format(self) -> QuantFormat:
        return get_format(self.method)

    @property
    def source(self) -> str:
        """The file the quantization config came from, for messages."""
        return self.file() if callable(self.file) else self.file

    def describe(self) -> str:
        return self.format.describe(self)

    def explain(self, *attrs: str) -> str:
        """``'quantization_config.bits' = 4, ...``: settings with the keys they came from."""
        return ", ".join(f"{self.keys[a]} = {getattr(self, a)}" for a in attrs if a in self.keys)

    def to_json(self) -> dict:
        """What dequantizing needs of it (for a plan's record and for workers)."""
        return {
            "format": self.method,
            "bits": self.bits,
            "group_size": self.group_size,
            "gptq_version": self.gptq_version,
            "block": list(self.block),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Scheme:
        return cls(
            str(data["format"]),
            int(data.get("bits", 16)),
            int(data.get("group_size", -1)),
            block=tuple(data.get("block", (128, 128))),
            gptq_version=int(data.get("gptq_version", 1)),
        )
