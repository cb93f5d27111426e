"""Running a built model on the worker (session functions): a forward, and decoding with a KV
cache, worker 0 choosing each token and every worker feeding the same one."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..sessions import register_session_func
from . import build

__all__ = ["FORWARD", "GENERATE", "RELEASE", "forward", "generate", "release"]

FORWARD = "shardload.hf.forward"
GENERATE = "shardload.hf.generate"
RELEASE = "shardload.hf.release"


@register_session_func(FORWARD)
def forward(ctx, token: str, input_ids: list, answer: int = 0) -> torch.Tensor | None:
    """Logits of the whole model for ``input_ids`` (every worker runs its share; worker
    ``answer`` returns them, the others None)."""
    model = build.built(ctx, token).model
    ids = torch.tensor(input_ids, dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return logits if ctx.rank == answer else None


def _cache_kwargs(model, past: Any) -> dict:
    """The KV cache argument under the name this transformers takes (``cache`` in recent
    versions, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": past}


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
def generate(
    ctx,
    token: str,
    input_ids: list,
    max_new_tokens: int,
    sampling: dict,
    eos_token_ids: list,
    answer: int = 0,
) -> list | None:
    """Decode ``max_new_tokens`` after ``input_ids`` with a KV cache. Worker 0 chooses each
    token and broadcasts it, so every worker feeds the same one (sampling included)."""
    held = build.built(ctx, token)
    ids = torch.tensor(input_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(int(sampling.get("seed", 0)))
    eos = set(int(t) for t in eos_token_ids)
    out = ids
    past: Any = None
    step = ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            result = held.model(input_ids=step, use_cache=True, **_cache_kwargs(held.model, past))
            past = result.cache if hasattr(result, "cache") else result.past_key_values
            chosen = _choose(result.logits[:, -1].float(), sampling, generator)
            if held.group is not None:
                chosen = held.group.broadcast(chosen.contiguous())
            out = torch.cat([out, chosen[:, None]], dim=1)
            if ctx.rank == answer:
                ctx.progress(nbytes=1)  # one more token chosen (``on_token``)
            done |= torch.tensor([int(t) in eos for t in chosen.tolist()])
            if bool(done.all()):
                break
            step = chosen[:, None]
        if held.group is not None:
            # a broadcast returns on worker 0 before the others have received: end together,
            # so that no worker leaves (and a torchrun job tears its group down) mid-receive
            held.group.barrier()
    return out.tolist() if ctx.rank == answer else None


@register_session_func(RELEASE)
def release(ctx, token: str) -> None:
    """Drop this worker's model."""
    build.release(ctx, token)
