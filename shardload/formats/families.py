"""Config families: a ``quant_method`` whose config names one of several formats.

* ``compressed-tensors``: its ``format`` (``pack-quantized``, ``int-quantized``,
  ``float-quantized``, ``nvfp4-pack-quantized``, ``mxfp4-pack-quantized``) names the format; the
  weights' settings are those of its ``config_groups``, which must all agree. The format's
  reader is registered under ``compressed-tensors/<format>`` and gets them as ``weights``.
* ``modelopt``: its ``quant_algo`` (``NVFP4``, ``FP8``) names the format, under
  ``modelopt/<algo>``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import PlanError
from .base import ConfigReader
from .scheme import Scheme

Lookup = Callable[[str], ConfigReader | None]


def read_compressed_tensors_family(quant, lookup: Lookup, known: list[str]) -> Scheme:
    fmt = quant.str("format", default="", nullable=True)
    groups = quant.sub("config_groups")
    names = list(groups.keys())
    if not names:
        raise quant.error("config_groups", "is empty; it must name at least one scheme")
    weights = [groups.sub(name).sub("weights") for name in names]
    first = weights[0]
    if any(w.raw != first.raw for w in weights[1:]):
        raise PlanError(
            "compressed-tensors configs with several different weight schemes are "
            "not supported yet",
            source=quant.file,
        )
    reader = lookup(f"compressed-tensors/{fmt}")
    if reader is None:
        raise PlanError(
            f"key {quant.name('format')!r} is {fmt!r}: that compressed-tensors "
            f"format is not supported ({', '.join(known)} are)",
            source=quant.file,
        )
    return reader(quant, weights=first)


def read_modelopt_family(quant, lookup: Lookup, known: list[str]) -> Scheme:
    """NVIDIA ModelOpt's export (``quant_algo`` in ``quantization_config``, or in
    ``hf_quant_config.json``'s ``quantization``)."""
    algo = quant.str("quant_algo")
    reader = lookup(f"modelopt/{algo}")
    if reader is None:
        raise PlanError(
            f"key {quant.name('quant_algo')!r} is {algo!r}: ModelOpt checkpoints in "
            f"{' and '.join(known)} are supported by the planner",
            source=quant.file,
        )
    return reader(quant)


#: quant_method -> the family reader
FAMILIES = {"compressed-tensors": read_compressed_tensors_family, "modelopt": read_modelopt_family}
