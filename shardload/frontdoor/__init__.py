"""The front door: one library layer every caller goes through.

The CLI, ``load_sharded``, ``shardload.hf`` and the integrations to come (an engine's load
format, object storage) all reach the loader the same way:

1. **open** the checkpoint (``readers.as_checkpoint``: a path, an open ``Checkpoint``, or a
   mapping of arrays);
2. **resolve the plan** by one policy (``plans.resolve_plan``): ``REPLICATE``, else the plan
   given, else ``shard_info.json`` beside the checkpoint, else one made from the model's
   config; it is validated for N there, once. Under torchrun (and vLLM's ranks) rank 0
   resolves it and the other ranks receive it, each validating it against its own checkpoint
   (``shared_plan.plan_once``: one plan per job, not one per rank);
3. **open a session** by kind (``open_session``: ``thread``, ``process``, ``torch``, or one a
   plugin registered: ``sessions.kinds``);
4. **load** (``loader.load_validated``, the numbered steps of ``loader.py``).

Around them: plans are written whole or not at all (``write_plan``), and help text and the
documentation's tables are made from the tables themselves (``tables.py``).

>>> with open_session("thread", 4) as sess:                                 # doctest: +SKIP
...     sharded = load_sharded("examples/tiny_llama_q4", None, sess)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from ..errors import PlanError
from ..gc_pause import gc_paused
from ..loader import ProgressCallback, ShardedParams, load_validated
from ..plan import MAX_PLAN_BYTES, ShardInfo
from ..readplan import ReadPlan
from ..sessions import Session
from ..sessions.kinds import open_session, register_session_kind, session_kinds
from ..staging import Staging
from .plans import PLAN_FILE, REPLICATE, ResolvedPlan, plan_beside, planned_fits, resolve_plan
from .shared_plan import JobPlan, plan_once, planning_per_worker
from .writes import write_atomic

__all__ = ["load_sharded", "resolve_plan", "ResolvedPlan", "REPLICATE", "PLAN_FILE",
           "plan_beside", "planned_fits", "plan_once", "JobPlan", "open_session",
           "register_session_kind", "session_kinds", "write_plan", "write_atomic"]


def load_sharded(params: Any, shard_info: Any, session: Session, *, experts: str = "tp",
                 progress: Union[bool, ProgressCallback] = True,
                 timeout: Optional[float] = None,
                 staging: Union[None, bool, Staging] = None,
                 reads: Optional[Callable[[ReadPlan], ReadPlan]] = None) -> ShardedParams:
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
        with session.collective("preparing the load"):
            # under torchrun rank 0 plans and the other ranks receive its plan
            job = plan_once(session, params, shard_info, experts=experts,
                            what="preparing the load")
        planning = planning_per_worker(session, job)
        sharded = load_validated(job.checkpoint, job.resolved.validated, session,
                                 progress=progress, timeout=timeout, staging=staging,
                                 reads=reads)
    sharded.stats.planning_per_worker = planning
    return sharded


def write_plan(info: ShardInfo, path: Optional[str] = None) -> str:
    """``info`` as ``shard_info.json`` text, written whole or not at all to ``path`` when given
    (``OSError`` if it cannot be); a plan too large for shardload to read back is refused."""
    text = info.dumps()
    size = len(text.encode())
    if size > MAX_PLAN_BYTES:
        raise PlanError(f"the plan is {size} bytes, over the {MAX_PLAN_BYTES}-byte limit a "
                        "plan file may have; a zero-padded plan lists every unit, so try an N "
                        "the model divides", source=info.source)
    if path is not None:
        write_atomic(path, text)
    return text
