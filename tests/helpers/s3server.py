"""A real S3 server on loopback for the tests: moto's server, behind a small proxy of our own.

The server and its proxy now live in ``helpers.objectservers`` (S3, GCS and Azure, one
interface); this module keeps the S3-only names the older tests use, with their behaviour.

``S3Server`` starts ``moto.server.ThreadedMotoServer`` on 127.0.0.1 and, in front of it, a
threaded HTTP/1.1 proxy (standard library only) that forwards every request to moto and

1. **counts** the response body bytes it sends to clients: per object key and in total, for
   successful (2xx) answers to requests that name an object (``bytes_sent``), and logs every
   request it answered (``requests``): the server-side count tests compare with what the
   client kept;
2. **injects faults** by rule (``inject``): an S3 error answer with a proper XML body (503
   ``SlowDown``, 500 ``InternalError``, 403 ``AccessDenied``, anything), a connection dropped
   after M bytes of a body, a delay.

The shardload client under test talks to the proxy (``endpoint``, and ``AWS_ENDPOINT_URL`` in
``aws_env()``); ``client()`` is a botocore client straight to moto, for setting up buckets and
objects without touching the counts. ``close()`` (or leaving the ``with`` block) stops the
proxy's threads, every one, and moto.

Fixtures wrap ``s3_server`` (a generator)::

    @pytest.fixture(scope="session")
    def s3():
        yield from s3server.s3_server()

and point the client (botocore, or obstore: ``aws_env()`` allows plain HTTP with
``AWS_ALLOW_HTTP``) at it with ``use_env(monkeypatch, s3.aws_env())``; a subprocess gets
``s3.env()``. (Unlike ``ObjectServer.env()``, which gives the settings only, ``S3Server.env()``
gives a whole environment, as it always has.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .objectservers import (
    ACCESS_KEY_ID,
    NO_SUCH_FILE,
    REGION,
    SECRET_ACCESS_KEY,
    SEND_PART,  # noqa: F401 - as before
    Fault,
    S3ObjectServer,
)

__all__ = [
    "ACCESS_KEY_ID",
    "NO_SUCH_FILE",
    "REGION",
    "SECRET_ACCESS_KEY",
    "Fault",
    "S3Server",
    "s3_server",
    "use_env",
]


class S3Server(S3ObjectServer):
    """moto's S3 server on 127.0.0.1 behind a counting, fault-injecting proxy. A context
    manager; ``start()``/``close()`` otherwise."""

    def env(self, base: dict | None = None, **kwargs: Any) -> dict:  # type: ignore[override]
        """A whole environment for a subprocess: ``base`` (default: this process's) without
        any AWS setting of its own, plus ``aws_env(**kwargs)``."""
        env = {
            k: v
            for k, v in (os.environ if base is None else base).items()
            if not _is_aws_setting(k)
        }
        env.update(self.aws_env(**kwargs))
        return env

    def inject(self, kind: str = "error", **rule: Any) -> Fault:
        # here an error rule that names no code has always said InternalError, whatever its
        # status ("slowdown": SlowDown)
        if kind == "error":
            rule.setdefault("code", "InternalError")
        return super().inject(kind, **rule)


def _is_aws_setting(name: str) -> bool:
    return name.startswith("AWS_") or name == "BOTO_CONFIG"


def use_env(monkeypatch: Any, env: dict) -> None:
    """Make ``env`` this process's only AWS settings, for one test (``monkeypatch``)."""
    for name in list(os.environ):
        if _is_aws_setting(name):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def s3_server() -> Iterator[S3Server]:
    """A started ``S3Server``, closed afterwards: the body of an ``s3`` fixture (skips when
    moto or botocore is not installed)."""
    with S3Server() as server:
        yield server
