"""Object storage: byte ranges of objects in S3, Google Cloud Storage or Azure Blob Storage,
read through obstore.

Everything shardload needs from object storage: ``head`` an object (its size and identity),
``list_folder`` a key prefix, and read byte ranges of an object, into a buffer (``get_into``,
``get_bytes``) or as spans streamed through a callback (``fetch``), on a bounded number of
threads with bounded memory. One ``ObjectClient`` serves every scheme (``urls.SCHEMES``).

What the library does, and we do not write: signing, the standard credential chains of each
service (``AWS_*`` and ``~/.aws``, ``GOOGLE_*`` and application default credentials,
``AZURE_*``), connection pooling, and retrying a request that fails (5xx, throttling, a
connection refused or reset) with backoff, ``retries`` times. Each cloud's own settings that
the library does not read (``AZURE_STORAGE_CONNECTION_STRING``, ``STORAGE_EMULATOR_HOST``, an
``http://`` endpoint meaning plain HTTP) are translated by ``sources.settings``.

What stays ours, because no library does it for us:

* **One identity per object.** ``ObjectInfo.identity`` is ``[etag, size, last_modified]``.
  Every ranged GET carries ``If-Match: <etag>``, and what it answers must be the range asked
  for of an object of the size that was seen: an object replaced while it loads is refused
  (``FormatError``: "the object changed while loading"), as a local file that changes is.
* **Resuming a dropped body.** A body that breaks off mid-transfer is asked for again from the
  first byte not yet received (with the same ``If-Match``), up to ``retries`` times.
* **Reading only what is wanted.** ``coalesce``: which gaps between wanted spans are cheaper
  read through than skipped, with a bound on the over-read; the library's own ``get_ranges``
  cannot carry ``If-Match``.
* **Bounded memory.** At most ``concurrency`` GETs of at most ``chunk_bytes`` in flight per
  process (``fetch``), each streamed into its thread's buffer.
* **Messages carry no secret.** Every message is built from our own words, the URL, status
  codes and a few fixed phrases recognised in the library's error text, never the text itself
  (it can hold a signed URL), and errors are raised ``from None``.
"""

from __future__ import annotations

import operator
import os
import re
import socket
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar
from urllib.parse import urlsplit

from ..errors import FormatError, StorageError, quote
from .settings import StoreSettings, default_settings, store_settings
from .urls import ObjectUrl, as_url

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_RETRIES",
    "MAX_FOLDER_OBJECTS",
    "MAX_GAP",
    "OPEN_CONCURRENCY",
    "ObjectClient",
    "ObjectInfo",
    "coalesce",
    "default_client",
    "each",
    "settings_from_env",
]

#: GETs in flight at once per process (``$SHARDLOAD_OBJECT_CONCURRENCY``)
DEFAULT_CONCURRENCY = 8
#: the largest single GET, and the size of each thread's buffer in ``fetch``
#: (``$SHARDLOAD_OBJECT_CHUNK_MB``)
DEFAULT_CHUNK_BYTES = 8 << 20
#: retries of one request after its first attempt (``$SHARDLOAD_OBJECT_RETRIES``)
DEFAULT_RETRIES = 5
#: the small requests opening a checkpoint makes at once (``each``: headers, side files)
OPEN_CONCURRENCY = 32
#: the largest gap between two wanted spans that ``coalesce`` reads through, and the gap it
#: always reads through (see there)
MAX_GAP = 1 << 20
SMALL_GAP = 64 << 10
#: a folder listing holding more entries than this is refused: a checkpoint is not a bucket
MAX_FOLDER_OBJECTS = 100_000
#: seconds to wait for a connection, and for a whole request (a GET of at most ``chunk_bytes``):
#: the library's defaults, which its own environment settings change
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 30.0
#: backoff before retry k is about BACKOFF_BASE * 2**(k-1) seconds, capped
BACKOFF_BASE = 0.1
BACKOFF_CAP = 5.0

#: the environment variables ``default_client`` reads, and their bounds
CONCURRENCY_ENV = "SHARDLOAD_OBJECT_CONCURRENCY"
CHUNK_MB_ENV = "SHARDLOAD_OBJECT_CHUNK_MB"
RETRIES_ENV = "SHARDLOAD_OBJECT_RETRIES"
MAX_GAP_KB_ENV = "SHARDLOAD_OBJECT_MAX_GAP_KB"
MAX_CONCURRENCY = 256
MAX_CHUNK_MB = 1024
MAX_RETRIES = 20

#: the library's words for a few causes, recognised (never repeated) to say them our way
_STATUS = re.compile(r"status code: (\d{3})|Server returned non-2xx status code: (\d{3})")
_CREDENTIAL_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "AuthenticationFailed",
    "InvalidAuthenticationInfo",
    "invalid_grant",
)
_CONNECT_WORDS = (
    "error sending request",
    "Connection refused",
    "tcp connect error",
    "dns error",
    "failed to lookup address",
    "client error (Connect)",
)
_NO_BUCKET_WORDS = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
_TIMEOUT_WORDS = ("operation timed out", "timed out", "deadline has elapsed", "kind: Timeout")
_NO_CREDENTIAL_WORDS = (
    "Error getting credentials",
    "Missing credentials",
    "No credentials",
    "Failed to load credentials",
    "Missing account name",
    "Missing SAS key",
    "Missing service account",
)
#: where the library asks for credentials when none are set (instance metadata: EC2, Azure
#: managed identity, GCE; ECS container credentials), and the variables that move it: a
#: failure there is no credentials, whatever its status, not the storage endpoint's
_METADATA_HOSTS = (
    "169.254.169.254",
    "169.254.170.2",
    "[fd00:ec2::254]",
    "metadata.google.internal",
)
_METADATA_ENV = (
    "AWS_METADATA_ENDPOINT",
    "AZURE_MSI_ENDPOINT",
    "AZURE_IDENTITY_ENDPOINT",
    "IDENTITY_ENDPOINT",
    "MSI_ENDPOINT",
)


# ------------------------------------------------------------------------------------ objects


def _iso(value: Any) -> str:
    """A Last-Modified time as ISO text in UTC, to the second: services say it to the second
    in one answer and to the millisecond in another, and the two must give the same
    identity."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc).replace(microsecond=0).isoformat()
    return "" if value is None else str(value)


@dataclass(frozen=True)
class ObjectInfo:
    """An object as ``head`` or ``list_folder`` saw it: its URL, size, ETag (as the service
    gives it, quoted where a listing gives it bare) and Last-Modified time (ISO 8601, UTC, to
    the second)."""

    url: str
    size: int
    etag: str
    last_modified: str

    @property
    def identity(self) -> list:
        """``[etag, size, last_modified]``: JSON-able, equal exactly when the object is the one
        that was seen (an overwrite changes the ETag and the time)."""
        return [self.etag, self.size, self.last_modified]


def _info(url: str, meta: Any) -> ObjectInfo:
    size = meta.get("size") if isinstance(meta, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise StorageError(
            "the service's answer has no valid object size; the endpoint does "
            "not speak its storage API as expected",
            url=url,
            usage=False,
        )
    return ObjectInfo(url, size, _etag(meta.get("e_tag")), _iso(meta.get("last_modified")))


def _etag(value: Any) -> str:
    """An ETag in its HTTP form, a quoted string (a weak one's ``W/`` kept). Headers say it
    quoted, but some listings bare (Azure's, and GCS's XML API as fake-gcs-server writes it):
    an object listed and then read must have one identity, and ``If-Match`` takes it quoted.

    >>> _etag("0x8DC1A2B3C4D5E6F"), _etag('"abc"'), _etag('W/"abc"'), _etag(None)
    ('"0x8DC1A2B3C4D5E6F"', '"abc"', 'W/"abc"', '')
    """
    text = "" if value is None else str(value).strip()
    if not text or text.startswith(('"', 'W/"')):
        return text
    return f'"{text}"'


# ------------------------------------------------------------------------------------ coalesce


def _check_span(span: Any) -> tuple[int, int]:
    try:
        begin, end = span
        begin, end = operator.index(begin), operator.index(end)
    except (TypeError, ValueError):
        raise TypeError(f"a span is a pair of ints (begin, end), not {quote(span)}") from None
    if not 0 <= begin <= end:
        raise ValueError(f"span [{begin}, {end}) is not 0 <= begin <= end")
    return begin, end


def coalesce(
    spans: Iterable[Sequence[int]], max_gap: int = MAX_GAP, small_gap: int | None = None
) -> list[tuple[int, int]]:
    """``[begin, end)`` byte spans sorted, overlapping and adjacent ones merged, empty ones
    dropped, and two runs of wanted bytes joined across the gap between them when the gap is
    at most ``small_gap`` (default ``SMALL_GAP``, 64 KiB), or at most ``max_gap`` (1 MiB) and
    at most a quarter of the run it joins.

    The bounded over-read rule: every byte asked for is read, and the bytes read that nobody
    asked for are at most 64 KiB per gap read through plus a quarter of the bytes asked for.
    Why read a gap at all: a ranged GET costs a round trip before its first byte (some 10-20 ms
    in-region), about what transferring 1 MiB costs one connection, so a small gap is cheaper
    read than skipped. Why not every gap under 1 MiB: on a small model the gaps between one
    worker's pieces are other workers' pieces, and reading through them would fetch the whole
    file on every worker.

    >>> coalesce([(10, 20), (0, 5), (5, 8), (21, 30), (100, 110)], max_gap=1)
    [(0, 8), (10, 30), (100, 110)]
    >>> coalesce([(0, 100), (150, 400), (420, 430)], max_gap=1000, small_gap=10)
    [(0, 400), (420, 430)]
    """
    if isinstance(max_gap, bool) or not isinstance(max_gap, int) or max_gap < 0:
        raise ValueError(f"max_gap is a whole number of bytes >= 0, not {quote(max_gap)}")
    small = min(max_gap, SMALL_GAP if small_gap is None else small_gap)
    checked = sorted(s for s in map(_check_span, spans) if s[1] > s[0])
    runs: list[tuple[int, int]] = []  # maximal runs of wanted bytes
    for begin, end in checked:
        if runs and begin <= runs[-1][1]:
            if end > runs[-1][1]:
                runs[-1] = (runs[-1][0], end)
        else:
            runs.append((begin, end))
    merged: list[tuple[int, int]] = []
    for begin, end in runs:
        gap = begin - merged[-1][1] if merged else None
        if gap is not None and (gap <= small or (gap <= max_gap and 4 * gap <= end - begin)):
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    return merged


def _pieces(spans: Iterable[tuple[int, int]], chunk: int) -> list[tuple[int, int]]:
    """Each span cut into pieces of at most ``chunk`` bytes, in order."""
    return [(b, min(b + chunk, end)) for begin, end in spans for b in range(begin, end, chunk)]


# ------------------------------------------------------------------------------------- errors


class _Stopped(Exception):
    """Another piece failed: this one stops without an error of its own."""


class _Changed(Exception):
    """The object is no longer the one seen (a failed If-Match, a 404 or 416 mid-load): the
    caller builds the error, which needs a HEAD to say what the object is now."""


def _obstore(loc: ObjectUrl) -> Any:
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


#: the variables that send requests through a proxy: there, a connection of our own to the
#: endpoint would not tell whether the client can reach it
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
#: the resolver's answers that a host name has no address (not a failure to ask)
_NO_SUCH_HOST = tuple(
    getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n)
)


def _check_answers(settings: StoreSettings, loc: ObjectUrl, timeout: float) -> None:
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


def _from_metadata_service(text: str) -> bool:
    """The library's error text says a request to an instance metadata service failed (the
    credential source of last resort), not one to the storage endpoint."""
    hosts = list(_METADATA_HOSTS)
    for name in _METADATA_ENV:
        try:
            host = urlsplit(os.environ.get(name) or "").netloc
        except ValueError:
            continue
        if host:
            hosts.append(host)
    return any(f"//{host}/" in text or f"//{host}:" in text for host in hosts)


def _library_error(exc: BaseException) -> str | None:
    """The kind of an error a call of the library raised (its class name; it raises Python's
    own ``FileNotFoundError`` for a missing object), or None for any other exception."""
    module = type(exc).__module__ or ""
    if module.startswith("obstore"):
        return type(exc).__name__
    return "NotFoundError" if isinstance(exc, FileNotFoundError) else None


# ------------------------------------------------------------------------------------- client

#: every client, so that a forked child makes its own stores and locks
_CLIENTS: weakref.WeakSet[ObjectClient] = weakref.WeakSet()


def _whole(name: str, value: Any, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} is a whole number {bound}, not {quote(value)}")
    return value


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 3600:
        raise ValueError(f"{name} is a number of seconds from 0 to 3600, not {quote(value)}")
    return float(value)


class ObjectClient:
    """Reads objects by byte range, from any scheme. One per process (``default_client``).

    A store of the library is made per bucket on first use. The library's runtime (threads,
    connections) does not survive ``fork``: a process forked after its parent used object
    storage is refused (``StorageError``, at once) rather than left to hang; worker processes
    are started fresh (``ProcessSession``'s fork server, ``spawn``), never forked from a
    process that read objects.

    ``concurrency`` GETs run at once per process, each of at most ``chunk_bytes``; the library
    retries a failed request ``retries`` times after ``backoff * 2**(k-1)`` seconds (capped at
    ``backoff_cap``), and a body dropped mid-transfer is resumed as often.
    """

    def __init__(
        self,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        retries: int = DEFAULT_RETRIES,
        max_gap: int = MAX_GAP,
        backoff: float = BACKOFF_BASE,
        backoff_cap: float = BACKOFF_CAP,
        connect_timeout: float = CONNECT_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        max_folder_objects: int = MAX_FOLDER_OBJECTS,
    ):
        self.concurrency = _whole("concurrency", concurrency, 1, MAX_CONCURRENCY)
        self.chunk_bytes = _whole("chunk_bytes", chunk_bytes, 1)
        self.retries = _whole("retries", retries, 0, MAX_RETRIES)
        self.max_gap = _whole("max_gap", max_gap, 0)
        self.backoff = _seconds("backoff", backoff)
        self.backoff_cap = _seconds("backoff_cap", backoff_cap)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout) or CONNECT_TIMEOUT
        self.request_timeout = _seconds("request_timeout", request_timeout) or REQUEST_TIMEOUT
        self.max_folder_objects = _whole("max_folder_objects", max_folder_objects, 1)
        self._after_fork()
        _CLIENTS.add(self)

    def __repr__(self) -> str:
        return (
            f"ObjectClient(concurrency={self.concurrency}, chunk_bytes={self.chunk_bytes}, "
            f"retries={self.retries})"
        )

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        # GETs in flight in this process, whichever fetch they serve (the workers of a
        # ThreadedSession fetch at once): at most `concurrency`, so memory stays chunk x that
        self._in_flight = threading.BoundedSemaphore(self.concurrency)
        self._stores: dict[str, Any] = {}  # the parent's: dropped, never used here
        self._settings: dict[str, StoreSettings] = {}
        self._pid = os.getpid()

    # -- the library's stores -----------------------------------------------------------------

    def _store(self, loc: ObjectUrl) -> Any:
        if self._pid != os.getpid():
            self._after_fork()
        if _USED_IN not in (None, os.getpid()):
            raise StorageError(
                f"this process was forked from one that had read object storage (pid "
                f"{_USED_IN}), and the object-store library's runtime does not survive a fork; "
                "start the process fresh instead (multiprocessing's 'spawn' or 'forkserver', "
                "or VLLM_WORKER_MULTIPROC_METHOD=spawn)",
                url=str(loc),
                usage=True,
            )
        store = self._stores.get(loc.root)
        if store is not None:
            return store
        with self._lock:
            if loc.root not in self._stores:
                _mark_used()
                self._stores[loc.root] = self._make_store(loc)
            return self._stores[loc.root]

    def _make_store(self, loc: ObjectUrl) -> Any:
        _obstore(loc)
        from obstore.store import from_url

        # the environment's settings, each cloud's own translated (sources.settings); ours
        # are the timeouts, where the environment sets none
        settings = store_settings(
            loc,
            client_defaults={
                "connect_timeout": timedelta(seconds=self.connect_timeout),
                "timeout": timedelta(seconds=self.request_timeout),
            },
        )
        _check_answers(settings, loc, self.connect_timeout)
        retry = {
            "max_retries": self.retries,
            "backoff": {
                "init_backoff": timedelta(seconds=self.backoff),
                "max_backoff": timedelta(seconds=max(self.backoff, self.backoff_cap)),
                "base": 2.0,
            },
            "retry_timeout": timedelta(seconds=self.request_timeout * (self.retries + 1)),
        }
        try:
            store = from_url(
                loc.root,
                config=settings.config or None,
                client_options=settings.client_options,
                retry_config=retry,
            )
        except Exception as exc:
            if _library_error(exc) is None and not isinstance(exc, ValueError):
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
        self._settings[loc.root] = settings
        return store

    def _settings_of(self, loc: ObjectUrl) -> StoreSettings:
        """The settings ``loc``'s store was made with, for messages."""
        return self._settings.get(loc.root) or default_settings(loc.scheme)

    # -- judging failures ---------------------------------------------------------------------

    def _error(
        self,
        exc: BaseException,
        loc: ObjectUrl,
        action: str,
        byte_range: tuple[int, int] | None = None,
    ) -> BaseException:
        """The error to raise for the library's ``exc`` (``_Changed`` mid-load); a foreign
        exception is returned as it is (a bug: raised unchanged). ``action`` is ``read``,
        ``list`` or ``get`` (a ranged GET of an object seen before)."""
        kind = _library_error(exc)
        if kind is None:
            return exc
        text = str(exc)
        url, scheme, service = str(loc), loc.scheme, loc.service
        settings = self._settings_of(loc)

        def usage(message: str) -> StorageError:
            return StorageError(message, url=url, byte_range=byte_range, usage=True)

        status = next((int(g) for m in _STATUS.finditer(text) for g in m.groups() if g), 0)
        if _from_metadata_service(text):
            # no credentials are set, and the cloud's metadata service (where the library looks
            # last) gave none: off the cloud it is not there, or it refuses (HTTP 403, 404)
            how = f"HTTP {status}" if status else "it did not answer"
            return usage(
                f"no {service} credentials found: none are set, and the cloud's "
                f"instance metadata service gave none ({how}); set "
                f"{settings.credentials}"
            )
        if kind == "PreconditionError" or (action == "get" and status == 416):
            return _Changed()
        if kind == "NotFoundError" or status == 404:
            if action == "get":  # it was there when seen: it is gone since
                return _Changed()
            # a listing finds no object missing, only a bucket
            if (
                action == "list"
                or any(w in text for w in _NO_BUCKET_WORDS)
                or (action == "read" and not self._bucket_exists(loc))
            ):
                word = "container" if scheme == "az" else "bucket"
                return usage(
                    f"no such {loc.service} {word} {quote(loc.bucket)} at "
                    f"{settings.where}; check its name, and the endpoint if it is "
                    "not the service's own"
                )
            return usage(
                f"no such object; check the path, or list the folder it should be in ({loc.folder})"
            )
        if kind == "UnauthenticatedError" or any(c in text for c in _CREDENTIAL_CODES):
            return usage(
                f"the {service} credentials in use were refused; check {settings.credentials}"
            )
        if kind == "PermissionDeniedError" or status == 403:
            verb = "list" if action == "list" else "read"
            return usage(
                f"access denied; the credentials in use may not {verb} it; check "
                f"{settings.credentials}"
            )
        if any(w in text for w in _NO_CREDENTIAL_WORDS):
            return usage(f"no {service} credentials found; set {settings.credentials}")
        tries = f"{self.retries + 1} attempt{'s' if self.retries else ''}"
        if status >= 500 or status == 429:
            return StorageError(
                f"the storage service failed {tries} (last: HTTP {status}); it "
                "is failing or overloaded: try again later, or allow more "
                f"retries ({RETRIES_ENV})",
                url=url,
                byte_range=byte_range,
                usage=False,
            )
        if any(w in text for w in _TIMEOUT_WORDS):
            limit = settings.carried.get("timeout")
            limit = f"the time {limit} sets" if limit else f"{self.request_timeout:g} s"
            return StorageError(
                f"the transfer timed out {tries} (a GET must finish within "
                f"{limit}); the network or the endpoint {settings.where} is "
                "failing: try again later",
                url=url,
                byte_range=byte_range,
                usage=False,
            )
        if any(w in text for w in _CONNECT_WORDS):
            return StorageError(
                f"could not connect to the endpoint {settings.where} "
                f"({tries}); check {settings.check}",
                url=url,
                byte_range=byte_range,
                usage=False,
            )
        if 400 <= status < 500:
            return usage(
                f"the service refused the request (HTTP {status}); check the URL and "
                f"the endpoint ({settings.where})"
            )
        return StorageError(
            f"the {service} request failed ({kind}"
            f"{f', HTTP {status}' if status else ''}, {tries}); check the "
            f"endpoint ({settings.where}) and the network",
            url=url,
            byte_range=byte_range,
            usage=False,
        )

    def _bucket_exists(self, loc: ObjectUrl) -> bool:
        """Whether the bucket answers a listing (a 404 on HEAD has no body to say whether the
        object or its bucket is missing). Assumed to exist when that cannot be told."""
        import obstore

        try:
            next(
                iter(obstore.list(self._store(loc), prefix=loc.folder.key or None, chunk_size=1)),
                None,
            )
        except Exception as exc:  # noqa: BLE001 - only a clear "no such bucket" says missing
            return not (
                _library_error(exc) == "NotFoundError"
                or any(w in str(exc) for w in _NO_BUCKET_WORDS)
            )
        return True

    def _call(self, loc: ObjectUrl, action: str, request: Callable[[Any], Any]) -> Any:
        """``request(store)``; a failure as one error (the library has retried it)."""
        store = self._store(loc)
        try:
            return request(store)
        except Exception as exc:
            error = self._error(exc, loc, action)
            if error is exc:
                raise
            if isinstance(error, _Changed):
                error = StorageError(
                    "the service refused the request (a failed precondition); check the URL",
                    url=str(loc),
                    usage=True,
                )
            raise error from None

    def _changed(self, info: ObjectInfo, loc: ObjectUrl) -> FormatError:
        """The error for an object found changed mid-load, saying what it is now."""
        try:
            now = self.head(loc)
        except StorageError as exc:
            how = f"it can no longer be read: {exc.reason.split(';')[0]}; was ETag {info.etag}"
        else:
            if now.etag != info.etag:
                how = f"ETag now {now.etag}, was {info.etag}"
            elif now.size != info.size:
                how = f"size now {now.size}, was {info.size}"
            else:  # it changed and changed back, or the server mis-answered a precondition
                how = f"the server said ETag {info.etag} no longer matched"
        return _changed_error(info, how)

    # -- public: metadata ---------------------------------------------------------------------

    def head(self, url: str | ObjectUrl) -> ObjectInfo:
        """The object's size and identity (a HEAD request)."""
        loc = as_url(url)
        obstore = _obstore(loc)
        if loc.is_folder:
            raise StorageError(
                "names a folder (a key prefix), not an object; name an object in it, or list it",
                url=str(loc),
                usage=True,
            )
        return _info(str(loc), self._call(loc, "read", lambda s: obstore.head(s, loc.key)))

    def check_unchanged(self, info: ObjectInfo) -> None:
        """Refuse (``FormatError``) if the object is no longer the one ``info`` describes: its
        ETag or size differ now."""
        now = self.head(info.url)
        if now.etag != info.etag:
            raise _changed_error(info, f"ETag now {now.etag}, was {info.etag}")
        if now.size != info.size:
            raise _changed_error(info, f"size now {now.size}, was {info.size}")

    def list_folder(self, url: str | ObjectUrl) -> list[ObjectInfo]:
        """The objects directly under a folder prefix (``s3://b/dir/``; ``s3://b/dir`` is taken
        as ``dir/``), sorted by key, not those in sub-folders. A folder with more than
        ``max_folder_objects`` entries (objects and sub-folders) is refused."""
        loc = as_url(url)
        obstore = _obstore(loc)
        folder = ObjectUrl(loc.scheme, loc.bucket, loc.prefix)
        listing = self._call(
            folder, "list", lambda s: obstore.list_with_delimiter(s, prefix=folder.key or None)
        )
        objects = listing.get("objects") or []
        if len(objects) + len(listing.get("common_prefixes") or ()) > self.max_folder_objects:
            raise StorageError(
                f"holds more than {self.max_folder_objects} entries directly "
                "under it; point at the checkpoint's own folder, not a bucket "
                "or a folder of many",
                url=str(folder),
                usage=True,
            )
        out = []
        for meta in objects:
            key = meta.get("path")
            if not isinstance(key, str) or key.endswith("/") or key + "/" == folder.key:
                continue  # a "folder" marker object (the library drops its "/")
            out.append(_info(f"{loc.root}/{key}", meta))
        out.sort(key=lambda i: i.url)
        return out

    # -- public: bytes ------------------------------------------------------------------------

    def get_into(self, info: ObjectInfo, begin: int, buf: Any) -> None:
        """Fill the writable, contiguous buffer ``buf`` (bytearray, memoryview, numpy array:
        anything with the buffer protocol) with bytes ``[begin, begin + len)`` of the object,
        ``len`` being ``buf``'s size in bytes. Read by ranged GETs of at most ``chunk_bytes``,
        ``concurrency`` at once, each streamed straight into its part of ``buf``."""
        view = memoryview(buf)
        if view.readonly:
            raise TypeError("get_into needs a writable buffer")
        if not view.c_contiguous:
            raise ValueError("get_into needs a C-contiguous buffer")
        n = view.nbytes
        begin, end = _check_span((begin, operator.index(begin) + n))
        _check_within(info, begin, end)
        if n == 0:
            return
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        loc = as_url(info.url)

        def work(piece: tuple[int, int], stop: threading.Event, scratch: dict) -> None:
            b, e = piece
            self._get_range(info, loc, b, view[b - begin : e - begin], stop)

        self._run(_pieces([(begin, begin + n)], self.chunk_bytes), work)

    def get_bytes(self, info: ObjectInfo, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the object (for small reads: a header, an index)."""
        begin, end = _check_span((begin, end))
        _check_within(info, begin, end)
        buf = bytearray(end - begin)
        self.get_into(info, begin, buf)
        return bytes(buf)

    def read_capped(
        self, url: str | ObjectUrl, max_bytes: int, refuse: Callable[[int], BaseException]
    ) -> bytes:
        """A small object whole (a plan, a config), its size checked before a byte of it is
        fetched: over ``max_bytes``, ``refuse(size)`` is raised."""
        info = self.head(url)
        if info.size > max_bytes:
            raise refuse(info.size)
        return self.get_bytes(info, 0, info.size)

    def fetch(
        self,
        info: ObjectInfo,
        spans: Iterable[Sequence[int]],
        write: Callable[[int, memoryview], None] | None = None,
        *,
        into: memoryview | None = None,
        small: bool = False,
    ) -> int:
        """Read the ``[begin, end)`` byte ``spans`` of the object, into ``into`` (a writable
        view of the whole object's bytes: each GET lands where its bytes belong, no copy, no
        buffer) or through ``write``.

        The spans are coalesced (``coalesce``, with this client's ``max_gap``), cut into GETs of
        at most ``chunk_bytes``, and run on up to ``concurrency`` threads, at most
        ``concurrency`` GETs in flight in this process whatever the fetches. With ``write``,
        each thread streams its GETs into one reusable buffer of ``chunk_bytes`` and calls
        ``write(offset, view)`` when a GET is complete: ``view`` holds bytes ``[offset, offset
        + len(view))`` of the object, over-read gaps included, and is valid only during the
        call; ``write`` may be called from several threads at once, in any order. The first
        failure (a read, or ``write`` raising) stops the rest and is raised; bytes of ``into``
        a failed GET touched are then not to be read. Returns the bytes fetched, over-read
        included.

        ``small=True`` (with ``into``): a few bytes that opening a checkpoint waits for (a
        header), not one of the ``concurrency`` GETs in flight, which pace a load's data: an
        open fetches many headers at once (``each``), a round trip each, and bounds them
        itself.
        """
        if (write is None) == (into is None):
            raise TypeError("fetch takes one of write and into")
        merged = coalesce(spans, self.max_gap)
        if merged:
            _check_within(info, merged[0][0], merged[-1][1])
        if into is not None and len(into) < info.size:
            raise ValueError(f"into holds {len(into)} bytes, the object {info.size}")
        loc = as_url(info.url)
        pieces = _pieces(merged, self.chunk_bytes)
        capacity = max((e - b for b, e in pieces), default=0)

        def work(piece: tuple[int, int], stop: threading.Event, scratch: dict) -> None:
            b, e = piece
            if into is not None:
                with nullcontext() if small else self._in_flight:
                    self._get_range(info, loc, b, into[b:e], stop)
                return
            buf = scratch.get("buf")
            if buf is None:
                buf = scratch["buf"] = memoryview(bytearray(capacity))
            view = buf[: e - b]
            with self._in_flight:
                self._get_range(info, loc, b, view, stop)
                if stop.is_set():
                    raise _Stopped()
                write(b, view)

        self._run(pieces, work)
        return sum(e - b for b, e in merged)

    # -- the machinery ------------------------------------------------------------------------

    def _run(
        self,
        pieces: list[tuple[int, int]],
        work: Callable[[tuple[int, int], threading.Event, dict], None],
    ) -> None:
        """``work(piece, stop, scratch)`` for every piece, on up to ``concurrency`` threads
        (``scratch``: a dict per thread). The first failure sets ``stop``, the others end at
        their next check, and it is raised once every thread has ended."""
        stop = threading.Event()
        if not pieces:
            return
        if len(pieces) == 1 or self.concurrency == 1:
            scratch: dict = {}
            for piece in pieces:
                work(piece, stop, scratch)
            return
        queue = iter(pieces)
        lock = threading.Lock()
        errors: list[BaseException] = []

        def worker() -> None:
            scratch: dict = {}
            while not stop.is_set():
                with lock:
                    piece = next(queue, None)
                if piece is None:
                    return
                try:
                    work(piece, stop, scratch)
                except _Stopped:
                    return
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    with lock:
                        errors.append(exc)
                    stop.set()
                    return

        threads = [
            threading.Thread(target=worker, name=f"shardload-get-{i}", daemon=True)
            for i in range(min(self.concurrency, len(pieces)))
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # Ctrl-C: stop the others, wait for them, and go
            stop.set()
            for t in threads:
                t.join()
            raise
        if errors:
            raise errors[0]

    def _get_range(
        self, info: ObjectInfo, loc: ObjectUrl, begin: int, view: memoryview, stop: threading.Event
    ) -> None:
        """Fill ``view`` with bytes ``[begin, begin + len(view))``: one ranged GET (which the
        library retries), and, where its body breaks off, GETs of the bytes not yet
        received, up to ``retries`` of them."""
        obstore = _obstore(loc)
        store, n, got, resumed = self._store(loc), len(view), 0, 0
        while True:
            if stop.is_set():
                raise _Stopped()
            lo, hi = begin + got, begin + n
            options: dict[str, Any] = {"range": (lo, hi)}
            if info.etag:
                options["if_match"] = info.etag
            try:
                result = obstore.get(store, loc.key, options=options)
            except Exception as exc:
                error = self._error(exc, loc, "get", (lo, hi))
                if error is exc:
                    raise
                raise (self._changed(info, loc) if isinstance(error, _Changed) else error) from None
            self._check_answer(result, info, lo, hi)
            try:
                for chunk in result.stream(min_chunk_size=1 << 20):
                    if stop.is_set():
                        raise _Stopped()
                    part = memoryview(chunk)
                    k = min(len(part), n - got)
                    view[got : got + k] = part[:k]
                    got += k
                    if k < len(part):
                        raise StorageError(
                            f"the service answered more than the {hi - lo} "
                            "bytes asked for; the endpoint does not serve "
                            "ranged GETs correctly",
                            url=info.url,
                            byte_range=(lo, hi),
                            usage=False,
                        )
            except (StorageError, _Stopped):
                raise
            except Exception as exc:
                if _library_error(exc) is None:
                    raise
                # the body broke off: ask again from the first byte not yet received
            if got == n:
                return
            resumed += 1
            if resumed > self.retries:
                where = self._settings_of(loc).where
                raise StorageError(
                    f"the transfer broke off {resumed} times (the connection "
                    "dropped mid-response); the network or the endpoint "
                    f"{where} is failing: try again later, or "
                    f"allow more retries ({RETRIES_ENV})",
                    url=info.url,
                    byte_range=(begin, begin + n),
                    usage=False,
                )

    def _check_answer(self, result: Any, info: ObjectInfo, lo: int, hi: int) -> None:
        """The GET's answer is the bytes asked for, of the object that was seen."""
        meta = result.meta
        etag = _etag(meta.get("e_tag"))
        if etag and info.etag and etag != info.etag:
            raise _changed_error(info, f"ETag now {etag}, was {info.etag}")
        size = meta.get("size")
        if isinstance(size, int) and size != info.size:
            raise _changed_error(info, f"size now {size}, was {info.size}")
        first, last = result.range
        if (first, last) != (lo, hi):
            raise StorageError(
                f"the service answered bytes [{first}, {last}) to a request "
                f"for [{lo}, {hi}); the endpoint does not serve ranged GETs "
                "correctly",
                url=info.url,
                byte_range=(lo, hi),
                usage=False,
            )


T = TypeVar("T")


def each(
    items: Sequence[T], work: Callable[[T], None], threads: int | None = None
) -> dict[int, BaseException]:
    """``work(item)`` for every item, on up to ``threads`` threads (``OPEN_CONCURRENCY``; the
    items started in their order), for the small requests of an open: each waits a round
    trip, and a checkpoint of 200 files would wait 200 of them in turn (``threads=1``: what
    it did). Returns the failures by the index of their item;
    after the first one no further item starts, and this returns once every thread has ended,
    so nothing is left running. Every item before a failed one was started, so the failure of
    the earliest item is the one a loop in order would have met first."""
    failed: dict[int, BaseException] = {}
    if threads is None:
        threads = OPEN_CONCURRENCY
    if not items:
        return failed
    if len(items) == 1 or threads <= 1:
        for k, item in enumerate(items):
            try:
                work(item)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                failed[k] = exc
                break
        return failed
    queue = iter(enumerate(items))
    lock, stop = threading.Lock(), threading.Event()

    def worker() -> None:
        while True:
            with lock:
                nxt = None if stop.is_set() else next(queue, None)
            if nxt is None:
                return
            k, item = nxt
            try:
                work(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with lock:
                    failed[k] = exc
                stop.set()

    pool = [
        threading.Thread(target=worker, name=f"shardload-open-{i}", daemon=True)
        for i in range(min(threads, len(items)))
    ]
    for t in pool:
        t.start()
    try:
        for t in pool:
            t.join()
    except BaseException:  # Ctrl-C: no further item, wait for those running, and go
        stop.set()
        for t in pool:
            t.join()
        raise
    return failed


def _changed_error(info: ObjectInfo, how: str) -> FormatError:
    return FormatError(
        f"the object changed while loading ({how}); do not replace a checkpoint "
        "while it is loading",
        file=info.url,
    )


def _check_within(info: ObjectInfo, begin: int, end: int) -> None:
    if end > info.size:
        raise ValueError(
            f"bytes [{begin}, {end}) are outside {info.url}, which has {info.size} bytes"
        )


# -------------------------------------------------------------------------------- the default


def _env_number(
    environ: Any,
    name: str,
    default: Any,
    parse: Callable[[str], Any],
    low: float,
    high: float,
    what: str,
) -> Any:
    text = (environ.get(name) or "").strip()
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(
            f"{name}={text!r} is not {what} from {low:g} to {high:g}; set one, or "
            f"unset it for the default ({default})"
        )
    return value


def settings_from_env(environ: Any = None) -> dict:
    """``ObjectClient`` settings from ``$SHARDLOAD_OBJECT_CONCURRENCY`` (default 8),
    ``$SHARDLOAD_OBJECT_CHUNK_MB`` (MiB, default 8), ``$SHARDLOAD_OBJECT_RETRIES`` (default 5)
    and ``$SHARDLOAD_OBJECT_MAX_GAP_KB`` (KiB, default 1024; 0: only the bytes asked for); unset
    or empty means the default. A bad value is a ``ValueError`` naming the variable.

    >>> settings_from_env({"SHARDLOAD_OBJECT_CHUNK_MB": "0.5"})["chunk_bytes"]
    524288
    """
    environ = os.environ if environ is None else environ
    chunk_mb = _env_number(
        environ,
        CHUNK_MB_ENV,
        DEFAULT_CHUNK_BYTES >> 20,
        _positive_float,
        1 / 1024,
        MAX_CHUNK_MB,
        "a number of MiB",
    )
    return {
        "concurrency": _env_number(
            environ, CONCURRENCY_ENV, DEFAULT_CONCURRENCY, int, 1, MAX_CONCURRENCY, "a whole number"
        ),
        "chunk_bytes": int(chunk_mb * (1 << 20)),
        "retries": _env_number(
            environ, RETRIES_ENV, DEFAULT_RETRIES, int, 0, MAX_RETRIES, "a whole number"
        ),
        "max_gap": _env_number(
            environ,
            MAX_GAP_KB_ENV,
            MAX_GAP >> 10,
            int,
            0,
            MAX_CHUNK_MB << 10,
            "a whole number of KiB",
        )
        << 10,
    }


def _positive_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(text)
    return value


_DEFAULT: ObjectClient | None = None
_DEFAULT_LOCK = threading.Lock()
#: the process that first made a store of the library: its runtime lives there, and only
#: there (a child forked from it inherits this value, and is refused: ``ObjectClient``)
_USED_IN: int | None = None


def _mark_used() -> None:
    global _USED_IN
    if _USED_IN is None:
        _USED_IN = os.getpid()


def default_client() -> ObjectClient:
    """The process's client, made on first use with ``settings_from_env()`` (a bad variable
    is a ``ValueError`` naming it). A forked child makes its own stores from it."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ObjectClient(**settings_from_env())
        return _DEFAULT


def _after_fork_in_child() -> None:
    global _DEFAULT_LOCK
    _DEFAULT_LOCK = threading.Lock()
    for client in list(_CLIENTS):
        client._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
