"""How the object storage client is set up: its defaults and bounds, its settings from the
environment (``settings_from_env``), and the library's store for a bucket (``make_store``),
refused in one line where a setting cannot work."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import ModuleType
from typing import Any, Protocol, TypedDict
from urllib.parse import urlsplit

from ..envvars import env_number
from ..errors import StorageError, quote
from .settings import StoreSettings, store_settings
from .urls import ObjectUrl

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_RETRIES",
    "ClientSettings",
    "Timing",
    "make_store",
    "require_obstore",
    "seconds_arg",
    "settings_from_env",
    "whole_arg",
]

#: GETs in flight at once per process (``$SHARDLOAD_OBJECT_CONCURRENCY``)
DEFAULT_CONCURRENCY = 8
#: the largest single GET (``$SHARDLOAD_OBJECT_CHUNK_MB``)
DEFAULT_CHUNK_BYTES = 8 << 20
#: retries of one request after its first attempt (``$SHARDLOAD_OBJECT_RETRIES``)
DEFAULT_RETRIES = 5
#: the largest gap between two wanted spans that ``coalesce`` reads through, and the gap it
#: always reads through (see there)
MAX_GAP = 1 << 20
SMALL_GAP = 64 << 10
#: seconds to wait for a connection, and for a whole request (a GET of at most ``chunk_bytes``):
#: the library's defaults, which its own environment settings change
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 30.0
#: backoff before retry k is about BACKOFF_BASE * 2**(k-1) seconds, capped
BACKOFF_BASE = 0.1
BACKOFF_CAP = 5.0

#: the environment variables ``settings_from_env`` reads, and their bounds
CONCURRENCY_ENV = "SHARDLOAD_OBJECT_CONCURRENCY"
CHUNK_MB_ENV = "SHARDLOAD_OBJECT_CHUNK_MB"
RETRIES_ENV = "SHARDLOAD_OBJECT_RETRIES"
MAX_GAP_KB_ENV = "SHARDLOAD_OBJECT_MAX_GAP_KB"
MAX_CONCURRENCY = 256
MAX_CHUNK_MB = 1024
MAX_RETRIES = 20


def whole_arg(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value``, an ``ObjectClient`` argument, checked to be a whole number in bounds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} is a whole number {bound}, not {quote(value)}")
    return value


def seconds_arg(name: str, value: Any) -> float:
    """``value``, an ``ObjectClient`` argument, checked to be seconds under an hour."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 3600:
        raise ValueError(f"{name} is a number of seconds from 0 to 3600, not {quote(value)}")
    return float(value)


class ClientSettings(TypedDict):
    """The ``ObjectClient`` arguments the environment sets."""

    concurrency: int
    chunk_bytes: int
    retries: int
    max_gap: int


def settings_from_env(environ: Mapping[str, str] | None = None) -> ClientSettings:
    """``ObjectClient`` settings from ``$SHARDLOAD_OBJECT_CONCURRENCY`` (default 8),
    ``$SHARDLOAD_OBJECT_CHUNK_MB`` (MiB, default 8), ``$SHARDLOAD_OBJECT_RETRIES`` (default 5)
    and ``$SHARDLOAD_OBJECT_MAX_GAP_KB`` (KiB, default 1024; 0: only the bytes asked for); unset
    or empty means the default. A bad value is a ``ValueError`` naming the variable.

    >>> settings_from_env({"SHARDLOAD_OBJECT_CHUNK_MB": "0.5"})["chunk_bytes"]
    524288
    """

    def whole(name: str, default: int, low: int, high: int, what: str = "a whole number") -> int:
        value = env_number(name, default, parse=int, low=low, high=high, what=what, environ=environ)
        return default if value is None else value

    # inf and NaN parse, and are refused as out of range
    chunk_mb = env_number(
        CHUNK_MB_ENV,
        DEFAULT_CHUNK_BYTES >> 20,
        parse=float,
        low=1 / 1024,
        high=MAX_CHUNK_MB,
        what="a number of MiB",
        environ=environ,
    )
    max_gap_kb = whole(
        MAX_GAP_KB_ENV, MAX_GAP >> 10, 0, MAX_CHUNK_MB << 10, "a whole number of KiB"
    )
    return {
        "concurrency": whole(CONCURRENCY_ENV, DEFAULT_CONCURRENCY, 1, MAX_CONCURRENCY),
        "chunk_bytes": int((chunk_mb or 0) * (1 << 20)),  # None only for an `off` word
        "retries": whole(RETRIES_ENV, DEFAULT_RETRIES, 0, MAX_RETRIES),
        "max_gap": max_gap_kb << 10,
    }


def require_obstore(loc: ObjectUrl) -> ModuleType:
    """The library, or (not installed) the error that says how to install it."""
    try:
        import obstore
    except ImportError:
        raise StorageError(
            f"reading {loc.scheme}:// URLs needs obstore, which is not "
            'installed; pip install "shardload[objects]"',
            url=str(loc),
            usage=True,
        ) from None
    return obstore


class Timing(Protocol):
    """A client's timeouts and retries, as the library's stores are made with them
    (``ObjectClient`` has them)."""

    retries: int
    backoff: float
    backoff_cap: float
    connect_timeout: float
    request_timeout: float


def make_store(loc: ObjectUrl, timing: Timing) -> tuple[Any, StoreSettings]:
    """The library's store for ``loc``'s bucket, and the settings it was made with: the
    environment's, each cloud's own translated (``sources.settings``), and ours, the timeouts
    where the environment sets none. A setting that cannot work is a ``StorageError``."""
    require_obstore(loc)
    from obstore.store import from_url

    settings = store_settings(
        loc,
        client_defaults={
            "connect_timeout": timedelta(seconds=timing.connect_timeout),
            "timeout": timedelta(seconds=timing.request_timeout),
        },
    )
    check_answers(settings, loc, timing.connect_timeout)
    retry: Any = {  # the library's RetryConfig
        "max_retries": timing.retries,
        "backoff": {
            "init_backoff": timedelta(seconds=timing.backoff),
            "max_backoff": timedelta(seconds=max(timing.backoff, timing.backoff_cap)),
            "base": 2.0,
        },
        "retry_timeout": timedelta(seconds=timing.request_timeout * (timing.retries + 1)),
    }
    try:
        # the scheme's own config (S3Config, GCSConfig or AzureConfig) and ClientConfig, which
        # settings builds as plain dicts
        config: Any = settings.config or None
        client_options: Any = settings.client_options
        store = from_url(
            loc.root,
            config=config,
            client_options=client_options,
            retry_config=retry,
        )
    except Exception as exc:
        from obstore.exceptions import BaseError

        if not isinstance(exc, (BaseError, FileNotFoundError, ValueError)):
            raise
        name = _bad_client_setting(settings, loc, from_url)
        if name is not None:
            raise StorageError(
                f"{name} is not a value the client takes; correct it, or unset it",
                url=str(loc),
                usage=True,
            ) from None
        raise StorageError(
            f"the {loc.service} client could not be configured "
            f"({type(exc).__name__}); check the environment "
            f"({settings.credentials}, and the endpoint)",
            url=str(loc),
            usage=True,
        ) from None
    return store, settings


#: the variables that send requests through a proxy: there, a connection of our own to the
#: endpoint would not tell whether the client can reach it
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
#: the resolver's answers that a host name has no address (not a failure to ask)
_NO_SUCH_HOST = tuple(
    getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)
)


def check_answers(settings: StoreSettings, loc: ObjectUrl, timeout: float) -> None:
    """Refuse, at once and in one line naming its variable, an endpoint a setting gave where
    nothing listens (the connection refused) or whose host has no address: the library would
    retry such a request for seconds, and no retry cures a wrong setting. Anything else (a
    timeout, a network that is down) is left to the library and its retries."""
    endpoint = settings.endpoint
    if (
        endpoint is None
        or "proxy_url" in settings.client_options
        or any(os.environ.get(n) or os.environ.get(n.lower()) for n in _PROXY_VARIABLES)
    ):
        return
    parts = urlsplit(endpoint.url.strip())
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except ConnectionRefusedError:
        raise StorageError(
            f"could not connect to the endpoint {endpoint.shown} that "
            f"{endpoint.source} gives: the connection was refused (nothing "
            f"listens there); start the server, or correct {endpoint.variable}",
            url=str(loc),
            usage=False,
        ) from None
    except socket.gaierror as exc:
        if exc.errno not in _NO_SUCH_HOST:
            return  # a name server that did not answer: the library tries again
        raise StorageError(
            f"the endpoint {endpoint.shown} that {endpoint.source} gives names "
            f"a host that has no address; correct {endpoint.variable}",
            url=str(loc),
            usage=True,
        ) from None
    except OSError:
        return


def _bad_client_setting(
    settings: StoreSettings, loc: ObjectUrl, from_url: Callable[..., Any]
) -> str | None:
    """The environment's client setting the library refused (``AWS_TIMEOUT=soon``), found by
    making a store with each alone; None where none of them is."""
    for option, name in settings.carried.items():
        try:
            from_url(loc.root, client_options={option: settings.client_options[option]})
        except Exception:  # noqa: BLE001 - the library's refusal of this one value
            return name
    return None
