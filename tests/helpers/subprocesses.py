"""Subprocesses as the tests start them: the environment that lets a child import what the tests
import (``subprocess_env``), a torchrun job (``torchrun``), one job from several torchrun
launchers as on several machines (``torchrun_nodes``), a CLI interrupted once its load is under
way (``interrupt_once_started``), and SIGINT as a terminal gives it (``default_sigint``)."""

from __future__ import annotations

import contextlib
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

    env = subprocess_env(
        {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


#: the rank variables an enclosing job would pass on (a test run under torchrun): never to a job
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: in the environment of every process of a ``torchrun_nodes`` job: its id, to find them all
JOB_VARIABLE = "SHARDLOAD_TEST_JOB"
#: in each launcher's environment (and its ranks'): which launcher it is, 0, 1, ...
NODE_VARIABLE = "SHARDLOAD_TEST_NODE"


def torchrun_nodes(
    *args: str, nodes: int = 2, nproc: int = 2, timeout: float = 120, env: dict | None = None
) -> list:
    """One job of ``nodes`` torchrun launchers of ``nproc`` ranks each, as ``nodes`` machines
    would start it (``--nnodes``, c10d rendezvous at a free port of 127.0.0.1), run from the
    checkout with the tests' ``PYTHONPATH`` over ``env`` (default: this process's environment);
    each launcher's ``SHARDLOAD_TEST_NODE`` says which it is. Waits for every launcher to exit
    and returns their ``CompletedProcess``es, in that order.

    The first launcher serves the rendezvous (its store, which the ranks use too), as the
    machine named by ``--rdzv-endpoint`` does: the others start once it listens. c10d gives
    the launchers their node ranks (torchrun ignores ``--node-rank`` with it): a rank finds
    its node's in ``GROUP_RANK``, its launcher in ``SHARDLOAD_TEST_NODE``. Past ``timeout``
    seconds, ``subprocess.TimeoutExpired``. However it ends (a timeout, an assertion, Ctrl-C),
    no process of the job outlives the call: torchrun starts each rank in a session of its
    own, out of reach of its launcher's process group, so they are found by the job's id in
    their environment; and what they leave in ``TMPDIR`` (torchrun's log folders) goes too."""
    import shutil
    import subprocess
    import sys
    import tempfile
    import time
    import uuid

    from devtools.objectservers import free_port

    job = uuid.uuid4().hex
    scratch = tempfile.mkdtemp(prefix="shardload-job-")
    base = subprocess_env(
        {k: v for k, v in (os.environ if env is None else env).items() if k not in RANK_VARIABLES},
        **{JOB_VARIABLE: job, "TMPDIR": scratch},
    )
    port = free_port()
    launchers = []
    try:
        for node in range(nodes):
            if node == 1:
                _wait_until_listening(port, launchers[0][0], timeout)
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(
                [
                    *_dies_with_this_process(),
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(nodes),
                    "--nproc-per-node",
                    str(nproc),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    f"shardload-{job}",
                    *args,
                ],
                cwd=REPO,
                env={**base, NODE_VARIABLE: str(node)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            launchers.append((proc, out, err))
        deadline = time.monotonic() + timeout
        for proc, _, _ in launchers:
            try:
                proc.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(proc.args, timeout) from None
        results = []
        for proc, out, err in launchers:
            out.seek(0)
            err.seek(0)
            results.append(
                subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
            )
        return results
    finally:
        for proc, out, err in launchers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.close()
            err.close()
        kill_job(job)
        shutil.rmtree(scratch, ignore_errors=True)


def _wait_until_listening(port: int, proc, timeout: float) -> None:
    """Until something listens on ``port`` (``/proc/net/tcp``, ``tcp6``: no connection made),
    or ``proc`` ends (its output says why)."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as f:
                # local address (hex ip:port), remote address, state (0A: listening)
                if any(
                    row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port
                    for row in (line.split() for line in f.readlines()[1:])
                ):
                    return
        time.sleep(0.05)


def _dies_with_this_process() -> list[str]:
    """A prefix for a command that gets SIGKILL when this process dies (``setpriv``'s parent-
    death signal, where it is): a launcher must not outlive a test killed outright. The signal
    comes when the *thread* that started the child ends, hence the main thread only."""
    import shutil
    import threading

    setpriv = shutil.which("setpriv")
    if setpriv and threading.current_thread() is threading.main_thread():
        return [setpriv, "--pdeathsig", "KILL", "--"]
    return []


def job_processes(job: str) -> list[int]:
    """The processes whose environment holds ``SHARDLOAD_TEST_JOB=job``: a job's launchers
    and ranks, wherever they were re-parented."""
    mark = f"{JOB_VARIABLE}={job}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours
                continue
    return found


def kill_job(job: str) -> None:
    """SIGKILL every process of the job ``job`` (``job_processes``)."""
    for pid in job_processes(job):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def interrupt_once_started(
    args: list[str], started, env: dict, cwd: str = REPO
) -> tuple[int, str, str, float]:
    """Run ``args``, wait until the file ``started`` exists (a plugin creates it when the load
    is under way), send one SIGINT, and return (exit code, stdout, stderr, seconds from the
    signal to the exit). The child is killed if it outlives the wait."""
    import subprocess
    import time

    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
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
