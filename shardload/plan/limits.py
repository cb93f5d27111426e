"""The limits a plan is parsed, bound and validated within, and the JSON Schema states.

Every limit is far beyond what a real plan needs, and each refusal says which one was hit.
The other modules of ``shardload.plan`` read them here when they run (``limits.MAX_STEPS``),
never as copies taken at import: ``json_schema()`` and the parser then always agree, and a test
that makes a limit small patches it in this one module.
"""

from __future__ import annotations

from .. import dtypes
from ..limits import MAX_NUM_SHARDS

__all__ = [
    "GROWTH_SLACK_BYTES",
    "INT64_RANGE",
    "MAX_DIM",
    "MAX_DIMS",
    "MAX_EXPRESSIONS",
    "MAX_EXTRA_ARGS",
    "MAX_GROWTH",
    "MAX_NUM_SHARDS",
    "MAX_PARAMS",
    "MAX_PLAN_BYTES",
    "MAX_STEPS",
]

#: the plan file's size: a symbolic plan for a 671B-parameter MoE model (about 100k tensors) is
#: a few MB, but a zero-padded plan lists every unit a worker takes (for bf16 one unit is one
#: row: Llama-3.1-405B at N=3 is 137 MB); parsing is linear, so the cap only stops absurd files
MAX_PLAN_BYTES = 256 << 20
#: parameters in one plan: the largest MoE checkpoints hold a few hundred thousand tensors
MAX_PARAMS = 1 << 20
#: steps per parameter: real plans use one or two (expand per-part scales, then split)
MAX_STEPS = 16
#: dims of one out_shape: torch's own limit
MAX_DIMS = 64
#: extra args of one step: ``shardload.take_units`` lists every worker's unit indices (4096
#: workers x a few padded heads or MLP blocks each is tens of thousands); 2**20 leaves a wide margin
MAX_EXTRA_ARGS = 1 << 20
#: distinct expression strings in one plan: planners write a handful per distinct tensor shape
#: (``"4096 // num_shards"``), repeated for every layer
MAX_EXPRESSIONS = 1 << 16
#: the largest dimension a declared shape may have (see ``dtypes.MAX_DIM``)
MAX_DIM = dtypes.MAX_DIM
#: every intermediate of a parameter's steps may be at most MAX_GROWTH * num_shards times the
#: *stored* tensor (+ slack): replication legitimately makes N copies, padding a little more;
#: beyond that is a memory bomb. Bounding each step against the stored tensor (not only its own
#: input) also bounds chains: k ``replicate`` steps would otherwise grow N**k.
MAX_GROWTH = 2
#: slack for tiny metadata tensors that a step legitimately expands: three per-part scales made
#: into one float32 scale per row of a fused qkv weight (``shardload.repeat_segments``; 40 KiB
#: for a 70B model's 10240 rows). Small enough that a chain of replicates of a tiny tensor is
#: still refused within a few steps.
GROWTH_SLACK_BYTES = 64 << 10
#: numbers in a plan (extra args) lie within int64
INT64_RANGE = (-(2**63), 2**63 - 1)
