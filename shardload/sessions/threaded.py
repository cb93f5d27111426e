"""Workers as threads of this process: the simplest session, and the fastest on one host."""

from __future__ import annotations

import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from ..errors import WorkerError, WorkerFailure, describe
from .base import DeviceSpec, Session, WorkerContext, resolve_devices


class ThreadedSession(Session):
    """N worker threads in this process, worker i on ``devices[i]``.

    Torch and numpy copies release the GIL, so workers read and copy in parallel.

    >>> with ThreadedSession(num_workers=2) as sess:
    ...     sess.run_all(lambda i: i * 10)
    [0, 10]
    """

    def __init__(self, num_workers: int, device: DeviceSpec = "cpu"):
        self.devices = resolve_devices(device, num_workers)
        self.num_workers = num_workers
        # One single-thread executor per worker, so each worker is one consistent thread
        # (a CUDA context and stream per worker, as a process per GPU would have).
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"shardload-worker-{i}")
                         for i in range(num_workers)]
        self._contexts = [WorkerContext(i, num_workers, d) for i, d in enumerate(self.devices)]
        self._closed = False
        self._lock = threading.Lock()

    def run_all(self, fn: Callable[[int], Any], *, context: str = "") -> list[Any]:
        """Run ``fn(i)`` on every worker thread; ``WorkerError`` naming each failed worker,
        the earliest failure first, once all have stopped."""
        if self._closed:
            raise RuntimeError("this session is closed")

        def on_worker(i: int):
            if self.devices[i].type == "cuda":
                torch.cuda.set_device(self.devices[i])
            try:
                return True, fn(i)
            except BaseException as exc:  # reported to the caller, never lost in a thread
                return False, (time.monotonic(), WorkerFailure(
                    i, type(exc).__name__, describe(exc), traceback.format_exc()), exc)

        futures = [w.submit(on_worker, i) for i, w in enumerate(self._workers)]
        outcomes = [f.result() for f in futures]
        failed = sorted((o[1] for o in outcomes if not o[0]), key=lambda f: f[0])
        if failed:
            raise WorkerError([f[1] for f in failed], context) from failed[0][2]
        return [o[1] for o in outcomes]

    def _load(self, ckpt, validated, progress):
        from ..loader import ShardedParams, load_in_threads, stats_of

        start = time.perf_counter()
        loads = load_in_threads(ckpt, validated, self.devices, self.run_all, progress)
        stats = stats_of(loads, time.perf_counter() - start)
        for ctx, load in zip(self._contexts, loads):
            ctx.shards = load.shards  # the latest load is the workers' model
        names = [p.name for p in validated]
        return ShardedParams(names, list(self.devices), stats, validated,
                             lambda name, i: loads[i].shards[name])

    def call(self, func_name: str, *args: Any) -> list[Any]:
        from ..registry import get_session_func
        from .protocol import to_jsonable

        func = get_session_func(func_name).func
        to_jsonable(list(args))  # the same args and results a ProcessSession can carry

        def on_worker(i: int) -> Any:
            result = func(self._contexts[i], *args)
            return result if isinstance(result, torch.Tensor) else to_jsonable(result)

        return self.run_all(on_worker, context=f"in {func_name}")

    def set_value(self, worker: int, name: str, value: Any) -> None:
        from .protocol import to_jsonable

        self._check_worker(worker)
        if not isinstance(value, torch.Tensor):
            to_jsonable(value)  # the same values a ProcessSession accepts
        else:
            value = value.to(self.devices[worker], copy=True)
        self._contexts[worker].values[name] = value

    def get_value(self, worker: int, name: str) -> Any:
        self._check_worker(worker)
        value = self._contexts[worker].values[name]
        return value.clone() if isinstance(value, torch.Tensor) else value

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            w.shutdown(wait=True, cancel_futures=True)

    def __repr__(self) -> str:
        return f"ThreadedSession(num_workers={self.num_workers}, devices={self.devices})"
