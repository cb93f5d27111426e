"""One line to serve: the padded model's ``--hf-overrides`` asked for before vLLM refuses N.

``vllm serve CKPT --load-format shardload -tp 8`` on a model whose heads or quantization groups
8 does not divide is refused by vLLM itself, in its config checks ("Total number of attention
heads ... must be divisible") or deep in a worker ("Input size (80) not supported"), before
shardload's loader runs. Where shardload's exact zero-padding serves that N, the user needs
one thing: the ``--hf-overrides`` of the padded model. So the loader's check that the model
vLLM builds is the one the plan loads (``model_loader._check_sizes``) also runs first, in
vLLM's config, before vLLM's own checks (``install`` wraps ``VllmConfig.__post_init__`` once,
from the plugin's ``register``):

1. only for ``--load-format shardload``, a local checkpoint (the ``checkpoint`` option or the
   model folder), tensor parallelism without expert parallelism (a plan vLLM's loader makes
   from its built model) and no plan of the user's own;
2. the sizes shardload's plan for N loads (``padding.vllm_overrides``: none, the padded ones,
   or a ``PlanError`` naming the N that work) against the model's config as vLLM will build
   it (its ``hf_overrides`` applied);
3. a mismatch is one ``PlanError`` line with the exact flag to add; else vLLM goes on.

    shardload: vLLM at tensor-parallel size 2 needs shardload's zero-padded model:
    add --hf-overrides '{"intermediate_size": 192}'
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import PlanError

__all__ = ["install", "preflight"]


def preflight(config: Any, load_format: str = "shardload") -> None:
    """Steps 1 to 3 of the module docstring on vLLM's ``VllmConfig`` (before it verifies),
    for the load format registered as ``load_format``."""
    from .options import LoaderOptions
    from .padding import vllm_overrides

    load, model, parallel = config.load_config, config.model_config, config.parallel_config
    if model is None or load is None or str(load.load_format) != load_format:
        return
    options = LoaderOptions.from_extra_config(load.model_loader_extra_config)
    checkpoint = options.checkpoint or model.model
    if (options.plan is not None or parallel.enable_expert_parallel
            or not os.path.isdir(str(checkpoint))):
        return
    n = parallel.tensor_parallel_size
    try:
        wanted = vllm_overrides(checkpoint, n)
    except PlanError as exc:
        raise PlanError(f"shardload cannot serve {checkpoint} at tensor-parallel size {n}: "
                        f"{exc.reason}") from None
    built = model.hf_text_config
    flat = dict(_flatten(wanted))
    wrong = {k: v for k, v in flat.items() if _get(built, k) not in (None, v)}
    if wrong:
        raise PlanError(f"vLLM at tensor-parallel size {n} needs shardload's zero-padded "
                        f"model: add --hf-overrides '{json.dumps(wanted)}'")


def _flatten(nested: dict, prefix: str = ""):
    for key, value in nested.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _get(config: Any, dotted: str) -> Any:
    """A (possibly nested, ``text_config.x``) size of the config vLLM built; the last part
    is looked up on the text config vLLM built, which is where its sizes live."""
    return getattr(config, dotted.rsplit(".", 1)[-1], None)


def install(load_format: str) -> None:
    """Run ``preflight`` for ``load_format`` before vLLM's own checks of every ``VllmConfig``
    (once)."""
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, "_shardload_preflight", False):
        return

    def __post_init__(self, *args, **kwargs):
        preflight(self, load_format)
        return original(self, *args, **kwargs)

    __post_init__._shardload_preflight = True          # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__
