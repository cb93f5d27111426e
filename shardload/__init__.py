"""shardload: load already-quantized checkpoints onto N tensor-parallel workers, any N.

>>> import shardload                                                   # doctest: +SKIP
>>> params = shardload.open_checkpoint("examples/tiny_llama_q4")       # doctest: +SKIP
>>> with shardload.ThreadedSession(num_workers=4) as sess:             # doctest: +SKIP
...     sharded = shardload.load_sharded(params, "examples/tiny_llama_q4/shard_info.json", sess)
...     sharded.shard("model.layers.0.self_attn.q_proj.qweight", 2).shape
torch.Size([32, 64])

Public names are imported lazily, so ``import shardload`` (and ``shardload --help``) does not
import torch until something that needs it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    FormatError,
    PlanError,
    SessionClosedError,
    SessionError,
    ShardloadError,
    StorageError,
    UnknownSessionFunctionError,
    UnknownShardFunctionError,
    WorkerCrashedError,
    WorkerError,
)
from .modules import lazy_names

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "load_sharded": "frontdoor",
    "REPLICATE": "frontdoor",
    "open_session": "frontdoor",
    "resolve_plan": "frontdoor",
    "ShardedParams": "loader",
    "LoadStats": "loader",
    "Staging": "staging",
    "open_checkpoint": "readers",
    "Checkpoint": "readers",
    "TensorMeta": "readers",
    "ArrayCheckpoint": "readers",
    "ShardInfo": "plan",
    "Plan": "plan",
    "register_shard_func": "registry",
    "get_shard_func": "registry",
    "list_shard_funcs": "registry",
    "load_plugins": "registry",
    "ShardFunc": "registry",
    "Session": "sessions",
    "ThreadedSession": "sessions",
    "ProcessSession": "sessions",
    "TorchDistributedSession": "sessions",
    "WorkerContext": "sessions",
    "register_session_func": "sessions",
    "Selection": "selection",
    "plan_for": "planners",
}

__all__ = sorted(
    [
        *_LAZY,
        "ShardloadError",
        "PlanError",
        "UnknownShardFunctionError",
        "UnknownSessionFunctionError",
        "SessionClosedError",
        "SessionError",
        "FormatError",
        "StorageError",
        "WorkerError",
        "WorkerCrashedError",
        "__version__",
    ]
)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)


if TYPE_CHECKING:  # pragma: no cover
    from .frontdoor import REPLICATE, load_sharded, open_session, resolve_plan
    from .loader import LoadStats, ShardedParams
    from .plan import Plan, ShardInfo
    from .planners import plan_for
    from .readers import ArrayCheckpoint, Checkpoint, TensorMeta, open_checkpoint
    from .registry import (
        ShardFunc,
        get_shard_func,
        list_shard_funcs,
        load_plugins,
        register_shard_func,
    )
    from .selection import Selection
    from .sessions import (
        ProcessSession,
        Session,
        ThreadedSession,
        TorchDistributedSession,
        WorkerContext,
        register_session_func,
    )
    from .staging import Staging
