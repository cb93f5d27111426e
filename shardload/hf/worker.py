"""What each worker runs for ``load_tp_model``: build transformers' own model from its shards,
run forwards, generate. Session functions, so they run the same on threads, worker processes
and torchrun ranks.

Building, on each worker (``build``):

1. group the worker's shards by module and dequantize each quantized module to the chosen dtype
   (``shardload.formats``): the dense weights of the worker's share, under the checkpoint's
   names;
2. zero the row-parallel biases on every worker but 0 (they are added once, after the sum);
3. where the worker's query heads do not use its KV heads in transformers' regular pattern (some
   zero-padded layouts), give each query head its own copy of its KV head;
4. let transformers load them, with the checkpoint's config given this worker's sizes (its
   heads, its MLP rows, set on the config object after it is built, as transformers' own
   checks want the whole model's sizes), so every name conversion and every architecture's
   forward is transformers' own: an HF checkpoint's dense weights through ``from_pretrained``
   of a folder in memory (``/dev/shm``); a GGUF's as transformers' GGUF loader makes them
   (``from_gguf``: its names, its tensor processors), handed to ``from_pretrained`` as a state
   dict, with no file written or parsed;
5. add a forward hook summing the outputs of every decoder layer's attention and MLP over the
   workers (the session's collectives, ``ctx.group``): the row-parallel reduction.

Each worker reports the bytes of the pieces it has dequantized as progress (``ctx.progress``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

import torch

from ..sessions import register_session_func

BUILD = "shardload.hf.build"
FORWARD = "shardload.hf.forward"
GENERATE = "shardload.hf.generate"
RELEASE = "shardload.hf.release"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: transformers' loading sets process-wide flags (no_init_weights, no_tie_weights) while it
#: runs, so two threads loading at once corrupt each other's models (an untied lm_head): the
#: workers of a ThreadedSession load one at a time
_LOADING = threading.Lock()
#: modules of a decoder layer whose outputs are partial sums under tensor parallelism
_REDUCED = ("self_attn", "mlp", "block_sparse_moe")


class _Built:
    """One worker's model and the session's collectives it reduces over (None: one worker)."""

    def __init__(self, model, group):
        self.model = model
        self.group = group


def _key(token: str) -> str:
    return f"shardload.hf.model:{token}"


def dense_weights(shards: dict[str, torch.Tensor], quant: dict,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The worker's shards as dense tensors under the checkpoint's names: quantized modules
    dequantized (``shardload.formats``, by the plan's record of the quantization), float tensors
    cast, everything else (scales of replicated layers that are not weights, index tensors)
    dropped."""
    from .. import formats

    scheme = formats.Scheme.from_json(quant)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in shards.items():
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = tensor
    out: dict[str, torch.Tensor] = {}
    for module, parts in modules.items():
        prefix = f"{module}." if module else ""
        if formats.is_quantized(scheme.method, parts):
            dense = formats.dequantize_module(
                scheme.method, parts, bits=scheme.bits, group_size=scheme.group_size,
                gptq_version=scheme.gptq_version, block=scheme.block, dtype=dtype)
        else:
            dense = {k: t for k, t in parts.items() if t.is_floating_point()}
        for key, tensor in dense.items():
            out[prefix + key] = tensor.to(dtype).contiguous()
    return out


def _fill_in_experts(dense: dict[str, torch.Tensor], ep: dict, dtype: torch.dtype) -> None:
    """Expert parallelism: transformers' MoE block routes over every expert, so the experts
    other workers hold become zero stand-ins (a zero expert adds nothing; the sum over the
    workers is the whole block). Stacked experts (gpt-oss) are scattered from this worker's
    slots to their places; shared experts sized from the experts' width (DeepSeek) are
    zero-padded to it (``ep["pad"]``)."""
    for name, shape in ep["missing"].items():
        dense[name] = torch.zeros(shape, dtype=dtype)
    held, stacked = ep["experts_per_worker"], set(ep.get("stacked", ()))
    for name in list(dense):
        if name.rpartition(".")[0] not in stacked:
            continue
        piece = dense[name]
        count = next(int(e) for e, ids in held.items() if len(ids) == piece.shape[0])
        whole = piece.new_zeros((count, *piece.shape[1:]))
        for slot, expert in enumerate(held[str(count)]):
            if expert >= 0:
                whole[expert] = piece[slot]
        dense[name] = whole
    for name, shape in ep["pad"].items():
        if name in dense:
            piece = dense[name]
            whole = piece.new_zeros(shape)
            whole[:piece.shape[0], :piece.shape[1]] = piece
            dense[name] = whole


def _expand_kv(dense: dict[str, torch.Tensor], kv_map: list[int], head_dim: int,
               kv_modules: list[str]) -> None:
    """Give each local query head its own copy of the KV head it uses (``kv_map[h]``, a local
    KV index), where zero-padding made the pattern irregular for transformers' repeat_kv."""
    rows = torch.cat([torch.arange(k * head_dim, (k + 1) * head_dim) for k in kv_map])
    kv_modules = set(kv_modules)
    for name in list(dense):
        if name.rpartition(".")[0] in kv_modules:
            dense[name] = dense[name].index_select(0, rows).contiguous()


class _SplitNorm(torch.nn.Module):
    """An RMS norm over a whole projection split across workers (OLMo-2's q_norm, k_norm):
    each worker adds up the squares of its heads (weighted, so that a replicated head counts
    once), the sums are summed over the workers, and every worker normalises its part by the
    whole projection's mean square."""

    def __init__(self, norm: torch.nn.Module, split: dict, group):
        super().__init__()
        self.weight = norm.weight
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


class _Shared:
    """Replicated pieces dequantized once per process: the workers of one build that share a
    process (a ThreadedSession's threads) hold the same replicated pieces (the embeddings, the
    norms), so the first to need one dequantizes it and the others take its tensor (and share
    its memory). Worker processes each make their own, as before."""

    def __init__(self):
        self.lock = threading.Lock()
        self.builds: dict[str, tuple[int, dict[str, Future]]] = {}   # token -> users, tensors

    @contextlib.contextmanager
    def build(self, token: str):
        with self.lock:
            users, made = self.builds.get(token, (0, {}))
            self.builds[token] = (users + 1, made)
        try:
            yield made
        finally:
            with self.lock:
                users, made = self.builds[token]
                if users == 1:
                    del self.builds[token]
                else:
                    self.builds[token] = (users - 1, made)

    def get(self, made: dict[str, Future], name: str, make: Callable[[], torch.Tensor]
            ) -> torch.Tensor:
        with self.lock:
            future, mine = made.get(name), name not in made
            if mine:
                future = made[name] = Future()
        if mine:   # made synchronously, waiting on nothing: no worker waits in a cycle
            try:
                future.set_result(make())
            except BaseException as exc:
                future.set_exception(exc)
                raise
        return future.result()


_SHARED = _Shared()


def _gguf_arrays(ctx, spec: dict) -> dict[str, torch.Tensor]:
    """This worker's GGUF pieces dequantized to float32 (``shardload.formats``: gguf-py's
    dequantization, as transformers' own loader runs it), under their GGUF names; each piece's
    bytes reported as progress (``ctx.progress``). Replicated pieces are dequantized once per
    process (``_Shared``)."""
    from .. import formats

    gguf = spec["gguf"]
    types, replicated = gguf["types"], set(gguf["replicated"])
    zeroed = set(spec["zero_on_others"]) if ctx.rank else set()
    out = {}
    with _SHARED.build(spec["token"]) as made:
        for name, piece in ctx.shards.items():
            def make(piece=piece, name=name) -> torch.Tensor:
                return formats.dequantize_module("gguf", {"weight": piece},
                                                 ggml_types={"weight": types[name]})["weight"]

            dense = _SHARED.get(made, name, make) if name in replicated else make()
            # a float piece comes back as itself, a replicated one is shared: a copy to zero
            out[name] = torch.zeros_like(dense) if name in zeroed else dense
            ctx.progress(nbytes=piece.nbytes)
    return out


def _load_gguf(ctx, spec: dict, dtype: torch.dtype):
    """transformers' model of this worker's GGUF pieces, as transformers' GGUF loader builds
    one (``from_gguf``), from the pieces dequantized here and not from a file."""
    import transformers

    from . import from_gguf

    gguf, sizes = spec["gguf"], spec["sizes"]
    arrays = _gguf_arrays(ctx, spec)
    if spec.get("kv_map"):
        # rows of a GGUF k/v are whole heads too (llama.cpp permutes within each head)
        _expand_kv(arrays, spec["kv_map"], spec["head_dim"], spec["kv_projections"])
    # the tensor processors read the worker's head counts (llama's q/k permutation is undone
    # within each of its heads)
    local = {**gguf["config"], **sizes}
    state = from_gguf.state_dict({k: v.numpy() for k, v in arrays.items()}, gguf["arch"],
                                 local, gguf["mapping"], dtype)
    del arrays
    extra = _experts_implementation(spec)
    with _LOADING, _quiet(transformers):
        # the whole model's config, which transformers' checks accept, given this worker's
        # sizes (transformers reads some from no GGUF key: Qwen2's head size, the expert widths)
        config = transformers.AutoConfig.for_model(**gguf["config"])
        for key, value in sizes.items():
            if key == "head_dim" or hasattr(config, key):
                setattr(config, key, value)
        return from_gguf.model_class(config).from_pretrained(
            None, config=config, state_dict=state, dtype=dtype, **extra)


@register_session_func(BUILD)
def build(ctx, spec: dict) -> dict:
    """Build this worker's model from its shards (see the module docstring); ``spec`` is what
    the controller worked out for this worker (``model.py``)."""
    dtype = _DTYPES[spec["dtype"]]
    if spec.get("gguf"):
        model = _load_gguf(ctx, spec, dtype)
    else:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        folder = tempfile.mkdtemp(prefix="shardload-hf-", dir=base)
        try:
            model = _load_dense(ctx, spec, dtype, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    model.eval()
    group = ctx.group if ctx.world_size > 1 else None
    if spec.get("split_norms"):
        _split_norms(model, spec["split_norms"], group)
    if group is not None:
        _reduce_outputs(model, group)
    ctx.values[_key(spec["token"])] = _Built(model, group)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _load_dense(ctx, spec: dict, dtype: torch.dtype, folder: str):
    import transformers

    dense = dense_weights(ctx.shards, spec["quant"], dtype)
    ctx.progress(nbytes=sum(piece.nbytes for piece in ctx.shards.values()))
    if spec.get("experts"):
        _fill_in_experts(dense, spec["experts"], dtype)
    for name in spec["zero_on_others"] if ctx.rank else ():
        if name in dense:
            dense[name].zero_()
    if spec.get("kv_map"):
        _expand_kv(dense, spec["kv_map"], spec["head_dim"], spec["kv_projections"])
    from safetensors.torch import save_file

    save_file(dense, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(spec["config"], f)
    del dense
    extra = _experts_implementation(spec)
    with _LOADING, _quiet(transformers):
        config = transformers.AutoConfig.from_pretrained(folder)
        _set_sizes(config, spec["sizes"])
        return transformers.AutoModelForCausalLM.from_pretrained(folder, config=config,
                                                                 dtype=dtype, **extra)


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


def _cache_kwargs(model, past: Any) -> dict:
    """The KV cache argument under the name this transformers takes (``cache`` in recent
    versions, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": past}


def _built(ctx, token: str) -> _Built:
    built = ctx.values.get(_key(token))
    if built is None:
        raise RuntimeError(f"worker {ctx.rank} has no model {token!r} (released, or never built)")
    return built


@register_session_func(FORWARD)
def forward(ctx, token: str, input_ids: list, answer: int = 0) -> Optional[torch.Tensor]:
    """Logits of the whole model for ``input_ids`` (every worker runs its share; worker
    ``answer`` returns them, the others None)."""
    built = _built(ctx, token)
    ids = torch.tensor(input_ids, dtype=torch.long)
    with torch.no_grad():
        logits = built.model(input_ids=ids).logits.float()
    return logits if ctx.rank == answer else None


def _choose(logits: torch.Tensor, sampling: dict, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row: greedy, or sampled (temperature, top-k) with ``generator``."""
    if not sampling.get("do_sample"):
        return logits.argmax(dim=-1)
    scores = logits / max(float(sampling.get("temperature", 1.0)), 1e-6)
    top_k = int(sampling.get("top_k") or 0)
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@register_session_func(GENERATE)
def generate(ctx, token: str, input_ids: list, max_new_tokens: int, sampling: dict,
             eos_token_ids: list, answer: int = 0) -> Optional[list]:
    """Decode ``max_new_tokens`` after ``input_ids`` with a KV cache. Worker 0 chooses each
    token and broadcasts it, so every worker feeds the same one (sampling included)."""
    built = _built(ctx, token)
    ids = torch.tensor(input_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(int(sampling.get("seed", 0)))
    eos = set(int(t) for t in eos_token_ids)
    out = ids
    past: Any = None
    step = ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            result = built.model(input_ids=step, use_cache=True,
                                 **_cache_kwargs(built.model, past))
            past = result.cache if hasattr(result, "cache") else result.past_key_values
            chosen = _choose(result.logits[:, -1].float(), sampling, generator)
            if built.group is not None:
                chosen = built.group.broadcast(chosen.contiguous())
            out = torch.cat([out, chosen[:, None]], dim=1)
            if ctx.rank == answer:
                ctx.progress(nbytes=1)    # one more token chosen (``on_token``)
            done |= torch.tensor([int(t) in eos for t in chosen.tolist()])
            if bool(done.all()):
                break
            step = chosen[:, None]
        if built.group is not None:
            # a broadcast returns on worker 0 before the others have received: end together,
            # so that no worker leaves (and a torchrun job tears its group down) mid-receive
            built.group.barrier()
    return out.tolist() if ctx.rank == answer else None


@register_session_func(RELEASE)
def release(ctx, token: str) -> None:
    """Drop this worker's model."""
    ctx.values.pop(_key(token), None)
