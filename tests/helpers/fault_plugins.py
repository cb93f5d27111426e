"""Shard and session functions that misbehave, for ``tests/test_faults.py``.

Imported as ``helpers.fault_plugins`` (``tests/`` is on ``sys.path`` under pytest; subprocesses
get it on ``PYTHONPATH``); import it under that name only, or its names would be registered
twice with different function objects. Shard functions are numpy, ``func(input, dim, output)``,
and split evenly along ``dim`` when they return at all.

* ``tests.faults.split``: just the split.
* ``tests.faults.hang``: never returns. In this process it waits on the ``RELEASE`` event of
  the moment it started, so a test can let an abandoned thread go; elsewhere nobody sets it.
  The first call creates the file named by ``SHARDLOAD_TEST_FAULT_STARTED``, if set.
* ``tests.faults.hang_on_1``: on worker process 1 (``SHARDLOAD_RANK``), ignores SIGTERM and
  never returns (only SIGKILL ends it); splits elsewhere.
* ``tests.faults.stop_on_1``: on worker process 1, stops its own process (SIGSTOP) after a
  moment (so its progress message names the parameter first); splits elsewhere.
* ``tests.faults.slow``: sleeps ``SLOW_SECONDS``, then splits (marks the start like ``hang``).
* ``tests.faults.segfault``: crashes the interpreter (reads address 0).

Session functions: ``tests.faults.hang_call`` never returns (waits on ``RELEASE`` as above).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import numpy as np

from shardload import register_session_func
from shardload.registry import get_shard_func, register_shard_func

STARTED_ENV = "SHARDLOAD_TEST_FAULT_STARTED"
SLOW_SECONDS = 0.2

#: set by a test to let the threads stuck in ``hang`` (started while it was current) go
RELEASE = threading.Event()

SPLIT_RULE = get_shard_func("shardload.split").shape_rule


def _split_into(input, dim, output) -> None:
    output[...] = np.stack(np.split(input, output.shape[0], axis=dim))


def _mark_started() -> None:
    marker = os.environ.get(STARTED_ENV)
    if marker and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"{os.getpid()}\n")


def _wait_forever() -> None:
    release = RELEASE  # the event of the moment this call started
    while not release.wait(0.5):
        pass


@register_shard_func("tests.faults.split", array="numpy", shape_rule=SPLIT_RULE)
def split(input, dim, output):
    """Split evenly along dim."""
    _split_into(input, dim, output)


@register_shard_func("tests.faults.hang", array="numpy", shape_rule=SPLIT_RULE)
def hang(input, dim, output):
    """Never return (until this process's RELEASE event is set)."""
    _mark_started()
    _wait_forever()
    _split_into(input, dim, output)


@register_shard_func("tests.faults.hang_on_1", array="numpy", shape_rule=SPLIT_RULE)
def hang_on_1(input, dim, output):
    """On worker process 1: ignore SIGTERM and never return. Elsewhere: split."""
    if os.environ.get("SHARDLOAD_RANK") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    _split_into(input, dim, output)


@register_shard_func("tests.faults.stop_on_1", array="numpy", shape_rule=SPLIT_RULE)
def stop_on_1(input, dim, output):
    """On worker process 1: SIGSTOP this process. Elsewhere: split."""
    if os.environ.get("SHARDLOAD_RANK") == "1":
        time.sleep(0.5)  # long enough for the progress message naming this parameter
        os.kill(os.getpid(), signal.SIGSTOP)
    _split_into(input, dim, output)


@register_shard_func("tests.faults.slow", array="numpy", shape_rule=SPLIT_RULE)
def slow(input, dim, output):
    """Sleep SLOW_SECONDS, then split."""
    _mark_started()
    time.sleep(SLOW_SECONDS)
    _split_into(input, dim, output)


@register_shard_func("tests.faults.segfault", array="numpy", shape_rule=SPLIT_RULE)
def segfault(input, dim, output):
    """Crash the interpreter."""
    ctypes.string_at(0)


@register_session_func("tests.faults.hang_call")
def hang_call(ctx):
    _wait_forever()
    return ctx.rank


@register_session_func("tests.faults.raise_on_0_others_wait")
def raise_on_0_others_wait(ctx):
    """Worker 0 raises; the others wait for ever, as peers of a failed collective would."""
    if ctx.rank == 0:
        raise ValueError("worker 0 broke the barrier")
    _wait_forever()
