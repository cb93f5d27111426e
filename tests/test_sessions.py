"""The Session API behaves the same on threads and on worker processes: call, set_value,
get_value, errors, and what session functions see of the shards."""

from __future__ import annotations

import helpers.process_plugins
import numpy as np
import pytest
import torch

from shardload import (
    REPLICATE,
    ProcessSession,
    SessionClosedError,
    ShardloadError,
    ThreadedSession,
    UnknownSessionFunctionError,
    WorkerError,
    load_sharded,
)
from shardload.sessions import resolve_devices


@pytest.fixture(scope="module", params=["thread", "process"])
def sess(request):
    session = (
        ThreadedSession(2) if request.param == "thread" else ProcessSession(2, distributed=False)
    )
    yield session
    session.close()


def test_call_returns_one_result_per_worker(sess):
    assert sess.call("tests.process.rank") == [0, 1]


def test_session_functions_see_the_latest_load(sess):
    plan = {"a": [["shardload.split", [[2, 4], "float32"], 0]]}
    load_sharded({"a": np.arange(8, dtype=np.float32)}, plan, sess, progress=False)
    first = load_sharded({"b": np.zeros(2, np.float32)}, REPLICATE, sess, progress=False)
    assert sess.call("tests.process.shard_names") == [["b"], ["b"]]
    assert torch.equal(first.shard("b", 1), torch.zeros(2))


def test_values_round_trip(sess):
    sess.set_value(1, "t", torch.arange(3))
    sess.set_value(0, "j", {"k": [1, 2.5, None, "s"]})
    assert torch.equal(sess.get_value(1, "t"), torch.arange(3))
    assert sess.get_value(0, "j") == {"k": [1, 2.5, None, "s"]}
    assert sess.call("tests.process.read_value", "j") == [{"k": [1, 2.5, None, "s"]}, None]


@pytest.mark.parametrize(
    "bad, exc", [(object(), TypeError), (float("nan"), ValueError), ({1, 2}, TypeError)]
)
def test_values_json_cannot_carry_are_refused_here(sess, bad, exc):
    with pytest.raises(exc):
        sess.set_value(0, "x", bad)
    assert sess.call("tests.process.rank") == [0, 1]


def test_errors_are_the_same(sess):
    with pytest.raises(UnknownSessionFunctionError):
        sess.call("tests.process.no_such")
    with pytest.raises(WorkerError) as info:
        sess.call("tests.process.not_json")
    assert {f.exc_type for f in info.value.failures} == {"TypeError"}
    with pytest.raises(IndexError):
        sess.set_value(2, "x", 1)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_closed_session_raises_its_own_error(kind):
    """Every operation of a closed session is one ``SessionClosedError`` (a ``ShardloadError``,
    and a ``RuntimeError`` as before it had a class), naming the kind of session and what to
    do."""
    session = ThreadedSession(2) if kind == "thread" else ProcessSession(2, distributed=False)
    session.close()
    name = type(session).__name__
    for use in (
        lambda: session.call("tests.process.rank"),
        lambda: session.run("tests.process.rank", [(), ()]),
        lambda: session.set_value(0, "x", 1),
        lambda: session.get_value(1, "x"),
        lambda: load_sharded({"a": np.zeros(2)}, REPLICATE, session, progress=False),
    ):
        with pytest.raises(SessionClosedError) as info:
            use()
        err = info.value
        assert type(err) is SessionClosedError
        assert isinstance(err, ShardloadError) and isinstance(err, RuntimeError)
        assert (err.session, err.worker, err.param) == (name, None, None)
        assert str(err) == (
            f"this {name} is closed (by close() or its with block ending, or "
            "by itself after a crash, Ctrl-C or a timeout), so it runs nothing "
            "more; open a new session to go on"
        )
    session.close()  # still fine


@pytest.mark.parametrize(
    "n, message",
    [
        (0, "num_workers must be a positive integer, at most 4096, got 0"),
        (True, "num_workers must be a positive integer, at most 4096, got True"),
        ("2", "num_workers must be a positive integer, at most 4096, got '2'"),
        (
            4097,
            "num_workers is 4097, more than the 4096 workers shardload runs in one session "
            "(each is a thread or a process)",
        ),
    ],
)
def test_the_number_of_workers_is_checked_once_for_every_session(n, message):
    # limits.num_shards_problem: the same clause a plan bound to that N gets
    for make in (
        lambda: resolve_devices("cpu", n),
        lambda: ThreadedSession(n),
        lambda: ProcessSession(n),
    ):
        with pytest.raises(ValueError) as info:
            make()
        assert type(info.value) is ValueError and str(info.value) == message


# ---- collectives: every session supplies its workers' ctx.group ----------------------------

import helpers.group_plugins  # noqa: E402,F401  (session functions using ctx.group)


@pytest.mark.parametrize("n", [1, 3])
def test_threads_reduce_and_broadcast_the_same_bits_on_every_worker(n):
    with ThreadedSession(n) as session:
        results = session.call("tests.groups.rounds", 3)
    want = [[sum(10.0**w for w in range(n)) + n * r, 100.0 * (r % n) + r] for r in range(3)]
    assert results == [want] * n


def test_process_workers_reduce_over_their_own_group():
    with ProcessSession(2) as session:
        assert session.call("tests.groups.rounds", 2) == [[[11.0, 0.0], [13.0, 101.0]]] * 2


def test_process_workers_without_a_group_say_so():
    with ProcessSession(2, distributed=False) as session:
        with pytest.raises(
            WorkerError,
            match=r"ShardloadError: worker [01] has no collectives: "
            r"its ProcessSession was opened with "
            r"distributed=False",
        ):
            session.call("tests.groups.rounds", 1)


def test_a_failing_thread_stops_the_others_waiting_in_a_collective():
    import time

    with ThreadedSession(3) as session:
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            session.call("tests.groups.fail_on", 1)
        # the failure is the one reported, alone: the waiting workers stopped, quietly
        assert err.value.workers == (1,)
        assert "ValueError: worker 1 fails on purpose" in str(err.value)
        assert time.monotonic() - start < 10  # measured: 0.2 s; without the abort, never
        # the broken barrier is mended: the next run's collectives work
        assert session.call("tests.groups.rounds", 1) == [[[111.0, 0.0]]] * 3


def test_the_workers_group_is_nccl_only_where_each_has_a_gpu_of_its_own():
    from shardload.sessions.process import group_backend

    def backend(*names):
        return group_backend([torch.device(n) for n in names])

    assert backend("cuda:0", "cuda:1", "cuda:2") == "nccl"
    assert backend("cuda:0", "cuda:1", "cuda:0") == "gloo"  # more workers than GPUs
    assert backend("cpu", "cpu") == "gloo" and backend("cuda:0", "cpu") == "gloo"
