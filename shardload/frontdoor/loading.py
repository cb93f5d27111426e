"""``load_sharded``: the front door's load, for every caller (steps 1 to 4 of the package)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..gc_pause import gc_paused
from ..loader import ProgressCallback, ShardedParams, load_validated
from ..readplan import ReadPlan
from ..sessions import Session
from ..staging import Staging
from .shared_plan import plan_job, planning_per_worker

__all__ = ["load_sharded"]


def load_sharded(
    params: Any,
    shard_info: Any,
    session: Session,
    *,
    experts: str = "tp",
    progress: bool | ProgressCallback = True,
    timeout: float | None = None,
    staging: bool | Staging | None = None,
    reads: Callable[[ReadPlan], ReadPlan] | None = None,
) -> ShardedParams:
    """Shard ``params`` onto the workers of ``session``.

    ``params``: a ``Checkpoint`` (``open_checkpoint(path)``), a path, or a mapping of name ->
    numpy/torch array. ``shard_info``: the plan (a path to ``shard_info.json``, a dict, a
    ``ShardInfo``, a ``Plan`` bound to the session's N, or a ``ValidatedPlan``), ``None`` for
    the policy's choice (``shard_info.json`` beside the checkpoint, else a plan made from its
    config), or ``REPLICATE`` (every tensor whole on every worker). ``experts``: for a plan made
    from the config, ``"tp"`` splits routed experts, ``"ep"`` gives each worker whole ones.
    ``progress``: a tqdm bar over bytes (``True``), none (``False``), or a callback given each
    kept piece's bytes. ``timeout``: the watchdog for this load (default: the session's): a
    worker without progress for that many seconds fails the load with ``WorkerError`` naming
    it and the parameter it was on; the other workers are stopped and the session closed.
    ``staging``: how pieces travel to the devices (``Staging``): by default through a small
    ring of pinned host buffers for CUDA workers, straight into host memory for CPU workers;
    ``Staging(buffers=, buffer_mib=)`` sizes the ring (and stages for CPU workers too),
    ``False`` never stages. ``reads``: a transform of each worker's read plan before it runs
    (for integrations: ``loader.load_validated``).

    >>> with ThreadedSession(num_workers=4) as sess:                            # doctest: +SKIP
    ...     sharded = load_sharded("examples/tiny_llama_q4", None, sess)
    ...     sharded.shard("model.layers.0.mlp.down_proj.qweight", 3)
    """
    with gc_paused():  # a checkpoint's headers and plan are many objects, all kept
        # under torchrun rank 0 plans and the other ranks receive its plan
        job = plan_job(session, params, shard_info, experts=experts, what="preparing the load")
        planning = planning_per_worker(session, job)
        sharded = load_validated(
            job.checkpoint,
            job.resolved.validated,
            session,
            progress=progress,
            timeout=timeout,
            staging=staging,
            reads=reads,
        )
    sharded.stats.planning_per_worker = planning
    return sharded
