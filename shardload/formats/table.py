"""The table of quantization formats, and of the configs each reads.

Formats are registered by name (``Scheme.method``) in a ``shardload.table.Table``; each format's
``configs`` (config key -> reader: ``"gptq"``, ``"compressed-tensors/pack-quantized"``) are
kept in the order they were registered, which is the order messages list them in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..table import Table

if TYPE_CHECKING:  # pragma: no cover
    from .base import ConfigReader, QuantFormat

__all__ = [
    "config_readers",
    "get_format",
    "list_formats",
    "register_format",
    "unregister_format",
]


def _unknown(name: str, known: list[str]) -> ValueError:
    return ValueError(f"unknown quantization method {name!r}; known: {', '.join(known)}")


FORMATS: Table[QuantFormat] = Table("quantization format", _unknown)
#: config key -> (format name, reader), in the order formats were registered
_readers: dict[str, tuple[str, ConfigReader]] = {}


def register_format(fmt: QuantFormat, *, override: bool = False) -> QuantFormat:
    """Add ``fmt`` to the table (under ``fmt.name``), with the configs it reads. A name or a
    config key another format has is refused unless ``override``."""
    from .base import QuantFormat

    if not isinstance(fmt, QuantFormat) or not fmt.name:
        raise TypeError(f"a format is a QuantFormat instance with a name, got {fmt!r}")
    with FORMATS.lock:
        if not override:
            for key in fmt.configs:
                taken = _readers.get(key)
                if taken is not None and taken[0] != fmt.name:
                    raise ValueError(
                        f"the config {key!r} is already read by the quantization "
                        f"format {taken[0]!r}"
                    )
        FORMATS.add(fmt, override)
        for key, reader in fmt.configs.items():
            _readers[key] = (fmt.name, reader)
    return fmt


def unregister_format(name: str) -> None:
    """Remove the format ``name`` and the configs it reads (tests)."""
    with FORMATS.lock:
        FORMATS.remove(name)
        for key in [k for k, (owner, _) in _readers.items() if owner == name]:
            del _readers[key]


def get_format(name: str) -> QuantFormat:
    """The format registered as ``name``; ``ValueError`` naming those known if there is none."""
    return FORMATS.get(name)


def list_formats() -> list[QuantFormat]:
    """Every registered format, sorted by name."""
    return FORMATS.entries()


def config_readers() -> dict[str, ConfigReader]:
    """Every config key a registered format reads, and its reader, in registration order."""
    with FORMATS.lock:
        return {key: reader for key, (_, reader) in _readers.items()}
