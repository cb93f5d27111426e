"""Worker processes of a ProcessSession, as the session tests check them: read from ``/proc``
(state and parent, command line, a fork server and its workers), waited for and killed by pid
after a failed test; a session of a test's own (``own_session``); and a load on a mixed plan
whose every shard is known (``sample_arrays``, ``MIXED_PLAN``, ``assert_shards``), with which
``still_works`` proves a session still usable. Linux only (``/proc``); the shard function
``tests.process.split`` and the session function ``tests.process.rank`` are
``helpers.process_plugins``'."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from shardload import load_sharded
from shardload.sessions import ProcessSession

WORKER_MODULE = "shardload.sessions.worker"
SERVER_MODULE = "shardload.sessions.forkserver"


def proc_stat(pid: int):
    """``(state, ppid)`` from ``/proc/<pid>/stat``; ``None`` once the process is reaped."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def proc_cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def is_server(pid: int) -> bool:
    return SERVER_MODULE in proc_cmdline(pid)


def is_worker(pid: int) -> bool:
    """A worker started as a fresh interpreter, or forked by a fork server (whose command line
    it shares: it is told from the server by its parent, the server)."""
    if WORKER_MODULE in proc_cmdline(pid):
        return True
    stat = proc_stat(pid)
    return stat is not None and is_server(pid) and is_server(stat[1])


def children_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[1] == parent:
                found.append(int(entry.name))
    return sorted(found)


def servers_of(controller: int) -> list[int]:
    """The fork servers the process ``controller`` started."""
    return [pid for pid in children_of(controller) if is_server(pid)]


def worker_children(controller: int) -> list[int]:
    """The ProcessSession workers of the process ``controller``: its children, or its fork
    server's."""
    parents = [controller, *servers_of(controller)]
    return sorted(pid for parent in parents for pid in children_of(parent) if is_worker(pid))


def wait_gone(pids, timeout: float) -> list[int]:
    """Poll until none of ``pids`` exists any more (a zombie still exists: it is gone only once
    reaped); the ones left after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if proc_stat(pid) is not None]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def describe(pids) -> str:
    return ", ".join(f"{pid}: {proc_stat(pid)} {' '.join(proc_cmdline(pid))}" for pid in pids)


def kill_all(pids) -> None:
    """Cleanup after a failed test: SIGKILL whatever of ``pids`` is still running, and reap the
    ones that are this process's children."""
    for pid in pids:
        stat = proc_stat(pid)
        if stat is not None and stat[0] not in "ZX":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2
    for pid in pids:
        stat = proc_stat(pid)
        if stat is None or stat[1] != os.getpid():
            continue
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.02)
                continue
            break


@contextlib.contextmanager
def own_session(num_workers: int = 2, **kwargs):
    """A ProcessSession of this test's own, closed and its workers killed whatever happens."""
    sess = ProcessSession(num_workers, **kwargs)
    pids = list(sess.pids)
    try:
        yield sess
    finally:
        sess.close()
        kill_all(pids)


# ---- data and plans ------------------------------------------------------------------------------


def step_entry(func: str, out_shape: list, dtype: str, *extra) -> list:
    return [[func, [out_shape, dtype], *extra]]


def split_entry(func: str, rows: int, cols: int, dtype: str) -> list:
    """A one-step plan entry splitting a (rows, cols) tensor along dim 0 with ``func``."""
    return step_entry(func, ["num_shards", f"{rows} // num_shards", cols], dtype, 0)


def sample_arrays() -> dict[str, np.ndarray]:
    return {
        "w": np.arange(48, dtype=np.float32).reshape(4, 12),
        "o": (np.arange(32, dtype=np.float16) / 4).reshape(4, 8),
        "b": np.arange(6, dtype=np.int32) - 3,
    }


MIXED_PLAN = {  # a built-in split, an opaque chain (split along dim 1), and "b" replicated
    "w": split_entry("shardload.split", 4, 12, "float32"),
    "o": step_entry("tests.process.split", ["num_shards", 4, "8 // num_shards"], "float16", 1),
}


def expected_shards(arrays: dict[str, np.ndarray], i: int, n: int) -> dict[str, np.ndarray]:
    return {
        "w": np.split(arrays["w"], n, axis=0)[i],
        "o": np.split(arrays["o"], n, axis=1)[i],
        "b": arrays["b"],
    }


def assert_shards(result, arrays, n: int) -> None:
    for i in range(n):
        for name, want in expected_shards(arrays, i, n).items():
            got = result.shard(name, i)
            assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
            assert got.dtype == torch.from_numpy(want).dtype, (name, i)
            np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{name} on worker {i}")


def still_works(session: ProcessSession) -> None:
    assert session.call("tests.process.rank") == list(range(session.num_workers))
    arrays = sample_arrays()
    result = load_sharded(arrays, MIXED_PLAN, session, progress=False)
    assert_shards(result, arrays, session.num_workers)
