"""A worker's shards as the state dict transformers' model of its share takes, in memory, for
every checkpoint format:

* an HF checkpoint's (``hf_state``): each quantized module dequantized to the chosen dtype
  (``shardload.formats``, by the plan's record of the quantization), under the checkpoint's
  names, which transformers converts as it loads them;
* a GGUF's (``gguf_state``): each piece dequantized to float32 as transformers' GGUF loader
  does, then through its tensor processor and names (``from_gguf``);

then, in both, the row-parallel biases zeroed on every worker but 0 (they are added once, after
the sum), and where the worker's query heads do not use its KV heads in transformers' regular
pattern (some zero-padded layouts), each query head given its own copy of its KV head. Each
worker reports the bytes of the pieces it has dequantized as progress (``ctx.progress``).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import Stopped
from ..shared_outputs import SharedOutputs

__all__ = ["dense_weights", "gguf_state", "hf_state", "sharing_replicated"]


def dense_weights(
    shards: dict[str, torch.Tensor], quant: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
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
                scheme.method,
                parts,
                bits=scheme.bits,
                group_size=scheme.group_size,
                gptq_version=scheme.gptq_version,
                block=scheme.block,
                dtype=dtype,
            )
        else:
            dense = {k: t for k, t in parts.items() if t.is_floating_point()}
        for key, tensor in dense.items():
            out[prefix + key] = tensor.to(dtype).contiguous()
    return out


def hf_state(ctx, spec: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This worker's state dict of an HF checkpoint, under the checkpoint's names."""
    dense = dense_weights(ctx.shards, spec["quant"], dtype)
    ctx.progress(nbytes=sum(piece.nbytes for piece in ctx.shards.values()))
    if spec.get("experts"):
        _fill_in_experts(dense, spec["experts"], dtype)
    _zero_on_others(ctx, spec, dense)
    if spec.get("kv_map"):
        _expand_kv(dense, spec["kv_map"], spec["head_dim"], spec["kv_projections"])
    return dense


def gguf_state(ctx, spec: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This worker's state dict of a GGUF, as transformers' GGUF loader makes one
    (``from_gguf``), from the pieces dequantized here and not from a file."""
    from . import from_gguf

    gguf = spec["gguf"]
    arrays = _gguf_arrays(ctx, spec)
    _zero_on_others(ctx, spec, arrays)
    if spec.get("kv_map"):
        # rows of a GGUF k/v are whole heads too (llama.cpp permutes within each head)
        _expand_kv(arrays, spec["kv_map"], spec["head_dim"], spec["kv_projections"])
    # the tensor processors read the worker's head counts (llama's q/k permutation is undone
    # within each of its heads)
    local = {**gguf["config"], **spec["sizes"]}
    return from_gguf.state_dict(
        {k: v.numpy() for k, v in arrays.items()}, gguf["arch"], local, gguf["mapping"], dtype
    )


def _zero_on_others(ctx, spec: dict, state: dict[str, torch.Tensor]) -> None:
    """Row-parallel biases as zeros on every worker but 0. New tensors, not zeroed in place: a
    tensor here may be the worker's shard itself, or a replicated piece another worker shares."""
    for name in spec["zero_on_others"] if ctx.rank else ():
        if name in state:
            state[name] = torch.zeros_like(state[name])


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
            whole[: piece.shape[0], : piece.shape[1]] = piece
            dense[name] = whole


def _expand_kv(
    dense: dict[str, torch.Tensor], kv_map: list[int], head_dim: int, kv_modules: list[str]
) -> None:
    """Give each local query head its own copy of the KV head it uses (``kv_map[h]``, a local
    KV index), where zero-padding made the pattern irregular for transformers' repeat_kv."""
    rows = torch.cat([torch.arange(k * head_dim, (k + 1) * head_dim) for k in kv_map])
    expanded = set(kv_modules)
    for name in list(dense):
        if name.rpartition(".")[0] in expanded:
            dense[name] = dense[name].index_select(0, rows).contiguous()


#: the builds under way in this process whose workers share replicated pieces, by token.
#: Module-global because a worker finds its build by the token in its spec alone: the
#: controller registers the build here for as long as it runs (``sharing_replicated``) when
#: workers run in its process (threads, or its own torchrun rank); a worker process finds none
#: and dequantizes its own.
_replicated: dict[str, SharedOutputs] = {}


@contextlib.contextmanager
def sharing_replicated(token: str, num_local: int):
    """While the build ``token`` runs, its ``num_local`` workers in this process dequantize
    each replicated GGUF piece (the embeddings, the norms) once and share its memory."""
    if num_local < 2:
        yield
        return
    _replicated[token] = SharedOutputs(num_local)
    try:
        yield
    finally:
        del _replicated[token]


def _gguf_arrays(ctx, spec: dict) -> dict[str, torch.Tensor]:
    """This worker's GGUF pieces dequantized to float32 (``shardload.formats``: gguf-py's
    dequantization, as transformers' own loader runs it), under their GGUF names; each piece's
    bytes reported as progress (``ctx.progress``). Replicated pieces are dequantized once per
    process (``sharing_replicated``)."""
    from .. import formats

    gguf = spec["gguf"]
    types, replicated = gguf["types"], set(gguf["replicated"])
    out = {}
    for name, piece in ctx.shards.items():

        def make(piece=piece, name=name) -> torch.Tensor:
            return formats.dequantize_module(
                "gguf", {"weight": piece}, ggml_types={"weight": types[name]}
            )["weight"]

        shared = _replicated.get(spec["token"]) if name in replicated else None
        if shared is None:
            out[name] = make()
        else:  # every local worker holds every replicated piece, in the same order
            out[name], _ = shared.take(name, make, lambda: _alive(ctx))
            shared.release(name)
        ctx.progress(nbytes=piece.nbytes)
    return out


def _alive(ctx) -> None:
    """While a worker waits on another's dequantization: stop if the session says so (the
    other may have failed), else say it is alive."""
    if ctx.should_stop():
        raise Stopped()
    ctx.progress()
