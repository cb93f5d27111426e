"""A GGUF checkpoint as transformers reads one, without transformers reading the file: its
config, its tensor names and its tensor processing (llama.cpp's q/k permutation reversed,
Gemma's ``w + 1`` norms, MoE experts fused), applied to the pieces a worker already holds.

transformers' own GGUF loader (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``) parses
every key-value of the file with gguf-py's reader, the vocabulary and merges included (about
4 s for a 49k-token vocabulary), and dequantizes every tensor. shardload has read and split the
tensors already, so:

* the controller reads the config once (``config_dict``: transformers' own key tables,
  ``GGUF_CONFIG_MAPPING``, applied to the metadata shardload's reader has parsed) and the
  GGUF-to-transformers name of every tensor (``weights_map``: transformers'
  ``get_gguf_hf_weights_map`` on the model class built on the meta device), and sends both to
  the workers;
* each worker dequantizes its pieces (``shardload.formats``: gguf-py's dequantization, the one
  transformers uses), runs them through transformers' tensor processor for the architecture
  (``TENSOR_PROCESSORS``) with its own head counts, and hands the state dict to the model
  class's ``from_pretrained`` (``state_dict``), as transformers' loader does with the tensors
  it has read.

>>> config = config_dict(open_checkpoint("model.gguf"))                     # doctest: +SKIP
>>> config["model_type"], config["num_attention_heads"]
('llama', 9)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

__all__ = ["config_dict", "model_class", "state_dict", "weights_map"]

#: transformers' names of GGUF architectures whose model type differs (``load_gguf_checkpoint``)
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
#: architectures whose config ``load_gguf_checkpoint`` builds with code of their own, beyond its
#: key tables (t5, stablelm, lfm2, gpt-oss, minimax-m2, gemma4): transformers reads those
_OWN_CODE = ("t5", "stablelm", "lfm2", "gpt", "minimax", "gemma4")
#: architectures transformers ties lm_head to the embeddings for, whatever the file holds
_ALWAYS_TIED = ("falcon", "bloom")


def config_dict(ckpt) -> dict[str, Any]:
    """transformers' config of the GGUF checkpoint ``ckpt`` (an open ``GGUFCheckpoint``), as a
    dict for ``AutoConfig.for_model``: what ``load_gguf_checkpoint(path)["config"]`` returns,
    from the key-values ``ckpt`` has parsed (``tests/test_hf_gguf_architectures.py`` checks
    that they are equal)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    fields = ckpt.config  # every key-value but the vocabulary-sized arrays
    arch = fields["general.architecture"]
    if any(part in arch for part in _OWN_CODE):
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        return load_gguf_checkpoint(ckpt.path, return_tensors=False)["config"]
    model_type = _MODEL_TYPES.get(arch, arch)
    if "llama" in arch and fields.get("general.name") == "mistral":
        model_type = "mistral"  # transformers' reading of llama.cpp's Mistral
    if arch not in GGUF_CONFIG_MAPPING and model_type not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF model with architecture {arch} is not supported yet.")
    config: dict[str, Any] = {
        "tie_word_embeddings": "output.weight" not in ckpt.metadata() or arch in _ALWAYS_TIED
    }
    for key, default in (
        GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}
    ).items():
        config.setdefault(key, default)
    # GGUF key -> config key, per architecture (None: a key transformers drops); transformers
    # builds the table from literals, which its types leave as ``dict[str, object]``
    renames = cast("Mapping[str, Mapping[str, str | None]]", GGUF_CONFIG_MAPPING)
    for key, value in fields.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers reads a one-item array as its item
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, model_type)
        renamed = renames.get(prefix, {}).get(rest)  # None: absent, or dropped
        if renamed is not None:
            config[renamed] = value
    if config["model_type"] == "gemma3":
        config["model_type"] = "gemma3_text"  # a GGUF holds Gemma 3's text model only
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in ckpt.field_names():
        config["vocab_size"] = len(ckpt.field("tokenizer.ggml.tokens"))
    return config


_NAME_MAPS = threading.Lock()


@contextlib.contextmanager
def _one_name_map_per_model():
    """gguf-py's ``get_tensor_name_map(arch, layers)`` while it is the same for every call.

    transformers' ``get_gguf_hf_weights_map`` walks the model's modules and builds gguf-py's
    ``TensorNameMap`` again for each (about 20 ms each, 5 s for a 30-layer model); it is a pure
    function of its arguments, so one per architecture and layer count serves them all."""
    import gguf

    with _NAME_MAPS:
        original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = original


def model_class(config):
    """transformers' causal-LM class for ``config`` (what ``AutoModelForCausalLM`` picks)."""
    import transformers

    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def weights_map(config: dict[str, Any], arch: str) -> dict[str, str]:
    """GGUF tensor name -> transformers parameter name, for the model of ``config`` (a
    ``config_dict``): transformers' ``get_gguf_hf_weights_map``, on the model class built on
    the meta device (no memory, no initialisation). The names do not depend on a worker's
    sizes, so the controller works them out once."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        skeleton = model_class(hf_config)(hf_config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    with _one_name_map_per_model():
        return get_gguf_hf_weights_map(skeleton, processor)


def state_dict(
    arrays: dict[str, np.ndarray],
    arch: str,
    config: dict[str, Any],
    mapping: dict[str, str],
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """transformers' parameters from dequantized GGUF tensors (float32, under GGUF names), as
    ``load_gguf_checkpoint`` makes them: each through the architecture's tensor processor
    (``config`` holds this worker's head counts: llama's q/k permutation is reversed within
    each of its heads), renamed by ``mapping``, cast to ``dtype``. Tensors the model has no
    parameter for are dropped, as transformers drops them. ``arrays`` is emptied as it goes
    (each dequantized tensor freed once converted)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    parsed: dict[str, dict] = {"tensors": {}}  # MoE processors fuse experts into it
    for name in list(arrays):
        result = processor.process(
            weights=arrays.pop(name),
            name=name,
            tensor_key_mapping=mapping,
            parsed_parameters=parsed,
        )
        if result.name in mapping:
            tensor = torch.from_numpy(np.ascontiguousarray(result.weights))
            parsed["tensors"][mapping[result.name]] = tensor.to(dtype)
    return parsed["tensors"]
