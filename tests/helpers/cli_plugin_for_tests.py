"""Shard functions for ``tests/test_cli.py``, loaded with ``--plugin helpers.cli_plugin_for_tests``.

* ``tests.cli.boom``: always raises ``RuntimeError("boom at load")`` when it runs (exit 1 path).
* ``tests.cli.slow``: sleeps ``SLOW_SECONDS``, then splits evenly along ``dim`` (Ctrl-C path).
  When the environment variable ``SHARDLOAD_TEST_STARTED`` names a file, the first call creates
  it, so a test knows the load is under way before it sends SIGINT.

Import this module only under the name ``helpers.cli_plugin_for_tests``: importing it under a
second name would register the same names twice, with different function objects.
"""

from __future__ import annotations

import os
import time

import numpy as np

from shardload.registry import get_shard_func, register_shard_func

SLOW_SECONDS = 0.2
STARTED_ENV = "SHARDLOAD_TEST_STARTED"


# an even split along dim: the built-in split's shape rule, reused
SPLIT_RULE = get_shard_func("shardload.split").shape_rule


@register_shard_func("tests.cli.boom", array="numpy")
def boom(input, dim, output):
    """Raise RuntimeError at load time, whatever the input."""
    raise RuntimeError("boom at load")


@register_shard_func("tests.cli.slow", array="numpy", shape_rule=SPLIT_RULE)
def slow(input, dim, output):
    """Sleep a little, then split evenly along dim (a slow load for the Ctrl-C test)."""
    marker = os.environ.get(STARTED_ENV)
    if marker and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("started\n")
    time.sleep(SLOW_SECONDS)
    n = output.shape[0]
    output[...] = np.stack(np.split(input, n, axis=dim))
