"""ProcessSession's fork server (``shardload/sessions/forkserver.py``): workers forked from an
interpreter that has imported torch and shardload once, the default on Linux.

What is checked on this path, beside what ``test_sessions_process.py`` checks for every session
(which now runs on it): a worker killed by any signal is a ``WorkerCrashedError`` naming that
signal; the fork server killed takes its workers with it and the next session starts another;
what a fresh interpreter would have inherited from the controller at the session's start
reaches a forked worker (environment, cwd, ``sys.path`` and its plugins, stdout and stderr, its
share of threads, a random state of its own); the server has no thread of its own to fork
after; ``start_method="spawn"`` (and ``SHARDLOAD_WORKER_START=spawn``) still starts fresh
interpreters. No timings: ``benchmarks/bench_startup.py`` measures them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import process_plugins, startup_plugins  # noqa: F401 - the workers' functions
from helpers.process_sessions import (
    WORKER_MODULE,
    describe,
    is_server,
    kill_all,
    own_session,
    proc_cmdline,
    proc_stat,
    still_works,
    wait_gone,
)

from shardload.errors import WorkerCrashedError
from shardload.sessions import ProcessSession, forkserver
from shardload.sessions.functions import unregister_session_func
from shardload.sessions.process import START_ENV, default_start_method

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forks workers; checks them through /proc"
)

PLUGIN = startup_plugins.__name__


def _wait_stopped(pids, timeout: float) -> list[int]:
    """Like ``wait_gone``, but a zombie counts as stopped: a worker orphaned by its server's
    death waits on an init that may never reap it."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if (proc_stat(pid) or ("X",))[0] not in "ZX"]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def test_the_default_is_the_fork_server(monkeypatch):
    monkeypatch.delenv(START_ENV, raising=False)
    assert default_start_method() == "forkserver"
    monkeypatch.setenv(START_ENV, "spawn")
    assert default_start_method() == "spawn"
    monkeypatch.setenv(START_ENV, "fork")
    message = "SHARDLOAD_WORKER_START='fork' is not one of 'forkserver', 'spawn'"
    with pytest.raises(ValueError, match=message):
        default_start_method()
    with pytest.raises(ValueError, match="start_method='threads'"):
        ProcessSession(1, start_method="threads")


def test_a_worker_killed_by_a_signal_is_a_crash_naming_it():
    with own_session(2, distributed=False) as sess:
        pids = list(sess.pids)
        server = forkserver.server_pid()
        os.kill(pids[1], signal.SIGUSR1)  # its default action: the process ends
        assert not wait_gone([pids[1]], 5), "the server did not reap its worker"
        with pytest.raises(WorkerCrashedError) as info:
            sess.call("tests.process.rank")
        err = info.value
        assert (err.worker, err.signal_name, err.exitcode) == (1, "SIGUSR1", -signal.SIGUSR1)
        assert str(err).startswith("worker 1 was killed by SIGUSR1 ")
        left = wait_gone(pids, 5)
        assert not left, f"still there: {describe(left)}"
    # the server is untouched, and forks the next session's workers
    with own_session(1, distributed=False) as sess:
        assert forkserver.server_pid() == server
        assert proc_stat(sess.pids[0])[1] == server
        assert sess.call("tests.process.rank") == [0]


def test_a_worker_that_exits_is_a_crash_with_its_exit_code():
    with own_session(2, distributed=False, plugins=[PLUGIN]) as sess:
        with pytest.raises(WorkerCrashedError) as info:
            sess.run("tests.startup.exit", [(0,), (7,)])
        err = info.value
        assert (err.worker, err.signal_name, err.exitcode) == (1, None, 7)
        assert str(err).startswith("worker 1 exited with code 7 in tests.startup.exit")


def test_a_killed_fork_server_takes_its_workers_and_the_next_session_starts_another():
    with own_session(2, distributed=False) as sess:
        pids = list(sess.pids)
        server = forkserver.server_pid()
        os.kill(server, signal.SIGKILL)
        # they see their parent go (worker.py watches it every 0.5 s)
        left = _wait_stopped(pids, 5)
        assert not left, f"workers outlived their fork server: {describe(left)}"
        with pytest.raises(WorkerCrashedError) as info:
            sess.call("tests.process.rank")
        err = info.value
        assert (err.worker, err.signal_name, err.exitcode) == (0, None, None)
        assert str(err).startswith("worker 0 died ")
    assert not wait_gone([server], 5), "the dead server was not reaped"
    with own_session(2) as sess:
        assert forkserver.server_pid() not in (None, server)
        still_works(sess)


def test_a_forked_worker_starts_as_a_fresh_interpreter_would(tmp_path, monkeypatch, capfd):
    forkserver.prestart()  # started before anything below changes
    forkserver.get_server().wait_ready(120)
    # a plugin only a path added now can import, a variable set now, and another cwd
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    name = f"startup_tmp_plugin_{os.getpid()}"
    (plugin_dir / f"{name}.py").write_text(
        textwrap.dedent("""
        from shardload import register_session_func

        @register_session_func("tests.startup.tmp_plugin")
        def here(ctx):
            return __file__
    """)
    )
    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setenv("SHARDLOAD_TEST_STARTUP", "set after the server started")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        with own_session(2, distributed=False, plugins=[name, PLUGIN]) as sess:
            seen = sess.call("tests.startup.seen", "SHARDLOAD_TEST_STARTUP")
            assert sess.call("tests.startup.tmp_plugin") == [str(plugin_dir / f"{name}.py")] * 2
            capfd.readouterr()
            sess.call("tests.startup.say", "hello from a worker")
            deadline = time.monotonic() + 5  # written before the reply; read here at once
            out, err = capfd.readouterr()
            while out.count("hello") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
                more = capfd.readouterr()
                out, err = out + more.out, err + more.err
    finally:
        unregister_session_func("tests.startup.tmp_plugin")
        sys.modules.pop(name, None)
    assert out.count("hello from a worker\n") == 2 and err.count("hello from a worker\n") == 2
    server = forkserver.server_pid()
    threads = max(1, (os.cpu_count() or 1) // 2)
    for worker in seen:
        assert worker["ppid"] == server
        assert worker["value"] == "set after the server started"
        assert worker["cwd"] == str(tmp_path)
        assert worker["threads"] == threads
    assert seen[0]["random"] != seen[1]["random"]  # each its own numpy random state


def test_the_fork_server_has_no_thread_to_fork_after():
    with own_session(1, distributed=False) as sess:
        assert sess.call("tests.process.rank") == [0]
        server = forkserver.server_pid()
        assert sorted(os.listdir(f"/proc/{server}/task")) == [str(server)]
        assert is_server(server) and proc_stat(server)[1] == os.getpid()


def test_spawn_still_starts_fresh_interpreters():
    with own_session(2, start_method="spawn") as sess:
        assert sess.start_method == "spawn"
        for pid in sess.pids:
            assert proc_stat(pid)[1] == os.getpid()
            assert WORKER_MODULE in proc_cmdline(pid)
        still_works(sess)


SHUTDOWN_AND_EXIT = """
from shardload.sessions import ProcessSession, forkserver

first = ProcessSession(1, distributed=False)
server = forkserver.server_pid()
forkserver.shutdown()        # ends the server and what it forked: the session sees a crash
try:
    first.call("tests.process.rank")
except Exception as exc:
    print(type(exc).__name__, flush=True)
second = ProcessSession(1, distributed=False)
print(server, forkserver.server_pid(), *second.pids, flush=True)
"""


@pytest.mark.slow
def test_shutdown_then_a_new_server_and_nothing_left_at_exit(tmp_path):
    from helpers.subprocesses import subprocess_env

    proc = subprocess.run(
        [sys.executable, "-c", "import helpers.process_plugins\n" + SHUTDOWN_AND_EXIT],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stdout.splitlines()
    pids = [int(p) for p in lines[-1].split()] if lines else []
    try:
        assert proc.returncode == 0, proc.stderr
        assert lines[0] == "WorkerCrashedError", proc.stdout
        assert len(pids) == 3 and pids[0] != pids[1]
        left = wait_gone(pids, 5)  # the exit hook asked the worker, then ended the server
        assert not left, f"left after the interpreter exited: {describe(left)}"
    finally:
        kill_all(pids)
