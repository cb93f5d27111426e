"""Workers as threads of this process: the simplest session, and the fastest on one host.

Each worker is a daemon thread of its own (not a ``ThreadPoolExecutor``): a thread cannot be
killed, so one stuck in a shard function that never returns must never hold up the caller.
The caller waits in short polls, so Ctrl-C lands at once; the watchdog (``timeout=``) gives up
on a worker that makes no progress; and an abandoned thread, being a daemon, does not keep the
interpreter from exiting (``concurrent.futures`` joins its pool threads at exit, forever if one
hangs). After Ctrl-C or a timeout the session is closed: its threads finish their current job
(a load stops at its next parameter), or, if stuck, are left behind.

Threads share this process: a shard function that ends it (``os._exit``, a segfault) ends the
caller with it, and nothing can report it. ``ProcessSession`` isolates such functions.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ShardloadError, WorkerError, WorkerFailure, describe
from .base import (
    DEFAULT,
    DeviceSpec,
    Heartbeats,
    ProgressCallback,
    Session,
    Stopped,
    WorkerArgs,
    WorkerContext,
    args_for,
    check_timeout,
    resolve_devices,
    session_timeout,
)
from .functions import get_session_func
from .groups import ThreadGroup
from .protocol import to_jsonable

#: seconds between the caller's checks for results, Ctrl-C and stalled workers
POLL_S = 0.05
#: seconds ``close`` waits for worker threads to finish what they are doing
CLOSE_WAIT_S = 5.0
#: worker threads are named with this prefix (the CLI looks for abandoned ones at exit)
THREAD_PREFIX = "shardload-worker-"

_DEFAULT: Any = DEFAULT
_STOPPED: Any = object()  # a worker that stopped because another failed


class _WorkerThread:
    """One worker: a daemon thread running the jobs put in its queue, ``None`` ending it."""

    def __init__(self, index: int):
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._serve, name=f"{THREAD_PREFIX}{index}", daemon=True
        )
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()
            job = None  # an idle thread holds nothing of its session (which may be collected)


def _stop_threads(jobs: list) -> None:
    """Ask worker threads to end (a session collected without ``close()``)."""
    for queue_ in jobs:
        queue_.put(None)


def abandoned_threads() -> list[threading.Thread]:
    """Worker threads still alive although their session was closed (stuck in a shard
    function, or finishing one after Ctrl-C)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(THREAD_PREFIX) and getattr(t, "_shardload_abandoned", False)
    ]


class ThreadedSession(Session):
    """N worker threads in this process, worker i on ``devices[i]``.

    Torch and numpy copies release the GIL, so workers read and copy in parallel.
    ``timeout``: seconds a worker may go without progress (a parameter loaded, a call
    answered) before the session gives up on it: ``WorkerError`` naming the worker and its
    parameter, the other workers stopped, the session closed. Left out, the default watchdog
    (``DEFAULT_TIMEOUT_S``, 10 minutes, or ``$SHARDLOAD_TIMEOUT``); ``None``, no watchdog. A
    stuck thread cannot be killed; it is abandoned (a daemon thread: the interpreter can still
    exit).

    Threads share this process: a shard function that calls ``os._exit`` or crashes the
    interpreter ends the caller too. ``ProcessSession`` isolates untrusted shard functions.

    >>> with ThreadedSession(num_workers=2) as sess:
    ...     sess.run_all(lambda i: i * 10)
    [0, 10]
    >>> from shardload import register_session_func
    >>> @register_session_func("example.plus_rank")
    ... def plus_rank(ctx, x):
    ...     return x + ctx.rank
    >>> with ThreadedSession(num_workers=2) as sess:             # per-worker args
    ...     sess.run("example.plus_rank", [(10,), (20,)])
    [10, 21]
    """

    def __init__(
        self, num_workers: int, device: DeviceSpec = "cpu", *, timeout: float | None = _DEFAULT
    ):
        self.devices = resolve_devices(device, num_workers)
        self.num_workers = num_workers
        self.timeout = session_timeout(timeout)
        self._group = ThreadGroup(num_workers)
        self._contexts = [
            WorkerContext(i, num_workers, d, group=self._group.member(i))
            for i, d in enumerate(self.devices)
        ]
        self._closed = False
        self._broken = False  # interrupted or timed out: threads may still be busy
        self._lock = threading.Lock()
        self._beats: Heartbeats | None = None
        # One thread per worker, so each worker is one consistent thread (a CUDA context and
        # stream per worker, as a process per GPU would have).
        self._threads: list[_WorkerThread] = []
        try:
            for i in range(num_workers):
                self._threads.append(_WorkerThread(i))
        except BaseException:  # e.g. a limit on threads at large N: stop those started
            _stop_threads([w.jobs for w in self._threads])
            raise
        weakref.finalize(self, _stop_threads, [w.jobs for w in self._threads])

    @property
    def local_workers(self) -> list[int]:
        return list(range(self.num_workers))

    def beat(self, worker: int, where: str | None = None) -> None:
        """Worker ``worker`` made progress (while ``run_all`` waits: for the watchdog)."""
        beats = self._beats
        if beats is not None:
            beats.beat(worker, where)

    def run_all(
        self,
        fn: Callable[[int], Any],
        *,
        context: str = "",
        timeout: float | None = _DEFAULT,
        workers: Sequence[int] | None = None,
    ) -> list[Any]:
        """Run ``fn(i)`` on the thread of every worker ``i`` of ``workers`` (default: all);
        ``WorkerError`` naming each failed worker, the earliest failure first, once all have
        stopped.

        A worker silent for ``timeout`` seconds (default: the session's), or Ctrl-C, ends the
        wait at once: the session is closed and busy threads are left to stop on their own.
        """
        self._check_open()
        workers = self._workers(workers)
        timeout = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        results: queue.SimpleQueue[tuple[int, bool, Any]] = queue.SimpleQueue()
        beats = self._beats = Heartbeats(self.num_workers, workers)

        def on_worker(i: int) -> None:
            try:
                if self.devices[i].type == "cuda":
                    torch.cuda.set_device(self.devices[i])
                results.put((i, True, fn(i)))
            except BaseException as exc:  # noqa: BLE001 - reported to the caller, never lost
                results.put(
                    (
                        i,
                        False,
                        (
                            time.monotonic(),
                            WorkerFailure(
                                i, type(exc).__name__, describe(exc), traceback.format_exc()
                            ),
                            exc,
                        ),
                    )
                )

        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            # queued inside the try: a Ctrl-C between two puts still closes the session
            for i in workers:
                self._threads[i].jobs.put(functools.partial(on_worker, i))
            while len(outcomes) < len(workers):
                try:
                    i, ok, value = results.get(timeout=POLL_S)
                except queue.Empty:
                    stalled = beats.stalled(timeout)
                    if stalled and timeout is not None:
                        raise self._stalled(stalled, beats, timeout, context, outcomes) from None
                    continue
                outcomes[i] = (ok, value)
                beats.done(i)
        except BaseException:
            # Ctrl-C or a stalled worker: the caller must get control back now, whatever the
            # threads are doing; they cannot be interrupted, so the session ends here.
            self._broken = True
            self.close()
            raise
        finally:
            self._beats = None
        failed = sorted((v for ok, v in outcomes.values() if not ok), key=lambda f: f[0])
        if failed:
            raise WorkerError([f[1] for f in failed], context) from failed[0][2]
        return [outcomes[i][1] for i in workers]

    def run(
        self,
        func_name: str,
        args: WorkerArgs,
        *,
        workers: Sequence[int] | None = None,
        context: str = "",
        timeout: float | None = _DEFAULT,
        on_progress: ProgressCallback | None = None,
    ) -> list[Any]:
        func = get_session_func(func_name).func
        workers = self._workers(workers)
        # the same args and results a ProcessSession can carry, so code moves between them
        per = {i: to_jsonable(a) for i, a in args_for(args, workers).items()}
        stop = threading.Event()
        self._group.mend()  # a failure in an earlier run broke its barrier

        def progress(i: int, nbytes: int, where: str | None) -> None:
            self.beat(i, where)
            if nbytes and on_progress is not None:
                on_progress(nbytes)

        def on_worker(i: int) -> Any:
            ctx = self._contexts[i]
            with ctx.hooks(lambda n, w: progress(i, n, w), stop.is_set):
                try:
                    result = func(ctx, *per[i])
                except Stopped:
                    if stop.is_set():
                        return _STOPPED  # another worker failed; it reports
                    raise
                except BaseException:
                    stop.set()
                    self._group.abort()  # workers waiting in a collective stop too
                    raise
            return result if isinstance(result, torch.Tensor) else to_jsonable(result)

        try:
            results = self.run_all(
                on_worker, context=context or f"in {func_name}", timeout=timeout, workers=workers
            )
        except BaseException:
            stop.set()  # Ctrl-C or a stalled worker: the others stop at their next check
            self._group.abort()
            raise
        if any(r is _STOPPED for r in results):  # cannot happen without a failure reported
            raise ShardloadError(
                f"a worker stopped {context or f'in {func_name}'} without a failure to report"
            )
        return results

    def _stalled(
        self, stalled: list[int], beats: Heartbeats, timeout: float, context: str, outcomes: dict
    ) -> WorkerError:
        """The stalled workers' ``WorkerError``, after the failures already in: a worker that
        raised is often why another waits for ever (a barrier), so it is reported first."""
        earlier = sorted((v for ok, v in outcomes.values() if not ok), key=lambda f: f[0])
        frames = sys._current_frames()  # where each stuck thread is: its "remote" traceback
        failures = [f[1] for f in earlier]
        for i in stalled:
            ident = self._threads[i].thread.ident  # None: never started
            frame = frames.get(ident) if ident is not None else None
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
            failures.append(
                WorkerFailure(
                    i,
                    "TimeoutError",
                    f"{beats.describe(i, timeout)}; its thread is abandoned "
                    "(a thread cannot be stopped) and the session closed",
                    f"Stack of worker {i}'s thread:\n{stack}",
                )
            )
        return WorkerError(failures, context)

    def set_value(self, worker: int, name: str, value: Any) -> None:
        self._check_open()
        self._check_worker(worker)
        if not isinstance(value, torch.Tensor):
            to_jsonable(value)  # the same values a ProcessSession accepts
        else:
            value = value.to(self.devices[worker], copy=True)
        self._contexts[worker].values[name] = value

    def get_value(self, worker: int, name: str) -> Any:
        self._check_open()
        self._check_worker(worker)
        value = self._contexts[worker].values[name]
        return value.clone() if isinstance(value, torch.Tensor) else value

    def close(self) -> None:
        """Stop the worker threads: each ends after its current job. Waits for them (a few
        seconds at most), except after Ctrl-C or a timeout, when nobody waits on a thread that
        may never return."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for worker in self._threads:
            worker.jobs.put(None)
        deadline = time.monotonic() + (0.0 if self._broken else CLOSE_WAIT_S)
        for worker in self._threads:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
            if worker.thread.is_alive():
                worker.thread._shardload_abandoned = True  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"ThreadedSession(num_workers={self.num_workers}, devices={self.devices})"
