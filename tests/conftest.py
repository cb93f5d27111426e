"""Shared fixtures: a clean registry per test, and small checkpoints on disk."""

from __future__ import annotations

import os
import signal

import pytest

from shardload import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "tiny_llama_q4")


@pytest.fixture(autouse=True)
def _restore_registry():
    """Functions a test registers do not leak into the next test."""
    registry.list_shard_funcs()  # make sure built-ins and entry points are in before the snapshot
    before = dict(registry._registry), dict(registry._session_registry)
    yield
    with registry._lock:
        for table, saved in zip((registry._registry, registry._session_registry), before):
            table.clear()
            table.update(saved)


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


# fixtures that hand a test the real model (tests/real_models.py downloads it once, 93 MB)
REAL_MODEL_FIXTURES = {"smollm2", "model_path"}


def pytest_collection_modifyitems(config, items):
    """Mark the tests that need the real model ``real_model``, so the fast subset can leave
    them out: ``pytest -m "not slow and not real_model"``."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
