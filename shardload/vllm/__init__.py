"""shardload as vLLM's load format (``vllm serve MODEL --load-format shardload -tp N``) and
weight-transfer backend (``WeightTransferConfig(backend="shardload")``: refits from a checkpoint,
``refit.py``).

Installed with the ``vllm`` extra, shardload registers its loader through vLLM's plugin entry
point (``vllm.general_plugins``), in every vLLM process (the API server, the engine core, each
worker), so nothing is imported by hand:

    vllm serve ckpt/ --load-format shardload --tensor-parallel-size 2
    vllm serve ckpt/ --load-format shardload --model-loader-extra-config '{"verify": true}'

>>> from vllm import LLM                                                    # doctest: +SKIP
>>> llm = LLM("ckpt/", load_format="shardload", tensor_parallel_size=2)

Each rank plans for (N, its rank), reads only its own bytes of the original (quantized)
checkpoint into full-shape stand-ins, and hands them to vLLM's own ``load_weights``
(``model_loader.py``). Where N does not divide the heads, ``vllm_overrides`` gives the
``--hf-overrides`` of the exactly zero-padded model (``padding.py``):

    shardload vllm-overrides --shards 4 ckpt/
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOAD_FORMAT", "register", "vllm_overrides"]

#: the name of the load format
LOAD_FORMAT = "shardload"

_registered = False


def register() -> None:
    """Register the load format with vLLM (the entry point; safe to call again and again)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from .model_loader import ShardloadModelLoader
    from .preflight import install

    register_model_loader(LOAD_FORMAT)(ShardloadModelLoader)
    install(LOAD_FORMAT)  # the padded model's --hf-overrides asked for before vLLM refuses N
    _register_weight_transfer()
    _registered = True


def _register_weight_transfer() -> None:
    """The weight-transfer backend ``shardload`` (``refit.py``), imported by vLLM only when an
    engine asks for it; a vLLM without the weight-transfer API has none to register."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    except ImportError:  # vLLM before its weight-transfer API (0.32 has it)
        return
    from .refit import BACKEND

    WeightTransferEngineFactory.register_engine(
        BACKEND, "shardload.vllm.refit", "ShardloadWeightTransferEngine"
    )


def vllm_overrides(
    checkpoint: Any, tensor_parallel_size: int, shard_info: Any = None, *, experts: str = "tp"
) -> dict:
    """``padding.vllm_overrides``: the ``hf_overrides`` for N (``{}`` where none are needed;
    ``experts="ep"`` under ``--enable-expert-parallel``)."""
    from .padding import vllm_overrides as overrides

    return overrides(checkpoint, tensor_parallel_size, shard_info, experts=experts)
