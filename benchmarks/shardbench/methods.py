"""Every method the load benchmark compares, as one table (``METHODS``: name -> how it loads, its
kind, why it cannot run here), and the check that each ends with shardload's pieces.

``floor``              every kept byte copied once, from a memory map, by a pool of
                       ``os.cpu_count()`` single-threaded torch threads: the bound for a copier
``read-file``          the file read in order into one reused buffer: the bound from a cold
                       page cache (keeps nothing, so nothing is checked)
the peers              the real libraries (``peers.py``)
``disco-emulated``     an emulation of TVM Disco's pattern: worker 0 reads and splits every
                       tensor, each worker clones its piece from there
``shardload-thread``   ``load_sharded`` on a started ``ThreadedSession(N)``
``shardload-process``  ``load_sharded`` on a started ``ProcessSession(N)``

Every method runs on a ``Case``: what the methods share at one N (the plan, its ranges per
worker, the sessions, the thread pools), made before anything is timed. ``check_pieces``
compares a method's pieces with shardload's (``torch.equal``) outside the timing.

No method restricts N: the plan's validation does, for all of them, before anything runs.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardload import (
    ProcessSession,
    ShardInfo,
    ThreadedSession,
    dtypes,
    load_sharded,
    open_checkpoint,
)
from shardload.plan import ParamPlan, ValidatedPlan

from . import peers
from .checkpoints import MODEL_FILE, READ_BUFFER, bind_plan, read_header, read_whole
from .peers import direct_map, fixup, narrowed, owned


@dataclass
class Outcome:
    """What one run of a method produced; its ``workers`` or ``sharded`` keep the shards alive
    until it is dropped."""

    kept_per_worker: list[int]
    read_per_worker: list[int]
    workers: list[dict[str, torch.Tensor]] | None = None  # the pieces, where in this process
    sharded: Any = None  # a ShardedParams (shardload), checked through it
    loader_seconds: float | None = None
    moved: int | None = None  # bytes the GB/s figure counts, when not the kept bytes
    remote: bool = False  # the pieces are in worker processes (fetched to check)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def kept_bytes(workers: list[dict[str, torch.Tensor]]) -> list[int]:
    """The bytes each worker keeps."""
    return [sum(_nbytes(t) for t in w.values()) for w in workers]


def shardload_load(ckpt_dir: str, info: ShardInfo, session, **kwargs):
    """``load_sharded`` of the checkpoint on ``session``: shardload's ``ShardedParams``."""
    with open_checkpoint(ckpt_dir) as ckpt:
        return load_sharded(ckpt, info, session, progress=False, **kwargs)


def reference_pieces(ckpt_dir: str, info: ShardInfo, session) -> list[dict[str, torch.Tensor]]:
    """shardload's pieces on every worker: what every method must end with."""
    result = shardload_load(ckpt_dir, info, session)
    return [dict(result.worker(i)) for i in range(session.num_workers)]


@dataclass
class Case:
    """Everything the methods share for one N (made before anything is timed)."""

    ckpt_dir: str
    file: str
    info: ShardInfo
    plan: ValidatedPlan
    n: int
    direct: dict[str, Any]  # name -> (axis, ranges per worker) or None
    floor_bins: list[list[_Copy]]  # one list of copies per floor thread
    floor_pool: ThreadPoolExecutor
    worker_pool: ThreadPoolExecutor  # N threads: the peers' and disco-emulated's workers
    thread_session: ThreadedSession  # shardload-thread's, and the reference's
    process_session: ProcessSession | None
    zero_copy_get_tensor: bool
    file_tensor_bytes: int
    job: peers.Job
    read_buffer: bytearray
    reference: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def params(self) -> list[ParamPlan]:
        return list(self.plan)

    @classmethod
    def open(
        cls, ckpt_dir: str, info: ShardInfo, n: int, zero_copy: bool, process_session: bool
    ) -> tuple[Case, dict[str, float]]:
        """The case at ``n`` with its sessions started (a ``ProcessSession`` only where
        ``process_session``), and each session's start-up seconds."""
        file = os.path.join(ckpt_dir, MODEL_FILE)
        data_start, header = read_header(file)
        plan = bind_plan(ckpt_dir, info, n)
        direct = direct_map(plan, n)
        threads = os.cpu_count() or 1
        copies = floor_copies(plan, n, data_start, header, direct)
        startup = {}
        t0 = time.perf_counter()
        thread_session = ThreadedSession(n)
        startup["shardload-thread"] = time.perf_counter() - t0
        process = None
        if process_session:
            t0 = time.perf_counter()
            process = ProcessSession(n, plugins=["shardbench.worker"])
            startup["shardload-process"] = time.perf_counter() - t0
        worker_pool = ThreadPoolExecutor(n, "worker")
        read_buffer = bytearray(READ_BUFFER)
        np.frombuffer(read_buffer, dtype=np.uint8)[::4096] = 1  # its pages faulted in now
        case = cls(
            ckpt_dir,
            file,
            info,
            plan,
            n,
            direct,
            balance(copies, threads),
            single_threaded_pool(threads),
            worker_pool,
            thread_session,
            process,
            zero_copy,
            sum(p.meta.nbytes for p in plan),
            peers.Job(file, list(plan), n, direct, worker_pool, None, zero_copy),
            read_buffer,
        )
        return case, startup

    def close(self) -> None:
        self.reference = []
        self.floor_pool.shutdown()
        self.worker_pool.shutdown()
        for sess in (self.thread_session, self.process_session):
            if sess is not None:
                sess.close()


# ==== floor: one copy per kept byte, all cores =================================================


@dataclass
class _Copy:
    worker: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int  # the tensor's bytes in the file
    end: int
    nbytes: int  # bytes this worker keeps
    view: tuple | None  # (outer, size, inner, ranges) for split tensors
    offset: int = 0  # opaque chains: where to take the bytes from
    param: ParamPlan | None = None  # its fixup (split_rebase) runs on the copy
    n: int = 1


def floor_copies(
    plan: ValidatedPlan, n: int, data_start: int, header: dict, direct: dict[str, Any]
) -> list[_Copy]:
    copies = []
    for p in plan:
        begin, end = (data_start + o for o in header[p.name]["data_offsets"])
        itemsize = dtypes.itemsize(p.meta.dtype)
        for i in range(n):
            if p.replicated:
                copies.append(
                    _Copy(
                        i,
                        p.name,
                        p.meta.shape,
                        dtypes.to_torch(p.meta.dtype),
                        begin,
                        end,
                        end - begin,
                        None,
                    )
                )
                continue
            d = direct[p.name]
            shape, dtype = tuple(p.piece_shape), dtypes.to_torch(p.piece_dtype)
            if d is not None:
                axis, ranges = d
                outer = math.prod(p.meta.shape[:axis])
                inner = math.prod(p.meta.shape[axis + 1 :]) * itemsize
                view = (outer, p.meta.shape[axis], inner, ranges[i])
                copies.append(
                    _Copy(i, p.name, shape, dtype, begin, end, p.piece_nbytes, view, param=p, n=n)
                )
            else:  # an opaque chain: as many bytes as the piece, from the tensor's bytes
                size = end - begin
                offset = (i * p.piece_nbytes) % size if size else 0
                copies.append(
                    _Copy(i, p.name, shape, dtype, begin, end, p.piece_nbytes, None, offset)
                )
    return copies


def balance(copies: list[_Copy], bins: int) -> list[list[_Copy]]:
    """Longest-processing-time-first: each thread gets about the same number of bytes."""
    out: list[list[_Copy]] = [[] for _ in range(bins)]
    load = [0] * bins
    for c in sorted(copies, key=lambda c: -c.nbytes):
        k = load.index(min(load))
        out[k].append(c)
        load[k] += c.nbytes
    return out


def _do_copy(data: torch.Tensor, c: _Copy) -> torch.Tensor:
    out = torch.empty(c.shape, dtype=c.dtype)
    dst = out.view(-1).view(torch.uint8)
    src = data[c.begin : c.end]
    if c.view is None and c.nbytes == c.end - c.begin and c.offset == 0:
        dst.copy_(src)
    elif c.view is not None:
        outer, size, inner, ranges = c.view
        kept = sum(length for _, length in ranges)
        dst3, src3 = dst.view(outer, kept, inner), src.view(outer, size, inner)
        at = 0
        for start, length in ranges:
            dst3[:, at : at + length].copy_(src3[:, start : start + length])
            at += length
        if c.param is not None:
            fixup(c.param, out, c.worker, c.n)
    else:
        at, start, size = 0, c.offset, c.end - c.begin
        while at < c.nbytes:
            take = min(c.nbytes - at, size - start)
            dst[at : at + take].copy_(src[start : start + take])
            at, start = at + take, 0
    return out


def single_threaded_pool(threads: int) -> ThreadPoolExecutor:
    """``threads`` started threads whose torch ops run single-threaded: the parallelism is the
    pool's, one thread per core, with no intra-op (OpenMP) team per thread on top of it.

    torch's intra-op thread count is per thread (OpenMP), initialised from a process-wide value
    the first time a thread uses it; each pool thread sets its own to 1, then this thread puts
    the process-wide value back, so no other thread is affected.
    """
    before = torch.get_num_threads()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="floor")
    barrier = threading.Barrier(threads)

    def one_thread(_) -> None:
        torch.get_num_threads()  # this thread's lazy initialisation, done now
        torch.set_num_threads(1)
        barrier.wait()  # every pool thread takes exactly one of these

    try:
        list(pool.map(one_thread, range(threads)))
    finally:
        torch.set_num_threads(before)
    return pool


def _run_bin(data: torch.Tensor, copies: list[_Copy]) -> list[tuple[_Copy, torch.Tensor]]:
    return [(c, _do_copy(data, c)) for c in copies]


def run_floor(case: Case) -> Outcome:
    with open(case.file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))
    workers: list[dict[str, torch.Tensor]] = [{} for _ in range(case.n)]
    for done in case.floor_pool.map(functools.partial(_run_bin, data), case.floor_bins):
        for c, t in done:
            workers[c.worker][c.name] = t
    del data  # the last view of the map, so that it can be closed
    try:
        mapped.close()
    except BufferError:
        pass
    kept = kept_bytes(workers)
    return Outcome(kept, list(kept), workers)


# ==== read-file: the file's bytes, read in order ===============================================


def run_read_file(case: Case) -> Outcome:
    total = read_whole(case.file, case.read_buffer)
    return Outcome([0] * case.n, [total] + [0] * (case.n - 1), moved=total)


# ==== the real peers (peers.py) ================================================================


def _peer_runner(name: str) -> Callable[[Case], Outcome]:
    peer = peers.PEERS[name]

    def go(case: Case) -> Outcome:
        workers = peer.run(case.job)
        kept = kept_bytes(workers)
        if peer.reads_whole_file:  # one reader of the whole file, shown as worker 0
            read = [case.file_tensor_bytes] + [0] * (case.n - 1)
        else:  # each worker reads its own ranges
            read = list(kept)
        return Outcome(kept, read, workers)

    return go


# ==== disco-emulated: worker 0 reads and splits, every worker takes its piece ==================

_DONE = object()


def _views(p: ParamPlan, full: torch.Tensor, n: int, direct) -> list[torch.Tensor]:
    """Every worker's piece of ``full`` before its fixup: views where they are views."""
    if p.replicated:
        return [full] * n
    if direct is not None:
        axis, ranges = direct
        out = []
        for i in range(n):
            parts = narrowed(full, axis, ranges[i])
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis))
        return out
    done = peers.run_steps(p, full)
    return [done[i] for i in range(n)]


def run_disco(case: Case) -> Outcome:
    from safetensors import safe_open

    n = case.n
    inboxes = [queue.Queue(maxsize=2) for _ in range(n)]  # bounded: at most 2 tensors in flight

    def take(p: ParamPlan, split: torch.Tensor, i: int) -> torch.Tensor:
        if p.replicated:
            return owned(split)
        piece = owned(split[i])
        return fixup(p, piece, i, n) if case.direct[p.name] is not None else piece

    def worker0() -> dict[str, torch.Tensor]:
        kept: dict[str, torch.Tensor] = {}
        try:
            with safe_open(case.file, framework="pt") as f:
                for p in case.params:
                    full = f.get_tensor(p.name)
                    # rank 0 reads the whole tensor into its memory (safetensors 0.8 hands out a
                    # view of its mapping: the copy is made here)
                    full = full.clone() if case.zero_copy_get_tensor else full
                    if p.replicated:
                        split = full
                    else:  # the shard function's full output: N on axis 0
                        split = torch.stack(_views(p, full, n, case.direct[p.name]))
                    del full
                    for box in inboxes[1:]:
                        box.put((p, split))
                    kept[p.name] = take(p, split, 0)
                    del split
        finally:
            for box in inboxes[1:]:
                box.put(_DONE)
        return kept

    def worker(i: int) -> dict[str, torch.Tensor]:
        if i == 0:
            return worker0()
        kept: dict[str, torch.Tensor] = {}
        while True:
            item = inboxes[i].get()
            if item is _DONE:
                return kept
            p, split = item
            kept[p.name] = take(p, split, i)
            del split, item

    workers = list(case.worker_pool.map(worker, range(n)))
    return Outcome(kept_bytes(workers), [case.file_tensor_bytes] + [0] * (n - 1), workers)


# ==== shardload ================================================================================


def _run_shardload(case: Case, session) -> Outcome:
    result = shardload_load(case.ckpt_dir, case.info, session)
    s = result.stats
    return Outcome(
        list(s.bytes_per_worker),
        list(s.bytes_read_per_worker),
        sharded=result,
        loader_seconds=s.seconds,
        remote=session is case.process_session,
    )


def run_shardload_thread(case: Case) -> Outcome:
    return _run_shardload(case, case.thread_session)


def run_shardload_process(case: Case) -> Outcome:
    return _run_shardload(case, case.process_session)


# ==== the table ================================================================================


def _always_available(file: str) -> str | None:
    return None


@dataclass(frozen=True)
class Method:
    """One method compared. ``kind``: ``bound``, ``peer``, ``emulation`` or ``shardload``."""

    name: str
    kind: str
    run: Callable[[Case], Outcome]
    #: why it cannot run on the CPU with this file (not installed, refuses), or None
    unavailable: Callable[[str], str | None] = _always_available

    @property
    def may_fail(self) -> bool:
        """A real library failing mid-run is a finding about it (reported as skipped, the rest
        run on); any other method failing is a bug in the benchmark, and stops it."""
        return self.kind == "peer"


#: the methods, in table order
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("floor", "bound", run_floor),
        Method("read-file", "bound", run_read_file),
        *(
            Method(
                name, "peer", _peer_runner(name), functools.partial(peers.unavailable, name, "cpu")
            )
            for name in peers.PEERS
        ),
        Method("disco-emulated", "emulation", run_disco),
        Method("shardload-thread", "shardload", run_shardload_thread),
        Method("shardload-process", "shardload", run_shardload_process),
    )
}
SHARDLOAD = tuple(name for name, m in METHODS.items() if m.kind == "shardload")


# ==== the check: every piece equal to shardload's ==============================================


@dataclass
class Check:
    verified: bool | None  # None: not checked (read-file)
    owns: bool | None  # None: not known (pieces in other processes)
    detail: str


def check_pieces(reference: list[dict[str, torch.Tensor]], out: Outcome, n: int) -> Check:
    """``torch.equal`` of every piece against the reference, and whether each worker's tensors
    own their memory: no storage shared with another worker, none larger than the worker's
    kept bytes (a view of the file mapping or of a library's whole buffer would be)."""
    if out.workers is None and out.sharded is None:
        return Check(None, None, "not checked (keeps no pieces)")
    workers = out.workers
    if workers is None and not out.remote:
        workers = [out.sharded.worker(i) for i in range(n)]
    owners: dict[int, int] = {}
    owns = True
    for i in range(n):
        want = reference[i]
        if workers is not None and set(workers[i]) != set(want):
            extra, missing = set(workers[i]) - set(want), set(want) - set(workers[i])
            return Check(
                False,
                None,
                f"worker {i}: {len(missing)} piece(s) missing, "
                f"{len(extra)} extra (e.g. {sorted(missing | extra)[0]})",
            )
        limit = sum(_nbytes(t) for t in want.values())
        for name, ref in want.items():
            got = workers[i][name] if workers is not None else out.sharded.shard(name, i)
            if got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape):
                return Check(
                    False,
                    None,
                    f"worker {i} {name}: {got.dtype} {list(got.shape)}, "
                    f"shardload's {ref.dtype} {list(ref.shape)}",
                )
            if got.device != ref.device:
                got = got.to(ref.device)
            if not torch.equal(got, ref):
                return Check(False, None, f"worker {i} {name}: values differ from shardload's")
            if workers is not None and got.numel():
                st = got.untyped_storage()
                if owners.setdefault(st.data_ptr(), i) != i or st.nbytes() > limit:
                    owns = False
    return Check(
        True,
        None if workers is None else owns,
        "torch.equal, every piece"
        + (" (fetched from the worker processes)" if workers is None else ""),
    )
