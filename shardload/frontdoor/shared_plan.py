"""One plan per job: under torchrun (and vLLM's ranks) rank 0 plans, the others receive it.

Planning a 100k-tensor model costs seconds of CPU; every rank of a job making the same plan
pays it N times before a byte moves, and in vLLM it adds to the engine's start-up (issue 40).
Here rank 0 resolves the plan by the front door's policy (``resolve_plan``) and the other ranks
receive it over the session's own group, then bind and validate it against their own
checkpoint's metadata: each rank still holds a ``ValidatedPlan`` of the checkpoint it reads.

Two exchanges, inside the caller's ``collective`` (whose heartbeats and watchdog stay around
them), each a ``Session.run`` of a session function here:

1. **status**: rank 0's outcome as JSON (``run`` hands every rank each rank's JSON result, in
   an exchange that names a rank gone, so the ranks waiting for rank 0's planning wait there):
   the plan's origin, source, note, the planner's decision in summary and the plan's length;
   or the error rank 0 raised, rebuilt on every rank as the same shardload error;
2. **plan**: the plan for N as JSON bytes in a uint8 tensor broadcast from rank 0 over
   ``ctx.group``, never pickled: each distinct list of steps once and each parameter the index
   of its list (a model's layers and experts share a handful: DeepSeek-V3's 91,991 tensors
   are 14 lists and 5.3 MB, mostly names); parsed as strictly as a plan file (strict JSON,
   ``ShardInfo.from_dict``), bound and validated on each rank.

Only the plan the policy chooses is shared (``shard_info=None``: the plan beside the checkpoint,
else the planner's); a plan given explicitly is each rank's own to bind and validate, as
before. Every rank takes part in both exchanges whatever happened to it, so the ranks stay in
step; what a rank failed at itself it raises after them, and the collective reports it on
every rank. Sessions where one process resolves the plan for all workers (threads, worker
processes) exchange nothing.
"""

from __future__ import annotations

import functools
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import strict_json
from ..errors import (
    FormatError,
    PlanError,
    SessionError,
    Setting,
    ShardloadError,
    StorageError,
    WorkerError,
    WorkerFailure,
    describe,
    mention,
    quote,
)
from ..gc_pause import gc_paused
from ..plan import MAX_PLAN_BYTES, Placement, ShardInfo, ValidatedPlan, ValidNumShards
from ..planners.decision import PlanKind
from ..readers import Checkpoint, as_checkpoint
from ..sessions import Session
from ..sessions.functions import register_session_func
from .plans import ResolvedPlan, resolve_plan

__all__ = [
    "FROM_RANK_0",
    "PLANNED",
    "DecisionSummary",
    "JobPlan",
    "plan_job",
    "plan_once",
    "planning_per_worker",
]

#: ``resolve_plan`` with the planner's options given to ``plan_once``
_Resolve = Callable[[Checkpoint, int, Any], ResolvedPlan]

#: ``JobPlan.plan_from``: this rank resolved its plan itself, or received rank 0's
PLANNED, FROM_RANK_0 = "planned", "rank 0"

_VALUES = "shardload.plan_values"
_SHARE = "shardload.share_plan"


@register_session_func(_VALUES)
def _status(ctx, value: Any) -> Any:
    """This worker's JSON ``value``: ``run`` exchanges results, so every rank gets each's."""
    return value


@register_session_func(_SHARE)
def _share(ctx, data: torch.Tensor | None, size: int) -> torch.Tensor:
    """Rank 0's ``data`` (``size`` bytes, uint8) on every rank, in one broadcast over the
    session's group; on the worker's device, as NCCL needs."""
    if ctx.rank == 0:
        assert data is not None  # rank 0 sends its plan; the others receive into buf
        buf = data.to(ctx.device)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=ctx.device)
    ctx.group.broadcast(buf, src=0)
    ctx.progress()
    return buf.cpu()


@dataclass(frozen=True)
class DecisionSummary:
    """The planner's decision as rank 0 made it, for the ranks that received its plan: what a
    ``PlanDecision`` says for people, not the planner's objects (``summary`` is its text)."""

    kind: PlanKind
    num_shards: int | None
    summary: str
    valid: ValidNumShards


@dataclass(frozen=True)
class JobPlan:
    """This rank's checkpoint and plan, and how it came by it. ``plan_from``: ``"planned"``
    (resolved here) or ``"rank 0"`` (received). ``seconds``: from the start until the plan was
    validated (a receiver's wait for rank 0 included); ``work_seconds``: this rank's own part
    (resolving the plan, or parsing and validating the one received)."""

    checkpoint: Checkpoint
    resolved: ResolvedPlan
    plan_from: str
    seconds: float
    work_seconds: float

    def timing(self) -> dict:
        return {
            "from": self.plan_from,
            "seconds": round(self.seconds, 4),
            "work_seconds": round(self.work_seconds, 4),
        }


def plan_once(
    session: Session,
    params: Any,
    shard_info: Any = None,
    *,
    experts: str = "tp",
    vocab_parallel: bool = False,
    what: str = "planning the load",
) -> JobPlan:
    """``params`` opened (``as_checkpoint``) and its plan for the session's workers, by the
    front door's policy: resolved on rank 0 alone and received by the others where the
    session's workers each run this (``Session.spmd``), else resolved here. Call it inside
    ``session.collective(what)`` (``plan_job`` does); every worker must call it (``what`` names
    the step in a ``WorkerError``). ``experts`` and ``vocab_parallel`` go to the planner
    (``resolve_plan``)."""
    start = time.perf_counter()
    # the planner's options, for whichever rank resolves the plan
    resolve = functools.partial(resolve_plan, experts=experts, vocab_parallel=vocab_parallel)
    if not session.spmd or session.num_workers == 1:
        ckpt = as_checkpoint(params)
        resolved = resolve(ckpt, session.num_workers, shard_info)
        took = time.perf_counter() - start
        return JobPlan(ckpt, resolved, PLANNED, took, took)
    if session.local_workers == [0]:
        return _plan_and_send(session, params, shard_info, resolve, what, start)
    return _receive(session, params, shard_info, resolve, what, start)


def plan_job(
    session: Session,
    params: Any,
    shard_info: Any = None,
    *,
    experts: str = "tp",
    what: str = "planning the load",
) -> JobPlan:
    """``plan_once`` inside ``session.collective(what)``: what a caller with nothing else to
    do in that collective calls (``load_sharded``, the CLI's load, ``load_tp_model``)."""
    with session.collective(what):
        return plan_once(session, params, shard_info, experts=experts, what=what)


def planning_per_worker(session: Session, job: JobPlan) -> list[dict] | None:
    """Every rank's ``JobPlan.timing()``, in rank order, for the load's statistics (one more
    exchange: after the collective, where every rank holds its plan); None where one process
    planned for every worker."""
    if not session.spmd:
        return None
    return session.run(_VALUES, lambda w: [job.timing()], context="gathering planning times")


# ---- rank 0 ------------------------------------------------------------------------------------


def _plan_and_send(
    session: Session, params: Any, shard_info: Any, resolve: _Resolve, what: str, start: float
) -> JobPlan:
    ckpt: Checkpoint | None = None
    resolved: ResolvedPlan | None = None
    failed: BaseException | None = None
    planning, data = False, b""
    try:
        ckpt = as_checkpoint(params)
        planning = True
        resolved = resolve(ckpt, session.num_workers, shard_info)
        if shard_info is None:
            data = _plan_bytes(resolved.validated)
    except BaseException as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
        failed = exc
    work = time.perf_counter() - start
    if failed is not None:
        status = {"ok": False, "planning": planning, "error": _error_json(failed)}
    else:
        assert resolved is not None  # (resolved where nothing failed)
        status = {"ok": True, "shared": shard_info is None, **_resolved_json(resolved, data)}
    # what is not JSON (a path object as an error's source) as its text: a status that failed
    # to encode would leave rank 0 out of the exchange the others wait in
    status = json.loads(json.dumps(status, default=str))
    try:
        session.run(_VALUES, lambda w: [status], context=what)
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            session.run(_SHARE, lambda w: [buf, len(data)], context=what)
    except BaseException:
        if failed is not None:  # its own failure is rank 0's answer; the exchange's is context
            raise failed  # noqa: B904 - the exchange's failure stays its __context__
        raise
    if failed is not None:
        raise failed
    assert ckpt is not None and resolved is not None  # (both made where nothing failed)
    return JobPlan(ckpt, resolved, PLANNED, time.perf_counter() - start, work)


def _plan_bytes(validated: ValidatedPlan) -> bytes:
    """The plan for this N as ASCII JSON, each distinct list of steps once (``"chains"``) and
    each parameter the index of its own (``"params"``): the layers and experts of a model
    share a handful of lists, so the text is mostly names, and each list is written once."""
    plan = validated.plan
    rest: dict[str, Any] = {}
    if plan.metadata:
        rest[ShardInfo.METADATA_KEY] = plan.metadata
    if plan.placement is not None:
        rest[Placement.KEY] = plan.placement.to_json()
    by_id: dict[int, int] = {}  # the planner's parameters share tuples of steps
    by_text: dict[str, int] = {}
    chains: list[list] = []
    params: dict[str, int] = {}
    for name, steps in plan.params.items():
        index = by_id.get(id(steps))
        if index is None:
            chain = [step.to_json() for step in steps]
            index = by_text.setdefault(json.dumps(chain), len(chains))
            if index == len(chains):
                chains.append(chain)
            by_id[id(steps)] = index
        params[name] = index
    data = json.dumps(
        {"plan": rest, "chains": chains, "params": params}, separators=(",", ":"), allow_nan=False
    ).encode()
    if len(data) > MAX_PLAN_BYTES:
        raise PlanError(
            f"the plan is {len(data)} bytes, over the {MAX_PLAN_BYTES}-byte limit "
            "of a plan, so it cannot be shared with the other ranks",
            source=plan.source,
        )
    return data


#: the keys of a plan that name no parameter
_NOT_PARAMS = (ShardInfo.METADATA_KEY, Placement.KEY)


def _plan_from_bytes(data: bytes, source: str | None) -> ShardInfo:
    """The plan ``_plan_bytes`` wrote, parsed as strictly as a plan file: strict JSON, its
    shape checked here, then ``ShardInfo.from_dict`` (every name and step, with the limits of
    a plan) of the plan it stands for, in which parameters of one list share it (so the
    parser reads each list once)."""
    try:
        wire = strict_json.loads(data)
    except ValueError as exc:
        raise _malformed(f"not valid JSON: {exc}", "plan") from None
    if not isinstance(wire, dict) or set(wire) != {"plan", "chains", "params"}:
        raise _malformed("other keys", "plan")
    rest, chains, params = wire["plan"], wire["chains"], wire["params"]
    if not (
        isinstance(rest, dict)
        and set(rest) <= set(_NOT_PARAMS)
        and isinstance(chains, list)
        and isinstance(params, dict)
    ):
        raise _malformed("not a plan", "plan")
    plan = dict(rest)
    for name, index in params.items():
        if type(index) is not int or not 0 <= index < len(chains) or name in _NOT_PARAMS:
            raise _malformed(f"parameter {quote(name)}", "plan")
        plan[name] = chains[index]
    return ShardInfo.from_dict(plan, source)


def _resolved_json(resolved: ResolvedPlan, data: bytes) -> dict:
    decision = resolved.decision
    summary = (
        None
        if decision is None
        else {
            "kind": decision.kind.value,
            "num_shards": decision.num_shards,
            "summary": str(decision.summary),
            **_working_json(decision.valid),
        }
    )
    return {
        "origin": resolved.origin,
        "source": resolved.source,
        "note": resolved.note,
        "plan_source": resolved.plan.source,
        "plan_bytes": len(data),
        "decision": summary,
    }


#: the errors rank 0 sends field by field, so each rank raises the same one (message included);
#: any other ``ShardloadError`` is rebuilt from its message as a ``ShardloadError``
_FIELDS = {
    PlanError: ("constraint", "source", "param", "step", "working"),
    FormatError: ("reason", "file", "tensor"),
    StorageError: ("reason", "url", "byte_range", "usage"),
    SessionError: (),
}


def _error_json(exc: BaseException) -> dict:
    kind = next(
        (k for k in _FIELDS if isinstance(exc, k)),
        ShardloadError if isinstance(exc, ShardloadError) else None,
    )
    return {
        "type": type(exc).__name__,
        "message": describe(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "kind": kind and kind.__name__,
        "fields": {
            f: _field_json(getattr(exc, f)) for f in (_FIELDS.get(kind, ()) if kind else ())
        },
        "settings": [[s.python, s.cli] for s in getattr(exc, "settings", ())],
    }


# ---- the other ranks ---------------------------------------------------------------------------


def _receive(
    session: Session, params: Any, shard_info: Any, resolve: _Resolve, what: str, start: float
) -> JobPlan:
    rank, ckpt, own = session.local_workers[0], None, None
    try:
        ckpt = as_checkpoint(params)
    except BaseException as exc:  # noqa: BLE001 - raised once the exchanges are done
        own = exc
    status = _read_status(session.run(_VALUES, lambda w: [None], context=what)[0])
    data = None
    if status["ok"] and status["shared"]:
        data = (
            session.run(_SHARE, lambda w: [None, status["plan_bytes"]], context=what)[rank]
            .numpy()
            .tobytes()
        )
    if own is not None:
        raise own
    assert ckpt is not None  # (opened where nothing was raised)
    received = time.perf_counter()
    if shard_info is None and not status["ok"]:
        raise _rebuilt(status, what)
    if shard_info is None and data is not None:
        with gc_paused():  # a plan is many objects, all kept
            info = _plan_from_bytes(data, status["plan_source"])
            validated = info.bind(session.num_workers).validate(ckpt.metadata())
        resolved = ResolvedPlan(
            validated,
            status["origin"],
            status["source"],
            _decision(status["decision"]),
            status["note"],
        )
        plan_from = FROM_RANK_0
    else:  # a plan of its own (or rank 0 had one): resolved here, as without sharing
        resolved = resolve(ckpt, session.num_workers, shard_info)
        plan_from = PLANNED
    done = time.perf_counter()
    return JobPlan(ckpt, resolved, plan_from, done - start, done - received)


def _malformed(why: str, part: str = "plan status") -> ShardloadError:
    return ShardloadError(
        f"rank 0's {part} is malformed ({why}): do all ranks run the same shardload?"
    )


def _check(value: dict, key: str, *types: type) -> Any:
    if (
        key not in value
        or not isinstance(value[key], types)
        or (isinstance(value[key], bool) and bool not in types)
    ):
        raise _malformed(f"{key}: {type(value.get(key)).__name__}")
    return value[key]


def _read_status(status: Any) -> dict:
    """Rank 0's status, every field checked (the plan's size before anything is allocated)."""
    if not isinstance(status, dict):
        raise _malformed(f"a {type(status).__name__}")
    if not _check(status, "ok", bool):
        _check(status, "planning", bool)
        error = _check(status, "error", dict)
        for key in ("type", "message", "traceback"):
            _check(error, key, str)
        _check(error, "kind", str, type(None))
        _check(error, "fields", dict)
        if not all(
            isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s)
            for s in _check(error, "settings", list)
        ):
            raise _malformed("settings")
        return status
    if _check(status, "shared", bool):
        size = _check(status, "plan_bytes", int)
        if not 0 < size <= MAX_PLAN_BYTES:
            raise _malformed(f"a plan of {size} bytes")
        for key in ("origin", "source", "note"):
            _check(status, key, str)
        _check(status, "plan_source", str, type(None))
        _check(status, "decision", dict, type(None))
    return status


def _working_json(working: ValidNumShards) -> dict:
    return {"valid": list(working), "tried": working.tried, "limit": working.limit}


def _field_json(value: Any) -> Any:
    """An error's field as JSON: the N that work (a refusal's ``working``) with how far they
    were looked for."""
    return _working_json(value) if isinstance(value, ValidNumShards) else value


def _working(value: dict) -> ValidNumShards:
    valid = _check(value, "valid", list)
    if not all(type(n) is int for n in valid):
        raise _malformed("valid")
    return ValidNumShards(
        valid, tried=_check(value, "tried", int), limit=_check(value, "limit", int)
    )


def _decision(summary: dict | None) -> DecisionSummary | None:
    if summary is None:
        return None
    try:
        kind = PlanKind(_check(summary, "kind", str))
    except ValueError:
        raise _malformed("kind") from None
    return DecisionSummary(
        kind,
        _check(summary, "num_shards", int, type(None)),
        _check(summary, "summary", str),
        _working(summary),
    )


def _rebuilt(status: dict, what: str) -> BaseException:
    """Rank 0's failure as this rank raises it: the same shardload error where rank 0 failed
    planning (this rank would have too, planning the same); else ``WorkerError`` naming rank 0,
    as a collective reports another rank's failure."""
    error = status["error"]
    kind, fields, message = error["kind"], error["fields"], error["message"]
    if not status["planning"] or kind is None:
        return WorkerError([WorkerFailure(0, error["type"], message, error["traceback"])], what)
    try:
        if kind == "PlanError":
            working = fields["working"]
            exc: ShardloadError = PlanError(
                fields["constraint"],
                source=fields["source"],
                param=fields["param"],
                step=fields["step"],
                working=None if working is None else _working(working),
            )
        elif kind == "FormatError":
            exc = FormatError(fields["reason"], file=fields["file"], tensor=fields["tensor"])
        elif kind == "StorageError":
            exc = StorageError(
                fields["reason"],
                url=fields["url"],
                byte_range=fields["byte_range"],
                usage=fields["usage"],
            )
        elif kind == "SessionError":
            exc = SessionError(message)
        else:
            exc = ShardloadError(message)
        return mention(exc, *(Setting(*s) for s in error["settings"]))
    except (KeyError, TypeError, ValueError) as bad:
        return _malformed(f"its error: {type(bad).__name__}")
