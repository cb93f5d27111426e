"""``load_tp_model``: transformers' own model, tensor-parallel over a session's workers.

The controller's steps:

1. open the checkpoint and plan it for the session's N (``plan_decision``: padded where the
   heads or the MLP do not divide);
2. load the shards (``load_sharded``): each worker holds only its pieces, still quantized;
3. work out, for each worker, the sizes of its share (query and KV heads, MLP rows: from the
   plan's padding record, or an even split), the row-parallel biases it must not add, and how
   the workers talk (a thread group, a gloo group of the worker processes, or torchrun's);
4. run ``worker.build`` on every worker: it dequantizes its pieces and lets transformers build
   and load the model class of the checkpoint's config with those sizes (see ``worker.py``).

Then ``TPModel(input_ids)`` runs the forward on every worker and returns the logits, and
``generate`` decodes with a KV cache on the workers, worker 0 choosing each token.
"""

from __future__ import annotations

import copy
import socket
import uuid
from typing import Any, Optional, Sequence, Union

import torch

from ..errors import FormatError, ShardloadError
from ..loader import load_sharded
from ..planners import plan_decision
from ..planners.layouts import scheme_from_hf
from ..planners.experts import expert_kind
from ..planners.llama import ROW, module_role
from ..planners.tp_layout import head_layout
from ..readers import as_checkpoint
from ..sessions import Session
from . import worker

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class TPModel:
    """A model whose layers are split over a session's workers; call it like transformers'.

    >>> with ThreadedSession(2) as sess:                                     # doctest: +SKIP
    ...     model = load_tp_model("ckpt/", sess)
    ...     logits = model(input_ids)                     # [batch, tokens, vocab]
    ...     tokens = model.generate(input_ids, max_new_tokens=16)
    """

    def __init__(self, session: Session, token: str, config: dict, sharded, decision):
        self.session = session
        self.token = token
        self.config = config
        self.decision = decision
        self._sharded = sharded       # keeps worker processes' pieces alive while in use
        self._closed = False

    @property
    def num_shards(self) -> int:
        return self.session.num_workers

    def _first(self, results: list) -> Any:
        return next(r for r in results if r is not None)

    def __call__(self, input_ids: Union[torch.Tensor, Sequence[Sequence[int]]]) -> torch.Tensor:
        """The logits ``[batch, tokens, vocab]`` (float32) for ``input_ids`` ``[batch, tokens]``."""
        ids = _as_lists(input_ids)
        results = self.session.call(worker.FORWARD, self.token, ids, self.session.spmd)
        return self._first(results)

    def generate(self, input_ids, max_new_tokens: int = 32, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                 eos_token_id: Union[int, Sequence[int], None] = None) -> torch.Tensor:
        """``input_ids`` followed by up to ``max_new_tokens`` tokens (greedy, or sampled with
        ``temperature`` and ``top_k`` from ``seed``), stopping early when every row has
        produced an ``eos_token_id``."""
        eos = ([] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int)
               else list(eos_token_id))
        sampling = {"do_sample": bool(do_sample), "temperature": float(temperature),
                    "top_k": int(top_k), "seed": int(seed)}
        results = self.session.call(worker.GENERATE, self.token, _as_lists(input_ids),
                                    int(max_new_tokens), sampling, eos, self.session.spmd)
        return torch.tensor(self._first(results), dtype=torch.long)

    def close(self) -> None:
        """Free the workers' models (the session stays open)."""
        if not self._closed and not self.session.closed:
            self._closed = True
            self.session.call(worker.RELEASE, self.token)

    def __enter__(self) -> "TPModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_lists(input_ids) -> list:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        return input_ids.tolist()
    rows = list(input_ids)
    return [list(map(int, r)) for r in rows] if rows and not isinstance(rows[0], int) else [
        list(map(int, rows))]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _comm(session: Session, token: str) -> dict:
    """How the workers of ``session`` reduce: threads of this process, a gloo group of worker
    processes (joined at a fresh local port), or the ranks of the torchrun job."""
    if session.spmd:
        return {"kind": "torch", "token": token}
    if len(session.local_workers) == session.num_workers:
        return {"kind": "threads", "token": token}
    return {"kind": "gloo", "token": token, "address": f"tcp://127.0.0.1:{_free_port()}"}


def _quant(config: dict, source: str) -> dict:
    """What the codecs need of the checkpoint's quantization."""
    scheme = scheme_from_hf(config, source)
    quant = config.get("quantization_config") or {}
    version = 2 if str(quant.get("checkpoint_format", "")).lower() == "gptq_v2" else 1
    return {"method": scheme.method, "bits": scheme.bits, "group_size": scheme.group_size,
            "gptq_version": version, "block": list(scheme.block)}


def _local_sizes(spec, padding: Optional[dict], n: int, i: int) -> dict[str, int]:
    """Worker ``i``'s sizes: its query and KV heads and its MLP rows of each kind."""
    if padding is not None:
        q, kv = len(padding["q_heads"][i]), len(padding["kv_heads"][i])
        blocks = padding["mlp_blocks"]
        unit = padding["mlp_block"]

        def mlp(size: int) -> int:
            return len(blocks[str(size)][i]) * unit if str(size) in blocks else size // n
    else:
        q = spec.num_heads // n
        kv = max(1, spec.num_kv_heads // n)

        def mlp(size: int) -> int:
            return size // n
    sizes = {"num_attention_heads": q, "num_key_value_heads": q if spec.mla else kv}
    for attr in ("intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size"):
        value = getattr(spec, attr)
        if value:
            sizes[attr] = mlp(value)
    return sizes


def _expert_parallel(spec, sizes: dict[str, int], plan, validated, n: int, i: int,
                     gguf: bool) -> tuple[dict[str, int], dict]:
    """Worker ``i``'s sizes and what its build needs under expert parallelism: its routed
    experts whole (the rest are zero stand-ins, so transformers' MoE block, which routes over
    every expert, adds nothing for them: the sum over workers is the whole block), shared
    experts and dense MLPs tensor-parallel."""
    if gguf:
        raise ShardloadError("expert-parallel plans of GGUF checkpoints are not built into a "
                             "model yet: load with experts='tp'")
    sizes = dict(sizes)
    if spec.moe_intermediate_size:
        sizes["moe_intermediate_size"] = spec.moe_intermediate_size
    slots = plan.metadata["experts"]["experts_per_worker"]
    hidden, moe = spec.hidden_size, spec.moe_intermediate_size
    missing = {}     # dense name -> shape of an expert weight another worker holds
    for param in validated:
        if param.workers is not None and i not in param.workers:
            module, _, suffix = param.name.rpartition(".")
            if suffix in ("weight", "qweight", "weight_packed", "q_weight"):
                role = module_role(param.name, spec, gguf_names=False)
                missing[f"{module}.weight"] = [hidden, moe] if role == "down" else [moe, hidden]
    pad = {}
    if spec.mla is not None and spec.shared_expert_intermediate_size:
        # DeepSeek's shared experts are moe_intermediate_size x n_shared_experts wide in the
        # config: their tensor-parallel share is zero-padded to that width (exact: zero rows of
        # gate/up, zero columns of down)
        width = spec.shared_expert_intermediate_size
        pad = {"shared_experts.gate_proj.weight": [width, hidden],
               "shared_experts.up_proj.weight": [width, hidden],
               "shared_experts.down_proj.weight": [hidden, width]}
    return sizes, {"experts_per_worker": {k: v[i] for k, v in slots.items()},
                   "missing": missing, "pad": pad}


def _kv_map(padding: Optional[dict], i: int) -> Optional[list[int]]:
    """The local KV head of each local query head, where it is not transformers' regular
    ``h // (q / kv)`` (some zero-padded layouts); None where it is."""
    if padding is None:
        return None
    q_to_kv = padding["q_to_kv"][i]
    q, kv = len(q_to_kv), len(padding["kv_heads"][i])
    if q % kv == 0 and all(k == h // (q // kv) for h, k in enumerate(q_to_kv)):
        return None
    return q_to_kv


def _split_norms(spec, padding: Optional[dict], n: int, i: int) -> dict:
    """For norms over a whole projection (OLMo-2's q_norm, k_norm), what worker ``i`` needs to
    take its part in the mean of squares: the projection's whole width, and a weight per local
    head (1 / the number of workers holding that head, 0 for a zero head), so that a KV head
    replicated to several workers counts once."""
    if not spec.rules.split_norms:
        return {}
    heads = (padding if padding is not None
             else head_layout(spec.num_heads, spec.num_kv_heads, n).as_dict())
    kv_map = _kv_map(padding, i)
    layout = {"q": heads["q_heads"], "k": heads["kv_heads"]}
    if kv_map is not None:   # expanded: one (copied) KV head per query head, on every worker
        layout["k"] = [[kv[m] for m in heads["q_to_kv"][w]]
                       for w, kv in enumerate(heads["kv_heads"])]
    out = {}
    for norm, role in spec.rules.split_norms.items():
        counts: dict[int, int] = {}
        for worker_heads in layout[role]:
            for h in worker_heads:
                counts[h] = counts.get(h, 0) + 1
        weights = [0.0 if h < 0 else 1.0 / counts[h] for h in layout[role][i]]
        out[norm] = {"width": spec.q_size if role == "q" else spec.kv_size,
                     "weights": weights, "head_dim": spec.head_dim}
    return out


def _gguf_sizes(spec, sizes: dict[str, int]) -> dict[str, int]:
    """The GGUF key-values of a worker's sizes (``{arch}.attention.head_count`` ...)."""
    keys = {"num_attention_heads": "attention.head_count",
            "num_key_value_heads": "attention.head_count_kv",
            "intermediate_size": "feed_forward_length",
            "moe_intermediate_size": "expert_feed_forward_length",
            "shared_expert_intermediate_size": "expert_shared_feed_forward_length"}
    return {f"{spec.architecture}.{keys[k]}": v for k, v in sizes.items() if k in keys}


def _worker_config(config: dict, spec, sizes: dict[str, int], expand_kv: bool) -> dict:
    """The checkpoint's config with worker sizes, unquantized (the worker loads dense weights)."""
    local = copy.deepcopy(config)
    local.pop("quantization_config", None)
    target = local[spec.rules.sizes_under] if spec.rules.sizes_under else local
    for key, value in sizes.items():
        if key == "moe_intermediate_size" and spec.rules.experts_size == "intermediate_size":
            continue          # Mixtral, gpt-oss: intermediate_size is the experts' (set below)
        if key in target or key in ("num_attention_heads", "num_key_value_heads"):
            target[key] = value
    if spec.rules.experts_size == "intermediate_size" and "moe_intermediate_size" in sizes:
        target["intermediate_size"] = sizes["moe_intermediate_size"]
    if spec.mla is None:
        target["head_dim"] = spec.head_dim      # no longer hidden / heads on a worker
    if expand_kv:
        target["num_key_value_heads"] = sizes["num_attention_heads"]
    return local


def load_tp_model(params, session: Session, dtype: torch.dtype = torch.float32, *,
                  experts: str = "tp", progress: bool = False) -> TPModel:
    """transformers' model of the checkpoint ``params`` (a folder, or an open checkpoint),
    split over the workers of ``session``, its weights dequantized to ``dtype``.

    >>> from shardload import ProcessSession                                 # doctest: +SKIP
    >>> from shardload.hf import load_tp_model
    >>> with ProcessSession(4) as sess:
    ...     model = load_tp_model("ckpt/", sess, dtype=torch.bfloat16)
    ...     logits = model(input_ids)
    ...     text = model.generate(input_ids, max_new_tokens=32)
    """
    if dtype not in _DTYPE_NAMES:
        raise ShardloadError(f"dtype must be one of {', '.join(map(str, _DTYPE_NAMES))}, "
                             f"got {dtype}")
    ckpt = as_checkpoint(params)                                                   # 1.
    config = ckpt.config
    gguf = "general.architecture" in config
    if "model_type" not in config and not gguf:
        raise FormatError("load_tp_model builds transformers' model from an HF checkpoint "
                          "(a folder with config.json and safetensors) or a GGUF file; this "
                          "checkpoint has neither config (MLC checkpoints are not supported)",
                          file=ckpt.source)
    n = session.num_workers
    decision = plan_decision(ckpt, n, experts=experts)
    plan = decision.plan()
    spec = decision.summary.spec
    padding = plan.metadata.get("tensor_parallel")
    sharded = load_sharded(ckpt, decision.validated, session, progress=progress)   # 2.
    quant = ({"method": "gguf"} if gguf else _quant(config, ckpt.source))         # 3.
    # a row-parallel bias is added once, after the sum; an expert's own bias under expert
    # parallelism belongs to the worker holding the expert, so it is not one of them
    row_biases = [name for name in ckpt.metadata()
                  if "bias" in name.rpartition(".")[2]
                  and module_role(name, spec, gguf_names=gguf) in ROW
                  and not (experts == "ep" and expert_kind(name, name.rpartition(".")[0], gguf))]
    types = ({name: ckpt.tensor_format(name)["ggml_type"] for name in ckpt.metadata()}
             if gguf else None)
    token = uuid.uuid4().hex
    comm = _comm(session, token)

    def spec_for(i: int) -> list:
        kv_map = _kv_map(padding, i)
        sizes = _local_sizes(spec, padding, n, i)
        ep = None
        if experts == "ep":
            sizes, ep = _expert_parallel(spec, sizes, plan, decision.validated, n, i, gguf)
        itemsize = torch.empty((), dtype=dtype).element_size()
        eager = any(sizes.get(k, 0) * itemsize % 16 for k in
                    ("moe_intermediate_size", "intermediate_size"))
        if gguf:
            if kv_map is not None:
                raise ShardloadError(f"{ckpt.source} at N={n}: this zero-padded layout gives "
                                     "a worker query heads whose KV heads transformers cannot "
                                     "pair by its regular rule; load a GGUF at an N the "
                                     "heads divide")
            return [{"dtype": _DTYPE_NAMES[dtype], "quant": quant, "comm": comm,
                     "split_norms": _split_norms(spec, padding, n, i),
                     "zero_on_others": row_biases,
                     "gguf": {"file": ckpt.source, "arch": spec.architecture, "types": types,
                              "kv": _gguf_sizes(spec, sizes),
                              # transformers reads some sizes from no GGUF key (Qwen2's head
                              # size, Qwen-MoE's expert widths): the worker sets them itself
                              "config": {**sizes, "head_dim": spec.head_dim}}}]
        return [{"dtype": _DTYPE_NAMES[dtype], "quant": quant, "comm": comm,
                 "eager_experts": eager, "split_norms": _split_norms(spec, padding, n, i),
                 "experts": ep,
                 "config": _worker_config(config, spec, sizes, kv_map is not None),
                 "zero_on_others": row_biases, "kv_map": kv_map, "head_dim": spec.head_dim}]

    session.run(worker.BUILD, spec_for, context=f"while building the model of {ckpt.source}")
    return TPModel(session, token, config, sharded, decision)                      # 4.


__all__ = ["load_tp_model", "TPModel"]
