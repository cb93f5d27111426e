"""Which format a checkpoint's ``quantization_config`` describes, read into a ``Scheme``.

1. a top-level ``quantization`` (MLX, MLC) in an HF config is refused, saying why;
2. no ``quantization_config`` (or an empty one): unquantized (``Scheme("none")``);
3. ``quant_method`` is looked up: a refused method says why; a family (``families.py``) reads
   its own key to find the format; any other method is the key of a format's reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config_fields import Fields
from ..errors import PlanError
from .base import ConfigReader
from .families import FAMILIES
from .scheme import Scheme

#: methods refused with their reason
REFUSED = {
    "bitsandbytes": "bitsandbytes checkpoints are not supported: their 4-bit weights are "
    "flattened and their quantization state is per tensor, so they cannot be "
    "split without re-quantizing. Use a GPTQ, AWQ, compressed-tensors, FP8 or "
    "GGUF checkpoint of the model.",
}
REFUSED["bnb"] = REFUSED["bitsandbytes"]


def scheme_from_hf(
    config: Fields | Mapping[str, Any],
    source: str | None = None,
    *,
    quant_file: Any | None = None,
    readers: Mapping[str, ConfigReader],
) -> Scheme:
    """The scheme an HF config's ``quantization_config`` describes (``readers``: every config
    key a registered format reads; see ``formats.scheme_from_hf``)."""
    cfg = config if isinstance(config, Fields) else Fields(config, file=source or "<config>")
    if cfg.has("quantization", nullable=True):
        value = cfg.raw["quantization"]
        if isinstance(value, Mapping):
            raise PlanError(
                "key 'quantization' holds MLX-style quantization settings: MLX packs "
                "its weights in a layout the planner does not know, so it cannot "
                "split them; use a GPTQ, AWQ, compressed-tensors, FP8 or GGUF "
                "checkpoint of the model",
                source=cfg.file,
            )
        raise cfg.refuse(
            "quantization",
            value,
            "absent from an HF config.json (quantization settings belong under "
            "'quantization_config'; a top-level 'quantization' is MLC's or MLX's)",
        )
    quant = cfg.sub("quantization_config", optional=True, file=quant_file)
    if quant is None or not quant.raw:
        return Scheme("none", file=cfg.file_label)
    method = quant.str("quant_method").lower()
    if method in REFUSED:
        raise PlanError(REFUSED[method], source=quant.file)
    family = FAMILIES.get(method)
    if family is not None:
        prefix = f"{method}/"
        known = [key[len(prefix) :] for key in readers if key.startswith(prefix)]
        return family(quant, readers.get, known)
    reader = readers.get(method)
    if reader is None:
        methods = sorted({key.partition("/")[0] for key in readers} | set(FAMILIES))
        raise PlanError(
            f"key {quant.name('quant_method')!r} is {method!r}: that quantization "
            f"method is not supported by the planner ({', '.join(methods[:-1])} and "
            f"{methods[-1]} are)",
            source=quant.file,
        )
    return reader(quant)
