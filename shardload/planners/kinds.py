"""The kinds of checkpoint the planner reads its model from: HF, GGUF and MLC.

Each kind knows where its checkpoint keeps the model's metadata and reads it into the model's
sizes (``spec.ModelSpec``, whose architecture row says how its tensors are named) and its
quantization (``formats.Scheme``). A kind is chosen by the reader that opened the checkpoint,
else (a checkpoint in memory, a user's reader) by its config's own marks.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..config_fields import Fields
from ..errors import REPLICATE, SHARD_INFO, PlanError, mention
from ..formats import Scheme, scheme_from_hf
from .spec import ModelSpec, spec_from_gguf, spec_from_hf, spec_from_mlc

__all__ = ["KINDS", "checkpoint_kind", "detect"]

#: MLC quantizations the planner splits (q0: unquantized)
MLC_QUANTIZATIONS = ("q4f16_1", "q0f16", "q0f32")


def _folder(source: str) -> str:
    return source if os.path.isdir(source) else os.path.dirname(source)


def _local_path(ckpt) -> str:
    """Where the checkpoint's files are on this machine: its source, or, for one brought from
    object storage, the scratch folder holding its side files (``Checkpoint.name_of`` says
    them as URLs)."""
    return ckpt.source if ckpt.named_as is None else ckpt.path


def _no_config(source: str, what: str) -> PlanError:
    error = PlanError(
        f"no plan, and no model config next to the checkpoint ({what}) to write "
        f"one from: pass a plan ({SHARD_INFO.python}, or a shard_info.json beside "
        f"the checkpoint), add the model's config, or choose to replicate every "
        f"tensor ({REPLICATE.python})",
        source=source,
    )
    mention(error, SHARD_INFO, REPLICATE)
    return error


class _QuantizationFile:
    """Which file an HF checkpoint's ``quantization_config`` came from: ``config.json``'s own,
    or a side file the reader merges in when the config has none (``quantize_config.json``,
    AutoGPTQ; ``hf_quant_config.json``, ModelOpt). Decided only when a message needs it (it
    re-reads the small config.json)."""

    def __init__(self, folder: str, name_of: Callable[[str], str] = str):
        from ..readers.safetensors import QUANT_SIDE_FILES

        self.config = os.path.join(folder, "config.json")
        self.sides = [os.path.join(folder, side) for side in QUANT_SIDE_FILES]
        self._label: str | None = None
        self._name_of = name_of  # what messages call a local file (a URL, for an object's)

    def __call__(self) -> str:
        if self._label is None:
            found = self._find()
            for path in (self.config, *self.sides):
                found = found.replace(path, self._name_of(path))
            self._label = found
        return self._label

    def _find(self) -> str:
        sides = [side for side in self.sides if os.path.isfile(side)]
        if not sides:
            return self.config
        try:
            from ..files import MAX_SIDE_FILE_BYTES, read_json

            own = read_json(self.config, MAX_SIDE_FILE_BYTES)
        except Exception:  # noqa: BLE001 - only a label: say both
            return f"{self.config} (or {sides[0]}, merged in as quantization_config)"
        if isinstance(own, dict) and "quantization_config" in own:
            return self.config
        return sides[0]


def _read_gguf(ckpt) -> tuple[ModelSpec, Scheme]:
    return (spec_from_gguf(Fields(ckpt.config, file=ckpt.source)), Scheme("gguf", file=ckpt.source))


def _read_mlc(ckpt) -> tuple[ModelSpec, Scheme]:
    config, source = ckpt.config, ckpt.source
    if not set(config) - {"tensor_cache_metadata"}:
        raise _no_config(source, "mlc-chat-config.json")
    local = _local_path(ckpt)
    label = (
        ckpt.name_of(os.path.join(local, "mlc-chat-config.json"))
        if os.path.isdir(local)
        else source
    )
    cfg = Fields(config, file=label)
    quant = cfg.str("quantization")
    if quant not in MLC_QUANTIZATIONS:
        raise PlanError(
            f"key 'quantization' is {quant!r}: that MLC quantization is not "
            "supported: q4f16_1 is (its weights are stored NK, out-features "
            "first); KN layouts such as q4f16_0 would need a transpose",
            source=label,
        )
    return spec_from_mlc(cfg), Scheme("mlc", file=label)


def _read_hf(ckpt) -> tuple[ModelSpec, Scheme]:
    config, source = ckpt.config, ckpt.source
    if not config:
        raise _no_config(source, "config.json, GGUF metadata or mlc-chat-config.json")
    quant_file: str | Callable[[], str]
    local = _local_path(ckpt)
    if isinstance(local, str) and os.path.exists(local):
        folder = _folder(local)
        label = ckpt.name_of(os.path.join(folder, "config.json"))
        quant_file = _QuantizationFile(folder, ckpt.name_of)
    else:  # a checkpoint not read from files: its config has no file to name
        label = quant_file = f"{source} (its config)"
    cfg = Fields(config, file=label)
    return spec_from_hf(cfg), scheme_from_hf(cfg, quant_file=quant_file)


#: kind -> how its metadata is read
KINDS = {"gguf": _read_gguf, "mlc": _read_mlc, "hf": _read_hf}


def checkpoint_kind(ckpt) -> str:
    """``gguf``, ``mlc`` or ``hf``: by the reader that opened the checkpoint; for other
    checkpoints (in memory, user subclasses), by the config's own marks."""
    from ..readers.safetensors import SafetensorsCheckpoint

    # safetensors first: the GGUF reader imports the gguf package, a few tenths of a second
    # that a load of a safetensors checkpoint (an engine's start) need not pay
    if isinstance(ckpt, SafetensorsCheckpoint):
        return "hf"
    from ..readers.gguf import GGUFCheckpoint
    from ..readers.mlc import MLCCheckpoint

    if isinstance(ckpt, GGUFCheckpoint):
        return "gguf"
    if isinstance(ckpt, MLCCheckpoint):
        return "mlc"
    config = ckpt.config
    if "general.architecture" in config:
        return "gguf"
    if "model_config" in config and isinstance(config.get("quantization"), str):
        return "mlc"
    return "hf"


def detect(ckpt) -> tuple[str, ModelSpec, Scheme]:
    """The checkpoint's kind, the model's sizes and its quantization."""
    kind = checkpoint_kind(ckpt)
    spec, scheme = KINDS[kind](ckpt)
    return kind, spec, scheme
