"""``load_validated``: every worker ends up with its own piece of every parameter.

The loader drives every load in the same numbered steps, whatever the session:

1. **Open** the checkpoint: headers only (``open_checkpoint``; an in-memory mapping as is).
2. **Bind and validate** the plan once: bound to the session's N, checked against the
   checkpoint's names, shapes and dtypes and the registry's rules. A plan that does not fit
   fails here, before a byte of tensor data is read.
3. **Build each worker's read plan** (``readplan``): which bytes of which file make its piece of
   each parameter, or which chain of shard functions to compute. Workers outside this process
   get files they can map (an in-memory checkpoint is written to a temporary file first) and
   the plugin modules their chains need, and their read plans as compact JSON
   (``pieces.wire``). The bytes the workers read of objects in object
   storage are fetched once, here, for all of them, while they read (``pieces.stream``: into
   memory that workers in other processes map, within a bounded window).
4. **Run** the per-worker load (``pieces.load_pieces``, a session function) on every worker
   with its read plan and the staging it uses (``staging.Staging``: the pipeline to a GPU):
   the session decides where that runs (threads, worker processes, this torchrun rank), the
   loader what.
5. **Gather** each worker's statistics into one ``LoadStats``.
6. **Return** ``ShardedParams``: the pieces themselves for workers in this process, handles to
   fetch them from the others.

Every kept piece owns its memory. Sessions know nothing of any of this: they run a function.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import DEVICE_CUDA, PLUGINS, PlanError, SessionClosedError, ShardloadError, mention
from .gc_pause import gc_paused
from .modules import importable_module
from .pieces import FETCH_PIECE, LOAD_PIECES, RELEASE_LOADS, LoadRequest, local_load
from .pieces.chains import cupy_missing
from .pieces.stream import streams_for_load
from .plan import ParamPlan, Plan, ShardInfo, ValidatedPlan
from .readers import Checkpoint, as_checkpoint
from .readplan import ReadPlan, build_read_plans, worker_functions
from .sessions import Session
from .sessions.base import check_timeout
from .staging import Staging, staging_for

__all__ = ["LoadStats", "ShardedParams", "load_validated", "progress_callback"]

ProgressCallback = Callable[[int], None]


# ---- the result ----------------------------------------------------------------------------------


@dataclass
class LoadStats:
    """What a load moved, per worker, and how long it took."""

    seconds: float
    num_shards: int
    bytes_per_worker: list[int]
    tensors_per_worker: list[int]
    bytes_read_per_worker: list[int]
    #: each worker's staged pipeline (``StagingStats.as_dict()``), or None on the direct path
    staging_per_worker: list[dict | None] | None = None
    #: under torchrun, each rank's planning (``frontdoor.shared_plan``): ``{"from": "planned" |
    #: "rank 0", "seconds", "work_seconds"}``; None where one process planned for every worker
    planning_per_worker: list[dict] | None = None

    @property
    def bytes_total(self) -> int:
        """Bytes of all kept shards, summed over workers."""
        return sum(self.bytes_per_worker)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "num_shards": self.num_shards,
            "bytes_total": self.bytes_total,
            "bytes_per_worker": self.bytes_per_worker,
            "tensors_per_worker": self.tensors_per_worker,
            "bytes_read_per_worker": self.bytes_read_per_worker,
            "staging_per_worker": self.staging_per_worker,
            "planning_per_worker": self.planning_per_worker,
        }


class ShardedParams:
    """Every worker's shards after ``load_sharded``.

    With threads the shards are in this process and ``shard`` returns them, also once the
    session is closed; with worker processes they stay in the workers and ``shard`` fetches a
    copy, while the session is open (``SessionClosedError`` after: they went with the
    processes); under torch.distributed a rank holds only its own.

    >>> sharded.shard("x_0", 2)        # worker 2's piece                  # doctest: +SKIP
    >>> sharded.worker(2)              # {name: tensor} of worker 2        # doctest: +SKIP
    """

    def __init__(
        self,
        names: list[str],
        devices: list[torch.device],
        stats: LoadStats,
        plan: ValidatedPlan,
        fetch: Callable[[str, int], torch.Tensor],
    ):
        self.names = list(names)
        self._known = set(names)
        self.devices = devices
        self.stats = stats
        self.plan = plan
        self._fetch = fetch

    @property
    def num_shards(self) -> int:
        return self.stats.num_shards

    def shard(self, name: str, worker: int) -> torch.Tensor:
        """Worker ``worker``'s piece of parameter ``name``. A piece held in a worker process is
        fetched from it: ``SessionClosedError`` once the session is closed."""
        if type(worker) is not int or not 0 <= worker < self.num_shards:
            raise IndexError(f"worker {worker!r} out of range for {self.num_shards} workers")
        if name not in self._known:
            raise KeyError(f"no parameter named {name!r}")
        param = self.plan.params[name]
        if not param.held_by(worker):
            raise KeyError(
                f"worker {worker} holds no piece of {name!r}: the plan places it on "
                f"worker(s) {', '.join(map(str, param.workers or ()))} only "
                "(__placement__, expert parallelism)"
            )
        return self._fetch(name, worker)

    def holds(self, name: str, worker: int) -> bool:
        """Whether worker ``worker`` keeps a piece of ``name`` (all do, but for parameters the
        plan places on some workers only)."""
        return name in self._known and self.plan.params[name].held_by(worker)

    def worker(self, worker: int) -> dict[str, torch.Tensor]:
        """All of worker ``worker``'s tensors, by name."""
        return {
            name: self.shard(name, worker)
            for name in self.names
            if self.plan.params[name].held_by(worker)
        }

    def __repr__(self) -> str:
        return (
            f"ShardedParams({len(self.names)} params on {self.num_shards} workers, "
            f"{self.stats.bytes_total} bytes)"
        )


# ---- the steps -----------------------------------------------------------------------------------


def validated_for(shard_info: Any, num_shards: int, ckpt: Checkpoint) -> ValidatedPlan:
    """The plan bound to N and validated against ``ckpt``: done here, or already done by the
    caller (a ``ValidatedPlan`` of this N whose tensors are ``ckpt``'s, as the front door
    passes). ``shard_info`` is explicit: which plan a load uses is the front door's policy
    (``frontdoor.resolve_plan``), not the loader's."""
    if shard_info is None:
        raise PlanError(
            "the loader runs the plan it is given; shardload.load_sharded (the front "
            "door) decides which plan a load uses when it is given none"
        )
    if isinstance(shard_info, ValidatedPlan):
        if shard_info.num_shards != num_shards:
            raise PlanError(
                f"this plan is bound to num_shards={shard_info.num_shards}, but the "
                f"session has {num_shards} workers",
                source=shard_info.plan.source,
            )
        metadata = ckpt.metadata()
        get = metadata.get
        if len(metadata) == len(shard_info.params) and all(  # mostly the same objects
            (meta := get(name)) is p.meta or meta == p.meta for name, p in shard_info.params.items()
        ):
            return shard_info
        shard_info = shard_info.plan  # validated against other tensors: validate it here
    return _bind(shard_info, num_shards).validate(ckpt.metadata())


def _bind(shard_info: Any, num_shards: int) -> Plan:
    if isinstance(shard_info, Plan):
        if shard_info.num_shards != num_shards:
            raise PlanError(
                f"this plan is bound to num_shards={shard_info.num_shards}, but the "
                f"session has {num_shards} workers",
                source=shard_info.source,
            )
        return shard_info
    return ShardInfo.coerce(shard_info).bind(num_shards)


def _distinct_chains(params) -> list[ParamPlan]:
    """The first of ``params`` with each chain (steps and their functions): what the checks
    below look at. Parameters alike share one tuple of each (``ValidatedPlan``): a check per
    parameter was a Python loop per tensor."""
    first: dict[tuple[int, int], ParamPlan] = {}
    for param in params:
        first.setdefault((id(param.steps), id(param.funcs)), param)
    return list(first.values())


def _check_devices(
    chains: list[ParamPlan], devices: list[torch.device], source: str | None
) -> None:
    """cupy shard functions need CUDA workers, and cupy; say so before anything is read
    (``chains``: ``_distinct_chains``)."""
    on_cuda = all(d.type == "cuda" for d in devices)
    for param in chains:
        for step, func in zip(param.steps, param.funcs):
            if func.array != "cupy":
                continue
            if on_cuda:
                missing = cupy_missing()
                if missing is None:
                    return
                raise PlanError(
                    f"{func.name} takes cupy arrays, and {missing}",
                    source=source,
                    param=param.name,
                    step=step.index,
                )
            raise mention(
                PlanError(
                    f"{func.name} takes cupy arrays, which need CUDA devices, but this session's "
                    f"workers are on {', '.join(map(str, devices))}; load with "
                    f"{DEVICE_CUDA.python}",
                    source=source,
                    param=param.name,
                    step=step.index,
                ),
                DEVICE_CUDA,
            )


def _plugin_modules(chains: list[ParamPlan], remote: bool, source: str | None) -> list[str]:
    """The modules a worker process imports to have every function it will run: those of the
    custom functions in chains and fixups (functions read by ``ranges`` alone run nowhere). A
    function it cannot import (defined in ``__main__`` or in a function) is refused here."""
    modules: dict[str, None] = {}
    for param in chains:
        for step, func in worker_functions(param):
            module = importable_module(func.func)
            if module is None and remote:
                origin = (
                    getattr(func.func, "__module__", "?")
                    + "."
                    + getattr(func.func, "__qualname__", "?")
                )
                raise mention(
                    PlanError(
                        f"function {func.name!r} ({origin}) is registered in this process only, "
                        "so worker processes cannot run it: define it at module level in an "
                        f"importable module and pass that module as a plugin ({PLUGINS.python})",
                        source=source,
                        param=param.name,
                        step=step.index,
                    ),
                    PLUGINS,
                )
            if module is not None:
                modules[module] = None
    return list(modules)


@contextlib.contextmanager
def _readable_elsewhere(ckpt: Checkpoint, remote: bool):
    """``ckpt``, or, when workers in other processes must read an in-memory checkpoint, the
    same tensors written to a temporary safetensors file (in RAM where there is /dev/shm) and
    opened from there; the file is removed afterwards."""
    from .sources.specs import FileSource

    if not remote or all(isinstance(src, FileSource) for src in ckpt.sources()):
        yield ckpt
        return
    from safetensors.torch import save_file

    from .readers import open_checkpoint

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = tempfile.mkdtemp(prefix="shardload-", dir=base)
    try:
        file = os.path.join(folder, "params.safetensors")
        save_file({name: ckpt.read(name) for name in ckpt.names()}, file)
        with open_checkpoint(file) as spilled:
            yield spilled
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fetch_bar(
    streams: list, progress: bool | ProgressCallback, stack: contextlib.ExitStack
) -> None:
    """A bar over the bytes fetched from object storage, beside the load's own (only where
    the load shows a bar of its own)."""
    if progress is not True:
        return
    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(s.total_bytes for s in streams),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="fetching",
        leave=False,
        disable=None,
    )
    for stream in streams:
        stream.on_bytes = bar.update  # one fetch thread per stream: its own calls in order
    stack.callback(bar.close)


def _raise_fetch_error(streams: list) -> None:
    """A load whose fetch failed fails with the fetch's own error (one line: the URL, what
    happened), not the workers' report of waiting in vain."""
    for stream in streams:
        stream.close()
        if stream.error is not None:
            raise stream.error from None


def progress_callback(progress: bool | ProgressCallback, total: int):
    """A thread-safe ``advance(nbytes)`` and a ``close()``."""
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return (lambda n: None), lambda: None
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="loading",
        leave=False,
        disable=None,
    )  # None: no bar when stderr is not a terminal
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            bar.update(n)

    return advance, bar.close


#: loads whose results were dropped, per session: their pieces are released in the workers
#: at the session's next load (never from a finalizer: that could interleave with a request)
_dropped: weakref.WeakKeyDictionary[Session, list[str]] = weakref.WeakKeyDictionary()


def _release_dropped(session: Session) -> None:
    dropped = _dropped.get(session)
    if dropped and not session.spmd:
        tokens, dropped[:] = list(dropped), []
        session.call(RELEASE_LOADS, tokens)


def _fetcher(session: Session, token: str, local: dict[int, dict[str, torch.Tensor]]):
    def fetch(name: str, worker: int) -> torch.Tensor:
        pieces = local.get(worker)
        if pieces is not None:
            return pieces[name]
        if session.spmd:
            raise ShardloadError(
                f"this process holds only the shards of worker(s) "
                f"{sorted(local)}; worker {worker}'s are in its own process"
            )
        if session.closed:  # the piece went with its worker process
            raise SessionClosedError(type(session).__name__, worker=worker, param=name)
        try:
            return session.run(
                FETCH_PIECE, [(token, name)], workers=[worker], context=f"while fetching {name!r}"
            )[0]
        except SessionClosedError:  # closed meanwhile
            raise SessionClosedError(type(session).__name__, worker=worker, param=name) from None

    return fetch


def _load_requests(
    token: str,
    plans: dict[int, ReadPlan],
    here: set[int],
    sides: dict[int, Any],
    modules: list[str],
    staged: Staging | None,
) -> Callable[[int], list[dict]]:
    """``load_pieces``'s arguments for each worker, as ``Session.run`` takes them: its
    ``LoadRequest`` as JSON. A worker here takes its read plan and its side of the stream of
    object bytes from the load itself (``LocalLoad``); one in another process gets both on the
    wire. Made for every worker at once, before the load is timed (a large plan's JSON takes
    long to make)."""
    requests = {
        i: LoadRequest(
            token,
            None if i in here else plan,
            None if i in here else sides.get(i),
            tuple(modules),
            staged,
        ).to_json()
        for i, plan in plans.items()
    }

    def args(i: int) -> list[dict]:
        return [requests[i]]

    return args


# ---- the entry point ---------------------------------------------------------------------------


def load_validated(
    params: Any,
    shard_info: Any,
    session: Session,
    *,
    progress: bool | ProgressCallback = True,
    timeout: float | None = None,
    staging: bool | Staging | None = None,
    reads: Callable[[ReadPlan], ReadPlan] | None = None,
) -> ShardedParams:
    """The load itself, with the plan already chosen: the core the front door
    (``shardload.load_sharded``) calls once it has resolved and validated the plan, and that
    the CLI and integrations holding a ``ValidatedPlan`` call directly.

    ``shard_info`` is the plan to run, never ``None`` (choosing one is the front door's):
    preferably its ``ValidatedPlan`` (not validated again); any other plan (a ``ShardInfo``, a
    path, a dict, a bound ``Plan``) is bound and validated here. The other arguments mean
    what ``shardload.load_sharded``'s do. The steps are in the module docstring.

    >>> with ThreadedSession(num_workers=4) as sess:                            # doctest: +SKIP
    ...     resolved = resolve_plan(ckpt, sess.num_workers)
    ...     sharded = load_validated(ckpt, resolved.validated, sess)
    """
    timeout = session.timeout if timeout is None else check_timeout(timeout)
    n = session.num_workers
    here = session.local_workers
    remote = len(here) < n and not session.spmd  # some workers run in other processes
    ranks = session.workers_in_view
    staged = staging_for(staging, session.devices)
    with contextlib.ExitStack() as stack:
        stack.enter_context(gc_paused())  # a load's objects are many and all kept
        with session.collective("preparing the load"):
            ckpt = as_checkpoint(params)  # 1.
            validated = validated_for(shard_info, n, ckpt)  # 2.
            chains = _distinct_chains(validated)
            _check_devices(chains, session.devices, validated.plan.source)
            modules = _plugin_modules(chains, remote, validated.plan.source)  # 3.
            source = stack.enter_context(_readable_elsewhere(ckpt, remote))
            plans: dict[int, ReadPlan] = dict(
                zip(ranks, build_read_plans(validated, source, ranks))
            )
            if reads is not None:
                plans = {i: reads(plan) for i, plan in plans.items()}
            plans, streams, sides = streams_for_load(source, plans, set(here), stack)
            _release_dropped(session)
        token, local = stack.enter_context(local_load(source, len(here), n))
        local.start(
            {i: plans[i] for i in here}, {i: side for i, side in sides.items() if i in here}
        )
        requests = _load_requests(token, plans, set(here), sides, modules, staged)
        shown = progress if session.reports else False
        # the bar's total: only a bar has one (a sum over every piece of every worker)
        total = sum(plan.nbytes for plan in plans.values()) if shown is True else 0
        advance, close_bar = progress_callback(shown, total)
        stack.callback(close_bar)
        if streams:
            _fetch_bar(streams, progress if session.reports else False, stack)
        start = time.perf_counter()
        for stream in streams:  # fetching from object storage while the workers read
            stream.start()
        try:
            replies = session.run(  # 4.
                LOAD_PIECES,
                requests,
                context=f"while loading {ckpt.source}",
                timeout=timeout,
                on_progress=advance,
            )
        except BaseException:
            _raise_fetch_error(streams)
            raise
        seconds = time.perf_counter() - start
        if session.spmd:  # each rank timed its own load; the load took the slowest's time
            seconds = max(r["seconds"] for r in replies)
        stats = LoadStats(
            seconds=seconds,
            num_shards=n,  # 5.
            bytes_per_worker=[r["bytes"] for r in replies],
            tensors_per_worker=[r["tensors"] for r in replies],
            bytes_read_per_worker=[r["bytes_read"] for r in replies],
            staging_per_worker=(None if staged is None else [r.get("staging") for r in replies]),
        )
        pieces = dict(local.shards)
    result = ShardedParams(
        [p.name for p in validated],
        list(session.devices),
        stats,  # 6.
        validated,
        _fetcher(session, token, pieces),
    )
    if remote:
        # the workers keep this load's pieces for as long as its result is referenced
        weakref.finalize(result, _dropped.setdefault(session, []).append, token)
    return result
