"""Building transformers' own model of a worker's share, on the worker (``build``, a session
function, so it runs the same on threads, worker processes and torchrun ranks):

1. the worker's state dict, in memory (``weights``: dequantized, biases zeroed, KV heads
   expanded where needed);
2. transformers' config of the whole model, which transformers' own checks accept, given this
   worker's sizes (its heads, its MLP rows) after it is built;
3. the model class's ``from_pretrained`` with that config and state dict, for every format, so
   every name conversion and every architecture's forward is transformers' own;
4. a forward hook summing the outputs of every decoder layer's attention and MLP over the
   workers (the session's collectives, ``ctx.group``): the row-parallel reduction; and norms
   over a whole split projection computed over the workers (``_SplitNorm``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import cast

import torch

from .. import dtypes
from ..sessions import register_session_func
from . import weights

__all__ = ["BUILD", "build", "built"]

BUILD = "shardload.hf.build"

#: transformers' loading sets process-wide flags (no_init_weights, no_tie_weights) while it
#: runs, so two threads loading at once corrupt each other's models (an untied lm_head): the
#: workers of a ThreadedSession load one at a time
_LOADING = threading.Lock()
#: modules of a decoder layer whose outputs are partial sums under tensor parallelism
_REDUCED = ("self_attn", "mlp", "block_sparse_moe")


class Built:
    """One worker's model and the session's collectives it reduces over (None: one worker)."""

    def __init__(self, model, group):
        self.model = model
        self.group = group


def _key(token: str) -> str:
    return f"shardload.hf.model:{token}"


def built(ctx, token: str) -> Built:
    """The model ``build`` made on this worker under ``token``."""
    found = ctx.values.get(_key(token))
    if found is None:
        raise RuntimeError(f"worker {ctx.rank} has no model {token!r} (released, or never built)")
    return found


def release(ctx, token: str) -> None:
    ctx.values.pop(_key(token), None)


@register_session_func(BUILD)
def build(ctx, spec: dict) -> dict:
    """Build this worker's model from its shards (see the module docstring); ``spec`` is what
    the controller worked out for this worker (``model.py``)."""
    import transformers

    from .from_gguf import model_class

    dtype = dtypes.to_torch(spec["dtype"])
    gguf = spec.get("gguf")
    state = (weights.gguf_state if gguf else weights.hf_state)(ctx, spec, dtype)
    extra = _experts_implementation(spec)
    with _LOADING, _quiet(transformers):
        config = _gguf_config(transformers, spec) if gguf else _hf_config(spec)
        model = model_class(config).from_pretrained(
            None, config=config, state_dict=state, dtype=dtype, **extra
        )
    del state
    model.eval()
    group = ctx.group if ctx.world_size > 1 else None
    if spec.get("split_norms"):
        _split_norms(model, spec["split_norms"], group)
    if group is not None:
        _reduce_outputs(model, group)
    ctx.values[_key(spec["token"])] = Built(model, group)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _hf_config(spec: dict):
    """transformers' config of an HF checkpoint's config.json (``spec["config"]``), as
    ``AutoConfig.from_pretrained`` makes it from the file, given this worker's sizes."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = dict(spec["config"])
    if config.get("model_type") == "mistral" and "layer_types" in config:
        config["model_type"] = "ministral"  # AutoConfig.from_pretrained's reading of it
    hf = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    _set_sizes(hf, spec["sizes"])
    return hf


def _gguf_config(transformers, spec: dict):
    """transformers' config of a GGUF (``from_gguf.config_dict``), given this worker's sizes
    (transformers reads some from no GGUF key: Qwen2's head size, the expert widths)."""
    config = transformers.AutoConfig.for_model(**spec["gguf"]["config"])
    for key, value in spec["sizes"].items():
        if key == "head_dim" or hasattr(config, key):
            setattr(config, key, value)
    return config


def _experts_implementation(spec: dict) -> dict:
    """``from_pretrained``'s experts implementation: torch's grouped_mm wants 16-byte strides,
    which a worker's share of an expert (11 rows of 32 at N=3) need not have; transformers'
    reference loop has no such rule."""
    return {"experts_implementation": "eager"} if spec.get("eager_experts") else {}


def _set_sizes(config, sizes: dict[str, int]) -> None:
    """This worker's sizes on transformers' config object, each at its key's path
    (``text_config.num_attention_heads``). Set after the config is built: transformers checks
    a config's sizes against each other when it is made (hidden_size a multiple of the heads),
    which a worker's share of the heads need not be."""
    for path, value in sizes.items():
        *parents, key = path.split(".")
        target = config
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, key, value)


@contextlib.contextmanager
def _quiet(transformers):
    """No "Loading weights" bar from every worker (restored afterwards)."""
    bars = transformers.utils.logging
    was = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            bars.enable_progress_bar()


class _SplitNorm(torch.nn.Module):
    """An RMS norm over a whole projection split across workers (OLMo-2's q_norm, k_norm):
    each worker adds up the squares of its heads (weighted, so that a replicated head counts
    once), the sums are summed over the workers, and every worker normalises its part by the
    whole projection's mean square."""

    def __init__(self, norm: torch.nn.Module, split: dict, group):
        super().__init__()
        # a Parameter (``Module.__getattr__`` is typed as giving a tensor or a module)
        self.weight = cast(torch.nn.Parameter, norm.weight)
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        self.width = split["width"]
        self.head_dim = split["head_dim"]
        self.register_buffer("head_weights", torch.tensor(split["weights"]), persistent=False)
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        heads = hidden.pow(2).unflatten(-1, (-1, self.head_dim)).sum(-1)
        total = (heads * self.head_weights).sum(-1, keepdim=True)
        if self.group is not None:
            total = self.group.all_reduce(total.contiguous())
        hidden = hidden * torch.rsqrt(total / self.width + self.eps)
        return (self.weight * hidden).to(dtype)


def _split_norms(model, norms: dict, group) -> None:
    """Replace the norms ``norms`` names in every attention with ``_SplitNorm``."""
    for name, module in list(model.named_modules()):
        for norm, split in norms.items():
            child = getattr(module, norm, None)
            if name.endswith("self_attn") and isinstance(child, torch.nn.Module):
                setattr(module, norm, _SplitNorm(child, split, group))


def _reduce_outputs(model, group) -> None:
    """Sum every decoder layer's attention and MLP outputs over the workers."""

    def hook(module, args, output):
        if isinstance(output, tuple):
            group.all_reduce(output[0])
        else:
            group.all_reduce(output)
        return output

    for name, module in model.named_modules():
        if name.rpartition(".")[2] in _REDUCED and ".layers." in f".{name}":
            module.register_forward_hook(hook)
