"""How the load benchmark measures one method: wall time, CPU seconds (its own and the rest of
the machine's), the peak RSS of the process tree, sampled; the page cache, warmed, or dropped
before a cold run (``drop_caches``, else ``posix_fadvise``) with ``mincore`` saying whether the
drop happened; and the freeing of every shard between two methods, so that none counts in the
next one's memory."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import MiB
from .checkpoints import READ_BUFFER, read_whole
from .methods import METHODS, Case, Check, check_pieces
from .worker import DROP_SHARDS, malloc_trim

SAMPLE_INTERVAL_S = 0.01
#: a drop counts as done when at most this share of the file's pages is still resident
COLD_RESIDENT_MAX = 0.05


# ==== memory: peak RSS of the process tree =====================================================


def _proc_rss(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of ``pid`` in bytes; zeros for a process that is gone."""
    rss = anon = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return rss, anon


class RssSampler:
    """Samples the summed VmRSS / RssAnon of this process and ``pids`` every 10 ms in a
    background thread; ``begin()`` and ``end()`` bracket one measured method."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S):
        self.interval = interval
        self.pids: list[int] = []
        self._lock = threading.Lock()
        self._active = False
        self._peak = (0, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def read(self) -> tuple[int, int]:
        rss = anon = 0
        for pid in [os.getpid(), *self.pids]:
            r, a = _proc_rss(pid)
            rss, anon = rss + r, anon + a
        return rss, anon

    def _update(self, sample: tuple[int, int]) -> None:
        with self._lock:
            self._peak = (max(self._peak[0], sample[0]), max(self._peak[1], sample[1]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._active:
                self._update(self.read())

    def begin(self) -> tuple[int, int]:
        base = self.read()
        with self._lock:
            self._peak = base
            self._active = True
        return base

    def end(self) -> tuple[int, int]:
        self._update(self.read())  # the end state, with every shard alive
        with self._lock:
            self._active = False
            return self._peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# ==== CPU time ==================================================================================


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all CPUs, steal included) since boot."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is in user already


def _own_cpu_s(pids: list[int]) -> float:
    """CPU seconds used by this process (all threads) and ``pids``."""
    t = os.times()
    total = t.user + t.system
    tck = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tck
        except (OSError, ValueError, IndexError):
            pass
    return total


class Window:
    """One measured call, as ``with Window(sampler, pids) as w: ...``: its wall ``seconds``,
    the process tree's RSS ``base`` just before and ``peak`` during it (``sampler``), the CPU
    seconds of this process and ``pids`` (``cpu_s``) and of everything else on the machine
    meanwhile (``other_cpu_s``). Everything but the call is read outside the timed span."""

    def __init__(self, sampler: RssSampler, pids: list[int]):
        self.sampler, self.pids = sampler, pids

    def __enter__(self) -> Window:
        self.base = self.sampler.begin()
        self._busy, self._own = _busy_cpu_s(), _own_cpu_s(self.pids)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
        busy, own = _busy_cpu_s(), _own_cpu_s(self.pids)
        self.peak = self.sampler.end()
        self.cpu_s = own - self._own
        self.other_cpu_s = max(0.0, (busy - self._busy) - self.cpu_s)


# ==== the page cache: warming it, dropping it, and checking that it was dropped ===============


def warm_page_cache(path: str) -> float:
    """Read ``path`` once, so that it is in the page cache; the seconds that took."""
    start = time.perf_counter()
    read_whole(path, bytearray(READ_BUFFER))
    return time.perf_counter() - start


def _meminfo_cached() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_fraction(path: str) -> float | None:
    """The share of ``path``'s pages in the page cache (``mincore`` on a fresh shared mapping,
    which touches nothing), or None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        c_mmap, c_mincore, c_munmap = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    c_mmap.restype = ctypes.c_void_p
    c_mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    c_mincore.restype = ctypes.c_int
    c_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    c_munmap.restype = ctypes.c_int
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = c_mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if c_mincore(addr, size, vec) != 0:
                return None
            return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) / pages
        finally:
            c_munmap(addr, size)
    finally:
        os.close(fd)


class PageCache:
    """Drops ``file`` from the page cache: ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root),
    and ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file (no root needed; clean pages only);
    then says whether it worked: the file's resident share by ``mincore``, else whether
    /proc/meminfo's Cached fell below a fifth of the file's size."""

    def __init__(self, file: str, drop_caches: bool = True):
        self.file = file
        self.size = os.path.getsize(file)
        self.drop_caches = drop_caches  # False: posix_fadvise only (this file, no side effects)

    def drop(self) -> dict:
        before, cached0 = resident_fraction(self.file), _meminfo_cached()
        how, errors = [], []
        if self.drop_caches:
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
                how.append("drop_caches")
            except OSError as exc:
                errors.append(f"drop_caches: {exc.strerror or exc}")
        try:
            fd = os.open(self.file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                how.append("fadvise")
            finally:
                os.close(fd)
        except (OSError, AttributeError) as exc:
            errors.append(f"posix_fadvise: {exc}")
        after, cached1 = resident_fraction(self.file), _meminfo_cached()
        if after is not None:
            dropped: bool | None = after <= COLD_RESIDENT_MAX
            evidence = f"{100 * after:.1f}% of the file resident after the drop (mincore)"
        elif cached1 is not None and cached1 < 0.2 * self.size:
            dropped, evidence = True, f"Cached {cached1 / MiB:.0f} MiB < a fifth of the file"
        else:
            dropped, evidence = None, "cannot tell (no mincore; Cached did not say)"
        return {
            "how": "+".join(how) or None,
            "errors": errors,
            "resident_before": before,
            "resident_after": after,
            "cached_before": cached0,
            "cached_after": cached1,
            "dropped": dropped,
            "evidence": evidence,
        }


def cold_mode_check(file: str, how: str, log) -> tuple[PageCache | None, str | None, dict]:
    """A trial drop: (the cache dropper, None, the trial) where cold runs make sense, else
    (None, why, the trial)."""
    cache = PageCache(file, drop_caches=how == "auto")
    warm_page_cache(file)
    trial = cache.drop()
    warm_page_cache(file)
    if trial["how"] is None:
        return None, "; ".join(trial["errors"]) or "no way to drop the page cache", trial
    if trial["dropped"] is False:
        return (
            None,
            (
                f"{trial['evidence']} after {trial['how']} (a tmpfs or an overlay that "
                f"keeps its pages?)"
                + (f"; {'; '.join(trial['errors'])}" if trial["errors"] else "")
            ),
            trial,
        )
    log(f"cold mode: {trial['how']}; {trial['evidence']}")
    return cache, None, trial


# ==== one measured run of a method ==============================================================


def free_memory(*sessions, cuda: bool = False) -> None:
    """Drop the shards ``sessions`` still hold and hand freed memory back to the OS (and
    CUDA's cached blocks to the driver, with ``cuda``)."""
    gc.collect()
    for sess in sessions:
        if sess is not None:
            sess.call(DROP_SHARDS)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    malloc_trim()


@dataclass
class Run:
    seconds: float
    base: tuple[int, int]
    peak: tuple[int, int]
    kept: list[int]
    read: list[int]
    loader_seconds: float | None
    cpu_s: float = 0.0  # CPU time of this process tree during the method
    other_cpu_s: float = 0.0  # CPU time of everything else on the machine meanwhile
    moved: int | None = None
    check: Check | None = None
    drop: dict | None = None  # cold runs: what the drop before it did
    error: str | None = None  # a peer that failed: why


def measure(
    case: Case, method: str, sampler: RssSampler, cache: PageCache | None, check: bool
) -> Run:
    """One run of ``method`` on ``case``: the cache dropped first where ``cache`` is given, its
    pieces checked afterwards where ``check``; everything freed before and after."""
    sessions = (case.thread_session, case.process_session)
    free_memory(*sessions)
    drop = cache.drop() if cache is not None else None
    m = METHODS[method]
    window = Window(sampler, list(sampler.pids))
    error = None
    try:
        with window:
            outcome = m.run(case)
    except Exception as exc:
        if not m.may_fail:
            raise
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:  # freed here, where the traceback no longer holds the peer's tensors
        free_memory(*sessions)
        return Run(window.seconds, window.base, window.peak, [], [], None, error=error, drop=drop)
    result = None
    if check:  # outside the timing and the memory window
        result = check_pieces(case.reference, outcome, case.n)
    run = Run(
        window.seconds,
        window.base,
        window.peak,
        outcome.kept_per_worker,
        outcome.read_per_worker,
        outcome.loader_seconds,
        window.cpu_s,
        window.other_cpu_s,
        outcome.moved,
        result,
        drop,
    )
    del outcome  # the shards: freed before the next method starts
    free_memory(*sessions)
    return run
