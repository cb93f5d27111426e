"""One line to serve: the padded model's ``--hf-overrides`` asked for before vLLM refuses N.

``vllm serve CKPT --load-format shardload -tp 8`` on a model whose heads or quantization groups
8 does not divide is refused by vLLM itself, in its config checks ("Total number of attention
heads ... must be divisible") or deep in a worker ("Input size (80) not supported"), before
shardload's loader runs. Where shardload's exact zero-padding serves that N, the user needs
one thing: the ``--hf-overrides`` of the padded model. So the loader's check that the model
vLLM builds is the one the plan loads (``padding.check_built``) also runs first, in
vLLM's config, before vLLM's own checks (``install`` wraps ``VllmConfig.__post_init__`` once,
from the plugin's ``register``):

1. only for ``--load-format shardload``, a local checkpoint (the ``checkpoint`` option or the
   model folder) and no plan of the user's own; under ``--enable-expert-parallel`` the plan is
   the one the loader makes there (``experts="ep"``: routed experts whole on their ranks);
2. the plan shardload loads at N (``padding.validated_for_vllm``, or a ``PlanError`` naming
   the N that work), its sizes against the model's config as vLLM will build it (its
   ``hf_overrides`` applied: ``padding.check_built``);
3. a mismatch is one ``PlanError`` line with the exact flag to add; else vLLM goes on.

    PlanError: vLLM at tensor-parallel size 2 builds the model with intermediate_size=160,
    but shardload's plan loads intermediate_size=192, its zero-padded model: add
    --hf-overrides '{"num_attention_heads": 8, ..., "intermediate_size": 192}'
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import PlanError

__all__ = ["install", "preflight"]


def preflight(config: Any, load_format: str = "shardload") -> None:
    """Steps 1 to 3 of the module docstring on vLLM's ``VllmConfig`` (before it verifies),
    for the load format registered as ``load_format``."""
    from .options import LoaderOptions
    from .padding import check_built, validated_for_vllm

    load, model, parallel = config.load_config, config.model_config, config.parallel_config
    if model is None or load is None or str(load.load_format) != load_format:
        return
    options = LoaderOptions.from_extra_config(load.model_loader_extra_config)
    checkpoint = options.checkpoint or model.model
    if options.plan is not None or not os.path.isdir(str(checkpoint)):
        return
    n = parallel.tensor_parallel_size
    experts = "ep" if parallel.enable_expert_parallel and model.is_moe else "tp"
    try:
        validated = validated_for_vllm(checkpoint, n, experts=experts)
    except PlanError as exc:
        raise PlanError(
            f"shardload cannot serve {checkpoint} at tensor-parallel size {n}: {exc.reason}"
        ) from None
    check_built(validated, model.hf_text_config)


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

    __post_init__._shardload_preflight = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__
