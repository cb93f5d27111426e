"""The object-storage emulators for the tests: pytest glue over ``devtools.objectservers``
(the emulators and the counting, fault-injecting proxy, shared with
``benchmarks/bench_objects.py``; see its docstring for what they do).

What this adds: a missing emulator skips the test, or fails it under CI's
``SHARDLOAD_REQUIRE_OBJECT_SERVERS=1`` (``set_missing``, set on import), and ``use_env``. The
rest is re-exported, so tests keep ``from helpers import objectservers`` and
``from helpers.objectservers import ...``. An attribute set on this module (a test's
``monkeypatch.setattr(objectservers, "free_port", ...)``) is set on ``devtools.objectservers``
too, where the code that reads it lives. A fixture::

    @pytest.fixture(scope="session", params=SCHEMES)
    def store(request):
        yield from objectservers.object_server(request.param)
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import devtools.objectservers as _impl
from devtools.objectservers import *  # noqa: F403 - the tests' names
from devtools.objectservers import SCHEMES, is_cloud_setting, make_server, set_missing

__all__ = [
    *_impl.__all__,
    "use_env",
    "scheme_params",
    "SCHEME_PARAMS",
    "servers_on_demand",
    "add_latency",
]
# every other name too (SEND_PART, _SETPRIV, ...): what a test reads there, it reads here
globals().update(
    {k: v for k, v in vars(_impl).items() if not k.startswith("__") and k not in globals()}
)


def _skip_or_fail(what: str) -> None:
    """An emulator that is not there: the test skips, or fails under CI's
    ``SHARDLOAD_REQUIRE_OBJECT_SERVERS=1``."""
    if os.environ.get("SHARDLOAD_REQUIRE_OBJECT_SERVERS") == "1":
        pytest.fail(what, pytrace=False)
    pytest.skip(what)


set_missing(_skip_or_fail)


def scheme_params(*schemes: str, marks: tuple = ()) -> list:
    """``schemes`` (default: all) as test parameters with ``marks``, ``az`` marked ``azurite``
    too: its emulator is made by ``scripts/azurite.sh``, and without it those tests skip
    before they start."""
    return [
        pytest.param(s, marks=[*marks, *([pytest.mark.azurite] if s == "az" else [])], id=s)
        for s in schemes or SCHEMES
    ]


SCHEME_PARAMS = scheme_params()


def servers_on_demand(setup: Callable[[Any], None]) -> Iterator[Callable[[str], Any]]:
    """The body of a fixture handing out one server per scheme: ``get(scheme)`` starts that
    scheme's server the first time a test asks for it (skipping without its emulator) and
    runs ``setup(server)`` on it; every one started is closed when the fixture ends::

        @pytest.fixture(scope="module")
        def servers():
            yield from servers_on_demand(lambda server: server.make_bucket("models"))
    """
    started: dict = {}

    def get(scheme: str) -> Any:
        if scheme not in started:
            server = make_server(scheme).start()
            try:
                setup(server)
            except BaseException:
                server.close()
                raise
            started[scheme] = server
        return started[scheme]

    try:
        yield get
    finally:
        for server in started.values():
            server.close()


def use_env(monkeypatch: Any, env: dict) -> None:
    """Make ``env`` this process's only cloud settings, for one test (``monkeypatch``)."""
    for name in list(os.environ):
        if is_cloud_setting(name):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def serving(server: Any, monkeypatch: Any) -> Iterator[Any]:
    """The body of a per-test fixture: ``server`` with this process (and the workers it
    starts) pointed at it, a fresh default client (it reads its settings once), no faults and
    its counts from zero; its faults cleared again after the test::

        @pytest.fixture
        def server(servers, scheme, monkeypatch):
            yield from serving(servers(scheme), monkeypatch)
    """
    from shardload.sources import store

    use_env(monkeypatch, server.env())
    store.reset_default_client()
    server.clear_faults()
    server.reset_counts()
    yield server
    server.clear_faults()
    store.reset_default_client()


def add_latency(server: Any, seconds: float) -> list:
    """Every request ``server``'s proxy answers from now on (object requests and listings
    alike) waits ``seconds`` first, as one to a distant service does: two ``delay`` rules of
    the proxy's own (``Fault``), for requests that name an object and for those that name none
    (a listing). A request takes the first rule that matches it, so a rule added before these
    (an error for one key) still takes its requests; ``clear_faults`` ends the latency."""
    return [
        server.inject("delay", seconds=seconds, times=None, method=None, key=key)
        for key in (None, "")
    ]


class _Glue(types.ModuleType):
    """This module: setting one of ``devtools.objectservers``' names sets it there too."""

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(_impl, name):
            setattr(_impl, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Glue
