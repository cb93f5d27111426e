"""Loads as the tests write them again and again, on a fresh ``ThreadedSession`` (no progress
bar): a plan given (``load_on_threads``), the planner's plan for N (``plan_and_load``), a
planner decision's plan (``load_decision``), and a decision with its load kept open
(``decided_load``, for a ``ProcessSession`` whose pieces stay in its workers)."""

from __future__ import annotations

from contextlib import contextmanager

from shardload import ThreadedSession, load_sharded
from shardload.planners import plan_decision, plan_for


def load_on_threads(source, plan, n: int = 2, **kwargs):
    """``load_sharded(source, plan)`` over ``n`` threads; ``kwargs`` go to ``load_sharded``."""
    with ThreadedSession(n) as sess:
        return load_sharded(source, plan, sess, progress=False, **kwargs)


def plan_and_load(folder, n: int):
    """The planner's plan of the checkpoint ``folder`` for ``n`` workers, and its load over
    ``n`` threads: (plan, result)."""
    info = plan_for(str(folder), n)
    with ThreadedSession(n) as session:
        return info, load_sharded(str(folder), info, session, progress=False)


def load_decision(folder, decision):
    """The plan of a planner ``decision`` loaded over as many threads as it has workers."""
    with ThreadedSession(decision.num_shards) as sess:
        return load_sharded(str(folder), decision.validated, sess, progress=False)


@contextmanager
def decided_load(folder, n: int, experts: str = "tp", session_class=ThreadedSession):
    """The decision for N and every worker's pieces, while the session is open (a
    ``ProcessSession``'s pieces stay in its workers)."""
    decision = plan_decision(str(folder), n, experts=experts)
    with session_class(n) as session:
        yield decision, load_sharded(str(folder), decision.validated, session, progress=False)
