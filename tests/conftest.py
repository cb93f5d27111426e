"""Shared fixtures: a clean registry per test, and small checkpoints on disk."""

from __future__ import annotations

import os
import signal

import pytest

from shardload import registry
from shardload.sessions import functions as session_functions

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
EXAMPLES = os.path.join(REPO, "examples")
EXAMPLE = os.path.join(EXAMPLES, "tiny_llama_q4")

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


def _shard_funcs() -> dict:
    return {f.name: f for f in registry.list_shard_funcs()}


def _session_funcs() -> dict:
    return {f.name: f for f in session_functions.list_session_funcs()}


def _shardloads_own(f) -> bool:
    """Registered by shardload's own modules, once, when they are first imported (which may be
    during a test): kept, as importing the module again would not register it again."""
    return f.module == "shardload" or f.module.startswith("shardload.")


@pytest.fixture(autouse=True)
def _restore_registry():
    """Functions a test registers (or unregisters) do not leak into the next test: both tables
    are put back as they were, through the registries' public API."""
    shard_before = _shard_funcs()  # listing loads the built-ins and entry points first
    session_before = _session_funcs()
    yield
    shard_after = _shard_funcs()
    for name in shard_after.keys() - shard_before.keys():
        if not _shardloads_own(shard_after[name]):
            registry.unregister_shard_func(name)
    for name, f in shard_before.items():
        if shard_after.get(name) != f:  # removed or replaced: register it again as it was
            registry.register_shard_func(name, f.func, override=True, array=f.array,
                                         shape_rule=f.shape_rule, ranges=f.ranges,
                                         fixup=f.fixup)
            assert registry.get_shard_func(name) == f, f"{name!r} was not restored as it was"
    session_after = _session_funcs()
    for name in session_after.keys() - session_before.keys():
        if not _shardloads_own(session_after[name]):
            session_functions.unregister_session_func(name)
    for name, f in session_before.items():
        if session_after.get(name) != f:
            session_functions.register_session_func(name, f.func, override=True)


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


# fixtures that hand a test the real model (tests/helpers/real_models.py downloads it once, 93 MB)
REAL_MODEL_FIXTURES = {"smollm2", "model_path"}


def pytest_collection_modifyitems(config, items):
    """Mark the tests that need the real model ``real_model``, so the fast subset can leave
    them out: ``pytest -m "not slow and not real_model"``."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
