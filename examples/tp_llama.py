"""A reference tensor-parallel Llama forward over shardload's workers: plain torch, float32.

Each worker holds only its own shards of a GGUF Llama checkpoint (loaded by ``load_sharded``
with the planner's plan) and dequantizes them itself. The layers are Megatron-style:

* q, k, v, gate, up are **column-parallel**: a worker holds some output rows (whole heads, a
  block of the MLP's intermediate dimension) and computes only those outputs;
* o and down are **row-parallel**: a worker holds the matching input columns and produces a
  partial sum of the layer's output, which an **all-reduce** (sum over workers) completes;
* norms, the embedding and the lm_head are replicated, so every worker carries the full
  residual stream.

So a forward costs two all-reduces per layer and nothing else in communication. Worker sizes
come from the shard shapes, and the local query-head -> KV-head map from the plan's head layout
(``head_layout``), so zero-padded plans (N not dividing the heads) work unchanged: padded heads
have zero weights and zero o_proj columns, and contribute nothing.

The pieces, driven with ``session.call`` on a ``ThreadedSession`` or a ``ProcessSession``:

* session functions ``tp_llama.setup(ctx, spec)``, ``tp_llama.forward(ctx, token_ids,
  start_pos)``, ``tp_llama.hidden(ctx, token_ids, num_layers)``, ``tp_llama.reset(ctx)``,
  ``tp_llama.release(ctx)``;
* ``TensorParallelLlama(checkpoint_path, session)``: the driver, with ``logits(ids)`` and
  ``generate(prompt_ids, max_new_tokens)``.

With one worker this is the unsharded reference.

``shardload.hf.load_tp_model`` runs transformers' own model of any supported architecture and
format the same way; this file stays as the small readable reference that shows every
tensor-parallel step in plain torch, without transformers in between.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shardload import Session, load_sharded, open_checkpoint, register_session_func
from shardload.planners import plan_for
from shardload.tp_layout import head_layout

__all__ = ["TensorParallelLlama", "dequantize", "model_spec", "rms_norm", "rope"]

STATE = "tp_llama"  # the ctx.values key holding a worker's model
UNQUANTIZED = ("F32", "F16", "BF16")


# ---- numerics shared by every worker -----------------------------------------------------------


def dequantize(shard: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """A GGUF tensor (or a worker's shard of one) as float32.

    Quantized GGUF tensors stay raw blocks after sharding (uint8 ``[rows, row_bytes]``); a
    shard holds whole blocks, so gguf-py dequantizes it exactly as it would the full tensor.
    """
    if ggml_type in UNQUANTIZED:
        return shard.float()
    import gguf.quants
    from gguf import GGMLQuantizationType

    values = gguf.quants.dequantize(shard.cpu().numpy(), GGMLQuantizationType[ggml_type])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(shard.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in GGML's "normal" mode: rotate adjacent pairs (x0, x1), (x2, x3), ...

    llama.cpp's converter permutes each head's q and k rows so that this, and not HF's
    rotate-half pairing, reproduces the original model. ``x`` is ``[T, heads, head_dim]``;
    the first ``2 * len(inv_freq)`` dims rotate, any others pass through.
    """
    n_rot = 2 * inv_freq.numel()
    angles = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # [T, n_rot/2]
    cos = angles.cos().to(x.dtype)[:, None, :]
    sin = angles.sin().to(x.dtype)[:, None, :]
    even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., n_rot:]), dim=-1)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_to_kv: torch.Tensor, start_pos: int
) -> torch.Tensor:
    """Causal attention of T new queries over S = start_pos + T cached keys.

    ``q`` is ``[T, Hq, D]``, ``k``/``v`` ``[S, Hkv, D]``; query head h reads KV head
    ``q_to_kv[h]`` (GQA, in the worker's local numbering). Returns ``[T, Hq * D]``.
    """
    T, S = q.shape[0], k.shape[0]
    k, v = k[:, q_to_kv], v[:, q_to_kv]  # [S, Hq, D]
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(start_pos, start_pos + T, device=q.device)
    future = torch.arange(S, device=q.device)[None, :] > query_pos[:, None]  # [T, S]
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(T, -1)


# ---- a worker's model --------------------------------------------------------------------------


class WorkerModel:
    """One worker's slice of the model: its dequantized shards, its heads, its KV cache."""

    def __init__(self, ctx, spec: dict):
        self.rank = ctx.rank
        self.device = ctx.device
        self.spec = spec
        self.eps = float(spec["rms_eps"])
        self.head_dim = int(spec["head_dim"])
        self.num_layers = int(spec["num_layers"])
        types = spec["types"]

        def weight(name: str) -> torch.Tensor:
            return dequantize(ctx.shards[name], types[name]).to(self.device)

        # The embedding stays raw: a lookup dequantizes only the rows it reads. Only worker 0
        # applies the lm_head (the final hidden state is replicated), so only it dequantizes
        # the whole vocabulary matrix.
        self.embed_raw = ctx.shards["token_embd.weight"]
        self.embed_type = types["token_embd.weight"]
        if self.embed_raw.shape[0] != int(spec["vocab_size"]):
            raise ValueError(
                "tp_llama needs the embedding replicated (a plan without vocab_parallel)"
            )
        self.lm_head = weight(spec["lm_head"]) if self.rank == 0 else None
        self.output_norm = weight("output_norm.weight")
        self.layers = [self._layer(f"blk.{i}.", weight) for i in range(self.num_layers)]

        # This worker's heads, as the plan laid them out; the counts must match the shards.
        layout = spec["layout"]
        n_q, n_kv = len(layout["q_heads"][self.rank]), len(layout["kv_heads"][self.rank])
        first = self.layers[0]
        if (first["q"].shape[0], first["k"].shape[0]) != (
            n_q * self.head_dim,
            n_kv * self.head_dim,
        ):
            raise ValueError(
                f"worker {self.rank}: attn_q/attn_k shards have "
                f"{first['q'].shape[0]}/{first['k'].shape[0]} rows, but the head "
                f"layout gives it {n_q} query and {n_kv} KV heads of "
                f"{self.head_dim}"
            )
        self.q_to_kv = torch.tensor(layout["q_to_kv"][self.rank], device=self.device)
        rot = int(spec["rope_dims"])
        exponents = torch.arange(0, rot, 2, dtype=torch.float64) / rot
        self.inv_freq = (float(spec["rope_base"]) ** -exponents).to(self.device)
        # the session's collectives (threads: a barrier; processes and torchrun: their
        # torch.distributed group); with one worker the partial sums are the sums
        self.group = ctx.group if ctx.world_size > 1 else None
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.reset()

    @staticmethod
    def _layer(prefix: str, weight) -> dict[str, torch.Tensor]:
        names = {
            "attn_norm": "attn_norm",
            "q": "attn_q",
            "k": "attn_k",
            "v": "attn_v",
            "o": "attn_output",
            "ffn_norm": "ffn_norm",
            "gate": "ffn_gate",
            "up": "ffn_up",
            "down": "ffn_down",
        }
        return {key: weight(f"{prefix}{name}.weight") for key, name in names.items()}

    def reset(self) -> None:
        self.cache = [None] * self.num_layers
        self.cached = 0

    # -- the forward -------------------------------------------------------------------------

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.embed_raw.device)
        return dequantize(self.embed_raw[ids], self.embed_type).to(self.device)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.group is None else self.group.all_reduce(partial)

    def attention_block(self, i: int, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """This worker's heads of layer i's attention; the all-reduce completes o_proj."""
        w, T, D = self.layers[i], x.shape[0], self.head_dim
        h = rms_norm(x, w["attn_norm"], self.eps)
        q = (h @ w["q"].T).view(T, -1, D)  # column-parallel: only this worker's heads
        k = (h @ w["k"].T).view(T, -1, D)
        v = (h @ w["v"].T).view(T, -1, D)
        positions = torch.arange(start_pos, start_pos + T, device=x.device)
        q, k = rope(q, positions, self.inv_freq), rope(k, positions, self.inv_freq)
        if self.cache[i] is not None:
            k = torch.cat((self.cache[i][0], k))
            v = torch.cat((self.cache[i][1], v))
        self.cache[i] = (k, v)
        out = attention(q, k, v, self.q_to_kv, start_pos)
        return self.all_reduce(out @ w["o"].T)  # row-parallel: a partial sum until reduced

    def mlp_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """This worker's block of layer i's MLP; the all-reduce completes down_proj."""
        w = self.layers[i]
        h = rms_norm(x, w["ffn_norm"], self.eps)
        return self.all_reduce((F.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T)

    def hidden(
        self, token_ids: Sequence[int], start_pos: int, num_layers: int | None = None
    ) -> torch.Tensor:
        """The residual stream ``[T, hidden]`` after ``num_layers`` layers (all by default),
        reading and extending the KV cache."""
        if start_pos == 0:
            self.reset()  # a sequence starting at position 0 is a new sequence
        if start_pos != self.cached:
            raise ValueError(
                f"start_pos {start_pos} does not follow the {self.cached} cached "
                "positions; call reset, or start at 0"
            )
        x = self.embed(token_ids)
        for i in range(self.num_layers if num_layers is None else num_layers):
            x = x + self.attention_block(i, x, start_pos)
            x = x + self.mlp_block(i, x)
        self.cached = start_pos + len(token_ids)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.output_norm, self.eps) @ self.lm_head.T


def _model(ctx) -> WorkerModel:
    model = ctx.values.get(STATE)
    if model is None:
        raise RuntimeError(f"worker {ctx.rank} has no model: call tp_llama.setup first")
    return model


# ---- session functions -------------------------------------------------------------------------


@register_session_func("tp_llama.setup")
def setup(ctx, spec: dict) -> dict:
    """Dequantize this worker's shards (``ctx.shards``) and start an empty KV cache.

    ``spec`` (JSON, the same for every worker; ``model_spec`` writes most of it): sizes,
    per-tensor GGUF types and the head layout of every worker. The all-reduces go over the
    session's own collectives (``ctx.group``).
    """
    ctx.values.pop(STATE, None)  # free a previous model before building the next
    if spec.get("torch_threads"):
        torch.set_num_threads(int(spec["torch_threads"]))  # worker processes share the CPUs
    model = ctx.values[STATE] = WorkerModel(ctx, spec)
    first = model.layers[0]
    return {
        "q_heads": first["q"].shape[0] // model.head_dim,
        "kv_heads": first["k"].shape[0] // model.head_dim,
        "ffn_rows": first["gate"].shape[0],
    }


@register_session_func("tp_llama.forward")
def forward(ctx, token_ids: list, start_pos: int) -> torch.Tensor | None:
    """Run the new tokens at positions ``start_pos, ...`` through the model, extending the KV
    cache (``start_pos`` 0 starts a new sequence). Worker 0 returns the float32 logits
    ``[T, vocab]``; the others ``None``."""
    model = _model(ctx)
    with torch.no_grad():
        x = model.hidden(token_ids, start_pos)
        return model.logits(x) if ctx.rank == 0 else None


@register_session_func("tp_llama.hidden")
def hidden(ctx, token_ids: list, num_layers: int) -> torch.Tensor | None:
    """The residual stream ``[T, hidden]`` after the first ``num_layers`` layers of a fresh
    sequence, from worker 0 (``None`` from the others); clears the KV cache afterwards."""
    model = _model(ctx)
    with torch.no_grad():
        x = model.hidden(token_ids, 0, num_layers)
    model.reset()
    return x if ctx.rank == 0 else None


@register_session_func("tp_llama.reset")
def reset(ctx) -> None:
    """Clear the KV cache."""
    _model(ctx).reset()


@register_session_func("tp_llama.release")
def release(ctx) -> None:
    """Drop the worker's model (weights and cache)."""
    ctx.values.pop(STATE, None)


# ---- the driver --------------------------------------------------------------------------------


def _tp_layout(plan, num_heads: int, num_kv_heads: int, n: int) -> dict:
    """Per worker: query heads, KV heads, local q -> kv map. From the plan when it says (a
    padded plan records its layout), else the layout the planner uses."""
    meta = getattr(plan, "metadata", None) or {}
    tp = meta.get("tensor_parallel") if isinstance(meta, dict) else None
    if isinstance(tp, list) and len(tp) == n:  # one {"q_heads", "kv_heads", "q_to_kv"} per worker
        tp = {key: [worker[key] for worker in tp] for key in ("q_heads", "kv_heads", "q_to_kv")}
    if isinstance(tp, dict) and all(
        len(tp.get(key, ())) == n for key in ("q_heads", "kv_heads", "q_to_kv")
    ):
        return {key: tp[key] for key in ("q_heads", "kv_heads", "q_to_kv")}
    return head_layout(num_heads, num_kv_heads, n).as_dict()


def model_spec(ckpt, plan, num_workers: int) -> dict:
    """What every worker needs besides its shards (JSON): sizes, tensor types, head layout."""
    config = ckpt.config
    arch = config.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"tp_llama runs GGUF llama checkpoints; this one is {arch!r}")

    def get(key: str, default: Any = None) -> Any:
        value = config.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{ckpt.source}: GGUF key llama.{key} missing")
        return value

    heads, kv_heads = get("attention.head_count"), get("attention.head_count_kv")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    names = list(ckpt.metadata())
    return {
        "num_layers": get("block_count"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rope_dims": get("rope.dimension_count", head_dim),
        "rope_base": float(get("rope.freq_base", 10000.0)),
        "rms_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": ckpt.metadata()["token_embd.weight"].shape[0],
        # tied embeddings: no output.weight, and token_embd.weight is the lm_head too
        "lm_head": "output.weight" if "output.weight" in names else "token_embd.weight",
        "types": {name: ckpt.tensor_format(name)["ggml_type"] for name in names},
        "layout": _tp_layout(plan, heads, kv_heads, num_workers),
    }


class TensorParallelLlama:
    """A GGUF Llama checkpoint loaded onto the workers of ``session``, tensor-parallel.

    ``plan`` defaults to the planner's plan for the session's N (zero-padded where N does not
    divide the heads). The driver needs a session whose ``call`` carries tensors back
    (``ThreadedSession``, ``ProcessSession``); under torchrun, where every rank runs its own
    copy of the program, call the session functions on each rank instead.

    >>> with ThreadedSession(3) as sess, TensorParallelLlama(path, sess) as model:  # doctest: +SKIP
    ...     new_ids, step_logits = model.generate(prompt_ids, 16)
    """

    def __init__(
        self, checkpoint_path: str, session: Session, *, plan=None, progress: bool = False
    ):
        self.session = session
        self.ckpt = open_checkpoint(checkpoint_path)
        n = session.num_workers
        self.plan = plan if plan is not None else plan_for(self.ckpt, num_shards=n)
        self.spec = model_spec(self.ckpt, self.plan, n)
        if not session.local_workers:  # worker processes: N of them share this machine's CPUs
            self.spec["torch_threads"] = max(1, (os.cpu_count() or 1) // n)
        try:
            self.sharded = load_sharded(self.ckpt, self.plan, session, progress=progress)
            #: per worker: its query heads, KV heads and MLP rows
            self.workers = session.call("tp_llama.setup", self.spec)
        except BaseException:
            self.ckpt.close()
            raise

    @property
    def vocab_size(self) -> int:
        return int(self.spec["vocab_size"])

    def _forward(self, token_ids: Sequence[int], start_pos: int) -> torch.Tensor:
        return self.session.call("tp_llama.forward", [int(t) for t in token_ids], start_pos)[0]

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[T, vocab]`` of every position of ``token_ids``, from a fresh cache."""
        return self._forward(token_ids, 0)

    def hidden(self, token_ids: Sequence[int], num_layers: int) -> torch.Tensor:
        """The residual stream ``[T, hidden]`` after the first ``num_layers`` layers."""
        return self.session.call("tp_llama.hidden", [int(t) for t in token_ids], num_layers)[0]

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, *, eos_id: int | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding: prefill the prompt, then one token at a time through the KV cache.

        Returns the new token ids (ending with ``eos_id`` if it was generated) and, for each,
        the logits it was chosen from (``[len(new_ids), vocab]``).
        """
        new_ids: list[int] = []
        steps: list[torch.Tensor] = []
        logits = self._forward(prompt_ids, 0)[-1]
        pos = len(prompt_ids)
        while len(new_ids) < max_new_tokens:
            token = int(logits.argmax())
            new_ids.append(token)
            steps.append(logits)
            if token == eos_id or len(new_ids) == max_new_tokens:
                break
            logits = self._forward([token], pos)[-1]
            pos += 1
        empty = torch.empty(0, self.vocab_size)
        return new_ids, torch.stack(steps) if steps else empty

    def close(self) -> None:
        """Free the workers' models (the session stays open)."""
        try:
            self.session.call("tp_llama.release")
        except RuntimeError:
            pass  # the session is closed already, and its workers with it
        finally:
            self.ckpt.close()

    def __enter__(self) -> TensorParallelLlama:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
