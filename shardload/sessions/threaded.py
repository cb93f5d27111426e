"""Workers as threads of this process: the simplest session, and the fastest on one host."""

from __future__ import annotations

import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from ..errors import WorkerError, WorkerFailure, describe
from .base import DeviceSpec, Session, resolve_devices


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
        self._closed = False
        self._lock = threading.Lock()

    def run_all(self, fn: Callable[[int], Any], *, context: str = "") -> list[Any]:
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
        failed = [o[1] for o in outcomes if not o[0]]
        if failed:
            failed.sort(key=lambda f: f[0])
            error = WorkerError([f[1] for f in failed], context)
            raise error from failed[0][2]
        return [o[1] for o in outcomes]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            w.shutdown(wait=True, cancel_futures=True)

    def __repr__(self) -> str:
        return f"ThreadedSession(num_workers={self.num_workers}, devices={self.devices})"
