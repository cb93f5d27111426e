"""Shard functions for tests/test_staging.py, importable by worker processes
(``helpers.staging_plugins``).

* ``tests.staging.rows``: worker i keeps the i-th of N row blocks, read by its ranges; its fixup
  runs on the pipeline's link after the piece's copies. In this process the fixup waits while
  ``GATE`` is clear (a test holds the link busy with it), counts its calls in ``CALLS``, and
  raises once ``FAIL_AFTER`` calls have been made (``None``: never); ``SLOW_SECONDS`` makes each
  call sleep (a load long enough to interrupt; the first call creates the file named by
  ``SHARDLOAD_TEST_STAGING_STARTED``). Worker processes see the defaults: it adds 1.
* ``tests.staging.twice``: a chain step without a ranges rule (computed whole, on the device):
  doubles its input.
"""

from __future__ import annotations

import os
import threading
import time

from helpers.readplan_plugins import _rule  # N equal row blocks: the same shape rule
from shardload import Selection, register_shard_func

STARTED_ENV = "SHARDLOAD_TEST_STAGING_STARTED"
GATE = threading.Event()
GATE.set()
CALLS = [0]
FAIL_AFTER: list = [None]
SLOW_SECONDS = [0.0]


def _ranges(in_shape, in_dtype, *, num_shards, index):
    rows = in_shape[0] // num_shards
    return Selection(0, ((index * rows, rows),))


def _add_one(piece, *, num_shards, index):
    marker = os.environ.get(STARTED_ENV)
    if marker and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("started\n")
    GATE.wait()
    if SLOW_SECONDS[0]:
        time.sleep(SLOW_SECONDS[0])
    CALLS[0] += 1
    if FAIL_AFTER[0] is not None and CALLS[0] > FAIL_AFTER[0]:
        raise RuntimeError("tests.staging.rows: failing on purpose")
    piece.add_(1)


@register_shard_func("tests.staging.rows", shape_rule=_rule, ranges=_ranges, fixup=_add_one)
def rows(input, output):
    """Worker i: the i-th row block, plus one."""
    output.copy_(input.reshape(output.shape) + 1)


def _same(in_shape, in_dtype, *, num_shards):
    return tuple(in_shape), in_dtype


@register_shard_func("tests.staging.twice", shape_rule=_same)
def twice(input, output):
    output.copy_(input * 2)
