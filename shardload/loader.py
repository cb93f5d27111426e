"""``load_sharded``: every worker ends up with its own piece of every parameter.

The loader runs one per-worker algorithm on every worker (SPMD). Worker ``i`` of ``N``, for each
parameter in storage order:

1. **Replicated** (no steps): read the whole tensor, place it on the worker's device.
2. **A built-in split** (one step of ``shardload.split``, ``split_segments`` or
   ``split_rebase``): ask the function which ranges worker ``i`` keeps and read only those
   bytes from the checkpoint, one copy into the worker's piece.
3. **Any other chain**: obtain the full output of the steps, keep ``output[i]``. Within one
   process the full output is computed once, by the first worker to need it, and shared; it is
   dropped as soon as all N workers have taken their piece, and at most ``MAX_SHARED`` such
   outputs are alive at once, which bounds staging memory to about two of the largest
   parameters. A worker process computes the chains it needs itself.

Every kept piece owns its memory. The plan is validated against the checkpoint's metadata
before any of this starts, so a bad plan fails before a byte of tensor data is read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from . import dtypes
from .errors import PlanError, ShardloadError, annotate
from .plan import ParamPlan, Plan, ShardInfo, ValidatedPlan
from .readers import Checkpoint, as_checkpoint
from .readers.base import copy_progress
from .registry import ShardFunc
from .sessions.base import Session, check_timeout
from .shard_functions import builtin

__all__ = ["load_sharded", "ShardedParams", "LoadStats", "WorkerLoad", "load_worker",
           "load_in_threads", "MAX_SHARED", "run_steps"]

#: opaque chains whose full output may be alive at once (the staging bound)
MAX_SHARED = 2

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

    @property
    def bytes_total(self) -> int:
        """Bytes of all kept shards, summed over workers."""
        return sum(self.bytes_per_worker)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "num_shards": self.num_shards,
                "bytes_total": self.bytes_total, "bytes_per_worker": self.bytes_per_worker,
                "tensors_per_worker": self.tensors_per_worker,
                "bytes_read_per_worker": self.bytes_read_per_worker}


class ShardedParams:
    """Every worker's shards after ``load_sharded``.

    With threads the shards are in this process and ``shard`` returns them; with worker
    processes they stay in the workers and ``shard`` fetches a copy; under torch.distributed a
    rank holds only its own.

    >>> sharded.shard("x_0", 2)        # worker 2's piece                  # doctest: +SKIP
    >>> sharded.worker(2)              # {name: tensor} of worker 2        # doctest: +SKIP
    """

    def __init__(self, names: list[str], devices: list[torch.device], stats: LoadStats,
                 plan: ValidatedPlan, fetch: Callable[[str, int], torch.Tensor]):
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
        """Worker ``worker``'s piece of parameter ``name``."""
        if type(worker) is not int or not 0 <= worker < self.num_shards:
            raise IndexError(f"worker {worker!r} out of range for {self.num_shards} workers")
        if name not in self._known:
            raise KeyError(f"no parameter named {name!r}")
        return self._fetch(name, worker)

    def worker(self, worker: int) -> dict[str, torch.Tensor]:
        """All of worker ``worker``'s tensors, by name."""
        return {name: self.shard(name, worker) for name in self.names}

    def __repr__(self) -> str:
        return (f"ShardedParams({len(self.names)} params on {self.num_shards} workers, "
                f"{self.stats.bytes_total} bytes)")


# ---- running a chain of steps ------------------------------------------------------------------

def _as_array(tensor: torch.Tensor, kind: str):
    if kind == "torch":
        return tensor
    if kind == "numpy":
        return tensor.numpy()  # zero-copy; CPU only
    import cupy  # optional dependency, only for cupy shard functions

    return cupy.from_dlpack(tensor)


def _call(func: ShardFunc, x: torch.Tensor, extra: tuple, out: torch.Tensor) -> None:
    if func.array == "numpy" and x.device.type != "cpu":
        x = x.cpu()
    if func.array == "numpy" and out.device.type != "cpu":
        host = torch.empty_like(out, device="cpu")
        func.func(_as_array(x, "numpy"), *extra, _as_array(host, "numpy"))
        out.copy_(host)
        return
    if func.array == "cupy" and (x.device.type != "cuda" or out.device.type != "cuda"):
        raise ShardloadError(f"{func.name} takes cupy arrays, which need a CUDA device; "
                             f"this worker's device is {out.device}")
    func.func(_as_array(x, func.array), *extra, _as_array(out, func.array))


def run_steps(param: ParamPlan, x: torch.Tensor) -> torch.Tensor:
    """Apply ``param``'s steps to its input ``x``; the last step's full output."""
    for step, func in zip(param.steps, param.funcs):
        out = torch.empty(step.out_shape, dtype=dtypes.to_torch(step.dtype), device=x.device)
        try:
            _call(func, x.contiguous(), step.extra, out)
        except Exception as exc:
            annotate(exc, f"parameter {param.name!r}, step {step.index} ({step.func})")
            raise
        x = out
    return x


# ---- per-worker pieces -------------------------------------------------------------------------

def direct_ranges(param: ParamPlan, num_shards: int):
    """(axis, ranges per worker) when ``param`` can be read piecewise, else ``None``."""
    if len(param.steps) != 1:
        return None
    step, name = param.steps[0], param.funcs[0].name
    shape = param.meta.shape
    if ((name == "shardload.split" and param.funcs[0].func is builtin.split)
            or (name == "shardload.split_rebase" and param.funcs[0].func is builtin.split_rebase)):
        return builtin.split_ranges(shape, step.extra[0], num_shards)
    if name == "shardload.split_segments" and param.funcs[0].func is builtin.split_segments:
        return builtin.segment_ranges(shape, step.extra[0], step.extra[1:], num_shards)
    return None


@dataclass
class _Cell:
    value: Optional[torch.Tensor] = None
    failed: bool = False
    ready: bool = False
    taken: int = 0


class _SharedOutputs:
    """Full outputs of opaque chains, computed once and shared by the workers of a process.

    The first worker to reach a parameter computes it; the others wait for it. A cell is dropped
    when all N workers have taken their piece, and a new one is opened only while fewer than
    ``MAX_SHARED`` are alive. No deadlock: a worker holds no cell while it waits for a slot, and
    only the worker furthest ahead ever opens one, so the workers behind it, who free the
    slots, never wait on it.
    """

    def __init__(self, num_workers: int, abort: threading.Event):
        self._n = num_workers
        self._abort = abort
        self._cond = threading.Condition()
        self._cells: dict[str, _Cell] = {}

    def take(self, param: ParamPlan, compute: Callable[[], torch.Tensor],
             waiting: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, bool]:
        """The full output for ``param`` and whether this call computed it. ``waiting()`` is
        called while this worker waits on another (for the watchdog: a worker waiting on a
        stuck one is not the one to blame)."""
        waiting = waiting or (lambda: None)
        with self._cond:
            while True:
                self._check_abort()
                cell = self._cells.get(param.name)
                if cell is not None or len(self._cells) < MAX_SHARED:
                    break
                waiting()
                self._cond.wait(0.1)
            owner = cell is None
            if owner:
                cell = self._cells[param.name] = _Cell()
        if owner:
            try:
                cell.value = compute()
            except BaseException:
                cell.failed = True
                raise
            finally:
                with self._cond:
                    cell.ready = True
                    self._cond.notify_all()
            return cell.value, True
        with self._cond:
            while not cell.ready:
                self._check_abort()
                waiting()
                self._cond.wait(0.1)
        if cell.failed:
            raise _Aborted()  # the owner reports the failure; this worker stops quietly
        return cell.value, False

    def release(self, param: ParamPlan) -> None:
        with self._cond:
            cell = self._cells.get(param.name)
            if cell is None:
                return
            cell.taken += 1
            if cell.taken == self._n:
                del self._cells[param.name]
                self._cond.notify_all()

    def _check_abort(self) -> None:
        if self._abort.is_set():
            raise _Aborted()


class _Aborted(ShardloadError):
    """Another worker failed or the load was interrupted; this worker stops quietly."""


def _place(tensor: torch.Tensor, device: torch.device, owned: bool) -> torch.Tensor:
    """``tensor`` on ``device``, owning its memory; no copy when it already does."""
    if tensor.device == device and owned and tensor.is_contiguous():
        return tensor
    if tensor.device == device:
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to(device, copy=True).contiguous()


def _worker_piece(ckpt: Checkpoint, param: ParamPlan, i: int, n: int, device: torch.device,
                  shared: _SharedOutputs, waiting: Optional[Callable[[], None]] = None
                  ) -> tuple[torch.Tensor, int]:
    """Worker i's piece of ``param`` on ``device``, and the checkpoint bytes it read."""
    if param.replicated:
        return _place(ckpt.read(param.name), device, owned=True), param.meta.nbytes
    direct = direct_ranges(param, n)
    if direct is not None:
        axis, ranges = direct
        piece = ckpt.read_ranges(param.name, axis, ranges[i])
        nread = piece.numel() * piece.element_size()
        if param.funcs[0].func is builtin.split_rebase:
            piece = builtin.rebase(piece)
        return _place(piece, device, owned=True), nread

    def compute() -> torch.Tensor:
        x = ckpt.read(param.name)
        if device.type != "cpu":
            x = x.to(device)
        return run_steps(param, x)

    try:
        full, computed = shared.take(param, compute, waiting)
        piece = _place(full[i], device, owned=False)
    finally:
        shared.release(param)
    return piece, param.meta.nbytes if computed else 0


# ---- the per-worker algorithm -------------------------------------------------------------------

@dataclass
class WorkerLoad:
    """What one worker kept, and the checkpoint bytes it read to get there."""

    shards: dict[str, torch.Tensor]
    bytes_read: int
    seconds: float

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shards.values())


def load_worker(ckpt: Checkpoint, plan: ValidatedPlan, rank: int, device: torch.device, *,
                shared: Optional[_SharedOutputs] = None, abort: Any = None,
                advance: Optional[ProgressCallback] = None,
                done: Optional[Callable[[str], None]] = None,
                on_param: Optional[Callable[[str], None]] = None) -> WorkerLoad:
    """Worker ``rank``'s piece of every parameter, in storage order: the SPMD algorithm.

    ``shared`` lets the workers of one process compute each opaque chain once; without it this
    worker computes the chains it needs itself. ``abort`` (anything with ``is_set()``) is
    checked between parameters. ``done(name)`` is called after each parameter; by default the
    checkpoint may then release what it read for it. ``on_param(name)`` is called as each
    parameter starts, and again while waiting on another worker's output: the progress a
    session's watchdog watches (a timestamp, and the parameter a stuck worker is on).
    """
    done = done if done is not None else ckpt.release
    abort = abort if abort is not None else threading.Event()
    shared = shared if shared is not None else _SharedOutputs(1, abort)
    start = time.perf_counter()
    kept: dict[str, torch.Tensor] = {}
    read = 0
    for param in plan:
        if abort.is_set():
            raise _Aborted()
        waiting = None
        if on_param is not None:
            on_param(param.name)
            waiting = lambda name=param.name: on_param(name)  # noqa: E731
        # a large tensor's copy reports progress too, so a slow read is not taken for a hang
        with copy_progress(waiting) if waiting is not None else contextlib.nullcontext():
            piece, nread = _worker_piece(ckpt, param, rank, plan.num_shards, device, shared,
                                         waiting)
        kept[param.name] = piece
        read += nread
        done(param.name)
        if advance is not None:
            advance(param.piece_nbytes)
    return WorkerLoad(kept, read, time.perf_counter() - start)


def load_in_threads(ckpt: Checkpoint, plan: ValidatedPlan, devices: list[torch.device],
                    run_all: Callable[..., list], progress: Union[bool, ProgressCallback],
                    beat: Optional[Callable[[int, str], None]] = None) -> list[WorkerLoad]:
    """Every worker's load, the workers being threads of this process (``run_all(fn)`` runs
    ``fn(i)`` on each); opaque chains computed once and shared. ``beat(i, name)`` records
    worker ``i``'s progress for the session's watchdog."""
    n = plan.num_shards
    advance, close_bar = progress_callback(progress, plan.bytes_per_worker() * n)
    abort = threading.Event()
    shared = _SharedOutputs(n, abort)
    finished: dict[str, int] = {}
    lock = threading.Lock()

    def done(name: str) -> None:
        # the mapped pages of a tensor go back once the last of the N workers has its piece
        with lock:
            finished[name] = count = finished.get(name, 0) + 1
        if count == n:
            ckpt.release(name)

    def work(i: int) -> Optional[WorkerLoad]:
        try:
            return load_worker(ckpt, plan, i, devices[i], shared=shared, abort=abort,
                               advance=advance, done=done,
                               on_param=None if beat is None else (lambda name: beat(i, name)))
        except _Aborted:
            return None  # another worker failed; it reports
        except BaseException:
            abort.set()
            raise

    try:
        return run_all(work, context=f"while loading {ckpt.source}")
    except BaseException:
        abort.set()  # Ctrl-C or a stalled worker: the others stop at their next parameter
        raise
    finally:
        close_bar()


def stats_of(loads: list[WorkerLoad], seconds: float) -> LoadStats:
    return LoadStats(seconds=seconds, num_shards=len(loads),
                     bytes_per_worker=[w.nbytes for w in loads],
                     tensors_per_worker=[len(w.shards) for w in loads],
                     bytes_read_per_worker=[w.bytes_read for w in loads])


# ---- the entry point ---------------------------------------------------------------------------

def _bind(shard_info: Any, num_shards: int) -> Plan:
    if isinstance(shard_info, Plan):
        if shard_info.num_shards != num_shards:
            raise PlanError(f"this plan is bound to num_shards={shard_info.num_shards}, but the "
                            f"session has {num_shards} workers", source=shard_info.source)
        return shard_info
    return ShardInfo.coerce(shard_info).bind(num_shards)


def _check_devices(plan: list[ParamPlan], devices: list[torch.device],
                   source: Optional[str]) -> None:
    """cupy shard functions need CUDA workers; say so before anything is read."""
    if all(d.type == "cuda" for d in devices):
        return
    for param in plan:
        for step, func in zip(param.steps, param.funcs):
            if func.array == "cupy":
                raise PlanError(f"{func.name} takes cupy arrays, which need CUDA devices, but "
                                f"this session's workers are on {', '.join(map(str, devices))}; "
                                "load with --device cuda", source=source, param=param.name,
                                step=step.index)


def progress_callback(progress: Union[bool, ProgressCallback], total: int):
    """A thread-safe ``advance(nbytes)`` and a ``close()``."""
    if callable(progress):
        return progress, lambda: None
    if not progress:
        return (lambda n: None), lambda: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
               leave=False, disable=None)  # None: no bar when stderr is not a terminal
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:
            bar.update(n)

    return advance, bar.close


def load_sharded(params: Any, shard_info: Any, session: Session, *,
                 progress: Union[bool, ProgressCallback] = True,
                 timeout: Optional[float] = None) -> ShardedParams:
    """Shard ``params`` by ``shard_info`` onto the workers of ``session``.

    ``params``: a ``Checkpoint`` (``open_checkpoint(path)``), a path, or a mapping of name ->
    numpy/torch array. ``shard_info``: a ``ShardInfo``, a path to ``shard_info.json``, a dict, a
    ``Plan`` bound to the session's N, or ``None`` (replicate everything). ``progress``: a tqdm
    bar over bytes (``True``), none (``False``), or a callback given each kept piece's bytes.
    ``timeout``: the watchdog for this load (default: the session's ``timeout``): a worker
    without progress for that many seconds fails the load with ``WorkerError`` naming it and
    the parameter it was on; the other workers are stopped and the session closed.

    1. Open the checkpoint: headers only.
    2. Bind the plan to the session's N and validate it against the checkpoint's metadata; a
       plan that does not fit fails here, before a byte of tensor data is read.
    3. The session runs the per-worker algorithm (``load_worker``) on each of its workers.

    >>> with ThreadedSession(num_workers=4) as sess:                            # doctest: +SKIP
    ...     sharded = load_sharded(open_checkpoint("ckpt/"), "ckpt/shard_info.json", sess)
    ...     sharded.shard("model.layers.0.mlp.down_proj.qweight", 3)
    """
    timeout = check_timeout(timeout)
    with session.collective("loading"):
        ckpt = as_checkpoint(params)
        validated = _bind(shard_info, session.num_workers).validate(ckpt.metadata())
        _check_devices(list(validated), session.devices, validated.plan.source)
        return session._load(ckpt, validated, progress, timeout)
