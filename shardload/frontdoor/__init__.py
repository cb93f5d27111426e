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

Its names are imported when first used (``modules.lazy_names``), as the package's own are: a
command that only plans or validates (``shardload validate``, ``plan``, ``inspect``) imports
neither the loader nor the sessions, and so not torch (about 1.2 s of every such command).

>>> with open_session("thread", 4) as sess:                                 # doctest: +SKIP
...     sharded = load_sharded("examples/tiny_llama_q4", None, sess)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..modules import lazy_names

_LAZY = {
    "load_sharded": "loading",
    "resolve_plan": "plans",
    "ResolvedPlan": "plans",
    "REPLICATE": "plans",
    "PLAN_FILE": "plans",
    "plan_beside": "plans",
    "planned_fits": "plans",
    "plan_once": "shared_plan",
    "plan_job": "shared_plan",
    "JobPlan": "shared_plan",
    "planning_per_worker": "shared_plan",
    "open_session": "sessions",
    "register_session_kind": "sessions",
    "session_kinds": "sessions",
    "write_plan": "writes",
    "write_atomic": "writes",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)

if TYPE_CHECKING:  # pragma: no cover
    from .loading import load_sharded
    from .plans import PLAN_FILE, REPLICATE, ResolvedPlan, plan_beside, planned_fits, resolve_plan
    from .sessions import open_session, register_session_kind, session_kinds
    from .shared_plan import JobPlan, plan_job, plan_once, planning_per_worker
    from .writes import write_atomic, write_plan
