"""``shard_info.json``: parse, bind to one ``num_shards``, validate against a checkpoint.

The lifecycle of a plan, one module for each stage:

1. **Parse** (``parse``: ``ShardInfo.load`` / ``loads`` / ``from_dict``): a regular file of at
   most ``MAX_PLAN_BYTES``, strict UTF-8 JSON (see ``strict_json``: no duplicate keys,
   NaN/Infinity, numbers overflowing to infinity or lone surrogates), structure checked by
   ``_parse_step`` with the stated limits (``limits``). Shapes and extra args may still be
   expressions of ``num_shards``; each distinct one is parsed once.
2. **Bind** (``bound``: ``ShardInfo.bind(N)``): every expression evaluated for N (at most
   ``MAX_NUM_SHARDS``), giving an immutable ``Plan``. A plan written with plain integers for
   another N is refused here, and so is a shape no tensor can have (a dim beyond 2**53, a byte
   span beyond int64).
3. **Validate** (``validated``: ``Plan.validate(metadata)``): against the checkpoint's names,
   shapes and dtypes, before any tensor data is read: functions exist, arity, each step's
   declared output agrees with the function's shape rule, the last output has N on axis 0, no
   intermediate is absurdly larger than the stored tensor. The result, a ``ValidatedPlan``, is
   what the loader runs.

Every pass is linear in the plan's size, and a hostile plan gets one ``PlanError`` naming the
file, the parameter and the step, what was found and the limit, with every name and value in
it cut short (``errors.quote``, ``messages``).

**The JSON Schema** (``schema``). ``json_schema()`` builds the schema of ``shard_info.json``
from the very limits and names the parser checks, and ``shardload/schemas/shard_info.schema.json``
is its output, shipped for other tools. After changing a limit, regenerate the file with::

    python -c "from shardload.plan import write_schema; write_schema()"

(or run ``SHARDLOAD_WRITE_SCHEMA=1 python -m pytest tests/test_plan_schema.py``).

**Placement** (``placement``). A plan may hold whole parameters on some workers only (expert
parallelism: each worker holds whole experts): ``"__placement__": {"num_shards": N, "params":
{name: [worker, ...]}}``. A placed parameter takes no steps (each of its workers keeps it
whole), the plan is for that N alone (binding it to another is refused with the way to
re-plan), and a worker not named neither reads nor keeps it (``ParamPlan.workers``,
``ValidatedPlan.held_by``).

**Which N** (``shards``). ``valid_num_shards`` lists the N a plan binds and validates for on a
checkpoint (each distinct parameter once per N, the work capped), and ``check_plan_fits``
validates it for one N, its refusal naming the N that work where other N do.

**One serialisation** (``steps``). ``step_json`` writes a step as ``shard_info.json`` has it;
``RawStep``, ``Step``, ``ShardInfo.to_dict``/``dumps``, ``Plan.to_dict`` and the planners all go
through it.

The modules import one another in one direction: ``shards`` → ``parse`` → ``bound`` →
``validated``; each of those and ``schema`` → ``steps`` → ``placement`` → ``messages`` and
``limits``. The names this package exports are the public ones; the modules are its internals.

>>> info = ShardInfo.from_dict({"w": [["shardload.split", [["num_shards", "8 // num_shards"],
...                                                       "float16"], 0]]})
>>> plan = info.bind(2)
>>> plan.params["w"][0].out_shape
(2, 4)
"""

from __future__ import annotations

from .bound import Plan
from .limits import (
    MAX_DIM,
    MAX_DIMS,
    MAX_EXPRESSIONS,
    MAX_EXTRA_ARGS,
    MAX_GROWTH,
    MAX_NUM_SHARDS,
    MAX_PARAMS,
    MAX_PLAN_BYTES,
    MAX_STEPS,
)
from .parse import ShardInfo
from .placement import Placement
from .schema import SCHEMA_FILE, json_schema, schema_text, write_schema
from .shards import (
    MAX_SHARDS_TRIED,
    MAX_VALIDATION_WORK,
    ValidNumShards,
    check_plan_fits,
    valid_num_shards,
)
from .steps import Step, step_json
from .validated import ParamPlan, ValidatedPlan

__all__ = [
    "MAX_DIM",
    "MAX_DIMS",
    "MAX_EXPRESSIONS",
    "MAX_EXTRA_ARGS",
    "MAX_GROWTH",
    "MAX_NUM_SHARDS",
    "MAX_PARAMS",
    "MAX_PLAN_BYTES",
    "MAX_SHARDS_TRIED",
    "MAX_STEPS",
    "MAX_VALIDATION_WORK",
    "SCHEMA_FILE",
    "ParamPlan",
    "Placement",
    "Plan",
    "ShardInfo",
    "Step",
    "ValidNumShards",
    "ValidatedPlan",
    "check_plan_fits",
    "json_schema",
    "schema_text",
    "step_json",
    "valid_num_shards",
    "write_schema",
]
