"""``load_tp_model``: transformers' own model, tensor-parallel over a session's workers.

The controller's steps:

1. open the checkpoint and resolve its plan for the session's N by the front door's policy
   (``frontdoor.resolve_plan``: the plan given, else ``shard_info.json`` beside it, else one
   made from its config, padded where the heads or the MLP do not divide; under torchrun rank 0
   resolves it and the other ranks receive it, ``frontdoor.plan_job``); for a GGUF, read
   transformers' config and tensor names once (``from_gguf``), before any data moves;
2. load the shards (``loader.load_validated``): each worker holds only its pieces, still
   quantized;
3. read each worker's share of the model from the plan (``geometry.worker_share``: its query and
   KV heads and MLP rows, the row-parallel biases it must not add, its experts); the workers
   reduce over the session's own collectives (``ctx.group``), whatever the session;
4. run ``build.build`` on every worker: it dequantizes its pieces (``weights``) and lets
   transformers build the model class of the checkpoint's config with those sizes from them.

Then ``TPModel(input_ids)`` runs the forward on every worker and returns the logits, and
``generate`` decodes with a KV cache on the workers, worker 0 choosing each token
(``decode``).
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import dtypes
from ..errors import EXPERTS_TP, FormatError, ShardloadError, mention
from ..frontdoor import plan_job
from ..geometry import WorkerShare, worker_share
from ..loader import load_validated
from ..sessions import Session
from . import build, decode, weights

#: the dtypes a model is built in (the dequantizers' outputs)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TPModel:
    """A model whose layers are split over a session's workers; call it like transformers'.

    >>> with ThreadedSession(2) as sess:                                     # doctest: +SKIP
    ...     model = load_tp_model("ckpt/", sess)
    ...     logits = model(input_ids)                     # [batch, tokens, vocab]
    ...     tokens = model.generate(input_ids, max_new_tokens=16)
    """

    def __init__(self, session: Session, token: str, config: dict, sharded, resolved):
        self.session = session
        self.token = token
        self.config = config
        #: the plan it was loaded with, and where it came from (``frontdoor.ResolvedPlan``)
        self.resolved = resolved
        self._sharded = sharded  # keeps worker processes' pieces alive while in use
        self._closed = False

    @property
    def num_shards(self) -> int:
        return self.session.num_workers

    @property
    def decision(self):
        """The planner's decision (``planners.PlanDecision``: unpadded, padded) when the plan
        was made from the config; None for a plan given or found beside the checkpoint."""
        return self.resolved.decision

    @property
    def _answer(self) -> int:
        """The worker whose answer this process reads: its own, where it hosts one (a
        torchrun rank hosts itself), else worker 0's."""
        local = self.session.local_workers
        return local[0] if local else 0

    def _first(self, results: list) -> Any:
        return next(r for r in results if r is not None)

    def __call__(self, input_ids: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """The logits ``[batch, tokens, vocab]`` (float32) for ``input_ids`` ``[batch, tokens]``."""
        ids = _as_lists(input_ids)
        results = self.session.call(decode.FORWARD, self.token, ids, self._answer)
        return self._first(results)

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        eos_token_id: int | Sequence[int] | str | None = "config",
        on_token: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """``input_ids`` followed by up to ``max_new_tokens`` tokens (greedy, or sampled with
        ``temperature`` and ``top_k`` from ``seed``), stopping early when every row has
        produced an ``eos_token_id``: by default the checkpoint's own (its config's
        ``eos_token_id``, a GGUF's ``tokenizer.ggml.eos_token_id``), as transformers' generate
        stops; ``None`` never stops early. ``on_token(count)``: told the number of tokens
        chosen so far, as they are chosen (worker processes tell every 0.2 s at most).

        >>> model.generate([[1, 2, 3]], max_new_tokens=4, on_token=print)  # doctest: +SKIP
        """
        if eos_token_id == "config":
            eos_token_id = _config_eos(self.config)
        eos = (
            []
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else list(eos_token_id)
        )
        sampling = {
            "do_sample": bool(do_sample),
            "temperature": float(temperature),
            "top_k": int(top_k),
            "seed": int(seed),
        }
        args = [self.token, _as_lists(input_ids), int(max_new_tokens), sampling, eos, self._answer]
        results = self.session.run(
            decode.GENERATE,
            lambda i: args,
            context=f"in {decode.GENERATE}",
            on_progress=on_token and _counter(on_token),
        )
        return torch.tensor(self._first(results), dtype=torch.long)

    def close(self) -> None:
        """Free the workers' models (the session stays open)."""
        if not self._closed and not self.session.closed:
            self._closed = True
            self.session.call(decode.RELEASE, self.token)

    def __enter__(self) -> TPModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _counter(report: Callable[[int], None]) -> Callable[[int], None]:
    """An ``on_progress(n)`` that tells ``report`` the sum of the ``n`` so far."""
    lock, done = threading.Lock(), [0]

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            report(done[0])

    return advance


def _config_eos(config: dict) -> int | list | None:
    """The end-of-sequence token(s) a checkpoint's config names, if any."""
    for key in ("eos_token_id", "tokenizer.ggml.eos_token_id"):
        value = config.get(key)
        if value is None and isinstance(config.get("text_config"), dict):
            value = config["text_config"].get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, list) and all(type(v) is int for v in value):
            return value
    return None


def _as_lists(input_ids) -> list:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        return input_ids.tolist()
    rows = list(input_ids)
    return (
        [list(map(int, r)) for r in rows]
        if rows and not isinstance(rows[0], int)
        else [list(map(int, rows))]
    )


def _dense_config(config: dict) -> dict:
    """The checkpoint's config, unquantized (the workers load dense weights)."""
    local = copy.deepcopy(config)
    local.pop("quantization_config", None)
    return local


def _build_spec(
    share: WorkerShare, dtype: torch.dtype, token: str, config: dict, gguf: dict | None
) -> dict:
    """What worker ``share.rank``'s build needs (``build.build``)."""
    record = share.record
    common = {
        "dtype": dtypes.from_torch(dtype),
        "quant": share.quantization,
        "token": token,
        "split_norms": share.projection_norms,
        "zero_on_others": share.row_parallel_biases,
        "kv_map": share.kv_map,
        "kv_projections": record.get("kv_projections", []),
        "head_dim": share.sizes["head_dim"],
    }
    itemsize = torch.empty((), dtype=dtype).element_size()
    eager = any(
        share.sizes.get(k, 0) * itemsize % 16
        for k in ("moe_intermediate_size", "intermediate_size")
    )
    if gguf is not None:
        sizes = dict(share.sizes)
        if share.kv_map is not None:  # expanded: one (copied) KV head per query head
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
        return {**common, "eager_experts": eager, "gguf": gguf, "sizes": sizes}
    sizes = dict(share.config)
    if share.kv_map is not None:  # expanded: one (copied) KV head per query head
        key = record["config_keys"]["num_key_value_heads"]
        sizes[key] = share.sizes["num_attention_heads"]
    return {
        **common,
        "eager_experts": eager,
        "experts": share.experts,
        "config": config,
        "sizes": sizes,
    }


def _gguf_spec(ckpt, validated, architecture: str) -> dict:
    """What every worker needs to build a GGUF's model: transformers' config of the whole
    model and its name for each tensor (``from_gguf``), read once here, each tensor's ggml
    type, and the tensors every worker holds whole."""
    from . import from_gguf

    try:
        config = from_gguf.config_dict(ckpt)
        mapping = from_gguf.weights_map(config, architecture)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, it cannot read it
        raise FormatError(
            f"transformers cannot build a model of this GGUF "
            f"({type(exc).__name__}: {exc}); load_tp_model builds transformers' "
            "own model, so it needs an architecture transformers reads from GGUF",
            file=ckpt.source,
        ) from None
    return {
        "arch": architecture,
        "config": config,
        "mapping": mapping,
        "types": {name: ckpt.tensor_format(name)["ggml_type"] for name in ckpt.metadata()},
        "replicated": [param.name for param in validated if param.replicated],
    }


#: ``progress(stage, done, total)``: ``stage`` "load" (bytes of pieces loaded) or "build" (bytes
#: of pieces dequantized and handed to transformers), ``done`` of ``total`` so far
StartProgress = Callable[[str, int, int], None]


def _stage(progress: StartProgress | None, stage: str, total: int) -> Callable[[int], None] | None:
    """An ``advance(nbytes)`` that reports ``stage``'s bytes so far to ``progress``."""
    if progress is None:
        return None
    progress(stage, 0, total)
    return _counter(lambda done: progress(stage, done, total))


def load_tp_model(
    params,
    session: Session,
    dtype: torch.dtype = torch.float32,
    *,
    shard_info: Any = None,
    experts: str = "tp",
    progress: bool | StartProgress = False,
) -> TPModel:
    """transformers' model of the checkpoint ``params`` (a folder, or an open checkpoint),
    split over the workers of ``session``, its weights dequantized to ``dtype``.

    The plan is the front door's (``shardload.load_sharded``'s): ``shard_info`` if given, else
    ``shard_info.json`` beside the checkpoint, else one made from its config; it must be one the
    planner wrote (its record of the model, ``__metadata__.model``, is what each worker's model
    is built from). ``experts="ep"`` plans whole routed experts per worker. ``progress``: a
    bar over the bytes loaded (``True``), none, or ``progress(stage, done, total)``, called as
    the pieces are loaded (stage ``"load"``) and then built into the model (``"build"``),
    in bytes of pieces (the CLI's one bar for ``shardload run``).

    >>> from shardload import ProcessSession                                 # doctest: +SKIP
    >>> from shardload.hf import load_tp_model
    >>> with ProcessSession(4) as sess:
    ...     model = load_tp_model("ckpt/", sess, dtype=torch.bfloat16)
    ...     logits = model(input_ids)
    ...     text = model.generate(input_ids, max_new_tokens=32)
    """
    if dtype not in _DTYPES:
        raise ShardloadError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got {dtype}")
    n = session.num_workers
    # 1. under torchrun rank 0 plans and the other ranks receive its plan (``plan_once``)
    job = plan_job(session, params, shard_info, experts=experts, what="planning the model's load")
    ckpt, resolved = job.checkpoint, job.resolved
    validated = resolved.validated
    shares = [worker_share(validated, i) for i in range(n)]
    kind = shares[0].record["checkpoint"]
    if kind not in ("hf", "gguf"):
        raise FormatError(
            "load_tp_model builds transformers' model from an HF checkpoint "
            "(a folder with config.json and safetensors) or a GGUF file; this "
            f"is a {kind} checkpoint (MLC checkpoints are not supported)",
            file=ckpt.source,
        )
    if experts == "ep" and kind == "gguf":
        raise mention(
            ShardloadError(
                "expert-parallel plans of GGUF checkpoints are not built "
                f"into a model yet: load with {EXPERTS_TP.python}"
            ),
            EXPERTS_TP,
        )
    gguf = _gguf_spec(ckpt, validated, shares[0].record["architecture"]) if kind == "gguf" else None
    # under torchrun each rank reports its own worker only, and rank 0 speaks for all
    report = progress if callable(progress) and session.reports else None
    total = sum(validated.bytes_per_worker(i) for i in session.workers_in_view)
    loading = _stage(report, "load", total) or bool(progress is True)
    sharded = load_validated(ckpt, validated, session, progress=loading)  # 2.
    config = _dense_config(ckpt.config) if kind == "hf" else {}  # 3.
    token = uuid.uuid4().hex
    with weights.sharing_replicated(token, len(session.local_workers)):  # 4.
        session.run(
            build.BUILD,
            lambda i: [_build_spec(shares[i], dtype, token, config, gguf)],
            context=f"while building the model of {ckpt.source}",
            on_progress=_stage(report, "build", total),
        )
    return TPModel(session, token, ckpt.config, sharded, resolved)


__all__ = ["TPModel", "load_tp_model"]
