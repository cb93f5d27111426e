"""Subprocesses as the tests start them: the environment that lets a child import what the tests
import (``subprocess_env``), a torchrun job (``torchrun``), a CLI interrupted once its load is
under way (``interrupt_once_started``), and SIGINT as a terminal gives it (``default_sigint``)."""

from __future__ import annotations

import os
import signal

from helpers.paths import EXAMPLES, REPO, TESTS

#: what pyproject.toml's ``pythonpath`` puts on sys.path for the tests (the checkout; tests/, for
#: the package ``helpers``; examples/), for a subprocess's PYTHONPATH: see ``subprocess_env``
PYTHONPATH = (REPO, TESTS, EXAMPLES)


def subprocess_env(env: dict | None = None, **extra: str) -> dict:
    """``env`` (default: this process's environment) with ``PYTHONPATH`` led by the folders the
    tests import from, so a subprocess (the CLI, torchrun) can import ``helpers.*`` plugins, the
    examples and this checkout's shardload; then ``extra``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*PYTHONPATH, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def torchrun(*args: str, timeout: float = 120, nproc: int = 2):
    """A ``torchrun --standalone`` job of ``nproc`` ranks on loopback, run from the checkout with
    the tests' ``PYTHONPATH`` (and none of an enclosing job's rank variables)."""
    import subprocess
    import sys

    env = subprocess_env({k: v for k, v in os.environ.items()
                          if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                       "MASTER_PORT")})
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


def interrupt_once_started(args: list[str], started, env: dict, cwd: str = REPO
                           ) -> tuple[int, str, str, float]:
    """Run ``args``, wait until the file ``started`` exists (a plugin creates it when the load
    is under way), send one SIGINT, and return (exit code, stdout, stderr, seconds from the
    signal to the exit). The child is killed if it outlives the wait."""
    import subprocess
    import time

    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(started):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the load never started"
            time.sleep(0.02)
        time.sleep(0.3)
        assert proc.poll() is None, "the load finished before it could be interrupted"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=10)
        return proc.returncode, stdout, stderr, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def default_sigint() -> None:
    """``preexec_fn`` for a child that must see Ctrl-C: SIGINT as a terminal's shell gives it.

    An ignored SIGINT is inherited through exec (pytest run as a background job of a
    non-interactive shell has it), and Python then installs no KeyboardInterrupt handler.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
