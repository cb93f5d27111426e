"""Session functions for ``tests/test_sessions_forkserver.py``: what a worker process sees of
its start. Import it as ``helpers.startup_plugins`` only (see ``process_plugins``).

* ``tests.startup.seen(name)`` -> the worker's pid, parent pid, ``$name``, cwd, torch's
  intra-op threads, a draw from numpy's global random state, its threads (``/proc``).
* ``tests.startup.say(text)`` -> writes ``text`` and a newline to stdout and stderr.
* ``tests.startup.exit(code)`` -> ends the worker with exit code ``code`` (0: returns).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from shardload import register_session_func


@register_session_func("tests.startup.seen")
def seen(ctx, name):
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "value": os.environ.get(name),
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "random": float(np.random.random()),
        "tasks": len(os.listdir("/proc/self/task")),
    }


@register_session_func("tests.startup.say")
def say(ctx, text):
    # one write per stream: print() writes the text and its newline apart, and two workers'
    # halves may interleave
    for stream in (sys.stdout, sys.stderr):
        stream.write(text + "\n")
        stream.flush()


@register_session_func("tests.startup.exit")
def exit_with(ctx, code):
    if code:
        os._exit(code)
