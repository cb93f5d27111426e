"""Object storage: byte ranges of S3 objects, read with botocore.

Everything shardload needs from an S3 endpoint (AWS, or anything that speaks its API: MinIO,
Ceph, R2, moto): ``head`` an object (its size and identity), ``list_folder`` a key prefix, and
read byte ranges of an object, either into a buffer (``get_into``, ``get_bytes``) or as a set of
spans streamed through a callback (``fetch``), on a bounded number of threads with bounded
memory.

* **botocore, lazily.** This module imports only the standard library; botocore is imported when
  the first client is made, i.e. when an ``s3://`` URL is actually used. Without it, one
  ``StorageError`` says ``pip install "shardload[s3]"``. Credentials, region and endpoint come
  from botocore's standard chain: ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``, ``AWS_PROFILE``
  and ``~/.aws``, the environment, container and instance metadata.
* **One identity per object.** ``ObjectInfo.identity`` is ``[etag, size, last_modified]``. Every
  ranged GET carries ``If-Match: <etag>``, and its ``Content-Range`` must name the size that was
  seen: an object replaced while it loads is refused (``FormatError``: "the object changed
  while loading"), as a local file that changes is.
* **Our own retries, resuming.** botocore is configured to try once; a GET that fails on HTTP
  5xx, throttling (``SlowDown``), a connection error, a read timeout or a connection dropped
  mid-body is retried with exponential backoff and jitter, asking only for the bytes not yet
  received, up to ``retries`` times; then one ``StorageError`` naming the URL, the byte range
  and the last cause. Other 4xx answers are not retried. With the connect timeout, the read
  timeout and the retry cap, every failure comes within a bounded time.
* **Messages carry no secret.** Every message is built from error codes and our own words, never
  from a server's body or botocore's text (a ``SignatureDoesNotMatch`` body echoes the access
  key id), and errors are raised ``from None``.
"""

from __future__ import annotations

import operator
import os
import random
import re
import threading
import time
import unicodedata
import weakref
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Optional, Sequence, Union
from urllib.parse import urlsplit, urlunsplit

from ..errors import FormatError, ShardloadError, StorageError, quote

__all__ = [
    "SCHEME",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RETRIES",
    "MAX_GAP",
    "MAX_FOLDER_OBJECTS",
    "MAX_KEY_BYTES",
    "ObjectUrl",
    "ObjectInfo",
    "S3Client",
    "coalesce",
    "default_client",
    "settings_from_env",
]

SCHEME = "s3://"
#: GETs in flight at once per ``fetch``/``get_into`` (``$SHARDLOAD_S3_CONCURRENCY``)
DEFAULT_CONCURRENCY = 8
#: the largest single GET, and the size of each thread's buffer in ``fetch``
#: (``$SHARDLOAD_S3_CHUNK_MB``)
DEFAULT_CHUNK_BYTES = 8 << 20
#: retries of one request after its first attempt (``$SHARDLOAD_S3_RETRIES``)
DEFAULT_RETRIES = 5
#: the largest gap between two wanted spans that ``coalesce`` reads through, and the gap it
#: always reads through (see there)
MAX_GAP = 1 << 20
SMALL_GAP = 64 << 10
#: a folder listing holding more entries than this is refused: a checkpoint is not a bucket
MAX_FOLDER_OBJECTS = 100_000
#: S3's limit on a key, in UTF-8 bytes
MAX_KEY_BYTES = 1024
#: seconds to wait for a connection, and for each read of a response
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0
#: backoff before retry k is about BACKOFF_BASE * 2**(k-1) seconds (half of it jitter), capped
BACKOFF_BASE = 0.1
BACKOFF_CAP = 5.0

#: the environment variables ``default_client`` reads, and their bounds
CONCURRENCY_ENV = "SHARDLOAD_S3_CONCURRENCY"
CHUNK_MB_ENV = "SHARDLOAD_S3_CHUNK_MB"
RETRIES_ENV = "SHARDLOAD_S3_RETRIES"
MAX_GAP_KB_ENV = "SHARDLOAD_S3_MAX_GAP_KB"
MAX_CONCURRENCY = 256
MAX_CHUNK_MB = 1024
MAX_RETRIES = 20

#: a response body is read in slices of at most this, so that no large intermediate ``bytes``
#: is built (urllib3's ``readinto`` reads into a temporary of the slice's size)
_READ_SLICE = 1 << 20
#: keys asked for per ListObjectsV2 page (S3's own maximum)
_LIST_PAGE = 1000

#: error codes that mean "slow down / try again", whatever their HTTP status
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "BandwidthLimitExceeded", "RequestTimeout", "RequestTimeoutException",
    "PriorRequestNotComplete", "InternalError", "ServiceUnavailable",
})
#: error codes that mean the credentials themselves were refused
_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
    "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId", "MissingSecurityHeader",
    "InvalidSecurity", "UnrecognizedClientException", "AuthFailure",
})
_BUCKET_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_BUCKET_CHARS = re.compile(r"[a-z0-9.\-]*")
_IP_LIKE = re.compile(r"\d+\.\d+\.\d+\.\d+")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_SAFE_CODE = re.compile(r"[A-Za-z0-9.]{1,64}")


# ---------------------------------------------------------------------------------------- URLs

def _bucket_problem(bucket: str) -> Optional[str]:
    """Why ``bucket`` is not a valid S3 bucket name (AWS's general-purpose bucket rules), or
    None."""
    if not bucket:
        return "the bucket name is empty"
    name = quote(bucket, 70)
    if not 3 <= len(bucket) <= 63:
        return f"the bucket name {name} is {len(bucket)} characters long (3 to 63)"
    if not _BUCKET_CHARS.fullmatch(bucket):
        bad = next(c for c in bucket if not _BUCKET_CHARS.fullmatch(c))
        return (f"the bucket name {name} holds {quote(bad)}: only lowercase letters, digits, "
                "'.' and '-' are allowed")
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return f"the bucket name {name} must begin and end with a letter or a digit"
    if ".." in bucket:
        return f"the bucket name {name} has two adjacent periods"
    if _IP_LIKE.fullmatch(bucket):
        return f"the bucket name {name} is formatted as an IP address"
    for prefix in _BUCKET_RESERVED_PREFIXES:
        if bucket.startswith(prefix):
            return f"the bucket name {name} starts with the reserved prefix {prefix!r}"
    for suffix in _BUCKET_RESERVED_SUFFIXES:
        if bucket.endswith(suffix):
            return f"the bucket name {name} ends with the reserved suffix {suffix!r}"
    return None


def _key_problem(key: str) -> Optional[str]:
    """Why ``key`` is not a key shardload accepts (valid UTF-8, at most ``MAX_KEY_BYTES``
    bytes, no control character), or None."""
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "the key is not valid Unicode (a lone surrogate)"
    if size > MAX_KEY_BYTES:
        return f"the key is {size} bytes long in UTF-8 (S3 allows at most {MAX_KEY_BYTES})"
    for c in key:
        if unicodedata.category(c) == "Cc":
            return f"the key holds a control character (U+{ord(c):04X})"
    return None


@dataclass(frozen=True)
class ObjectUrl:
    """``s3://bucket/key``: an object, or (``key`` empty or ending in ``/``) a folder prefix.

    >>> u = ObjectUrl.parse("s3://models/llama/")
    >>> u.bucket, u.key, u.is_folder
    ('models', 'llama/', True)
    >>> str(u.join("model.safetensors"))
    's3://models/llama/model.safetensors'
    >>> ObjectUrl.parse("s3://My_Bucket/k")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    shardload.errors.StorageError: s3://My_Bucket/k: not a valid S3 URL: the bucket name ...
    """

    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> "ObjectUrl":
        """``url`` split into bucket and key, checked strictly: the bucket against S3's
        bucket-name rules, the key for length (at most 1024 UTF-8 bytes) and control
        characters. A bad URL is a ``StorageError`` (``usage=True``) saying what is wrong."""
        if not isinstance(url, str):
            raise TypeError(f"an S3 URL is a str, not {type(url).__name__}")

        def bad(why: str) -> StorageError:
            return StorageError(f"not a valid S3 URL: {why}; write it as s3://BUCKET/KEY",
                                url=url, usage=True)

        if not url.startswith(SCHEME):
            raise bad("it does not start with s3:// (lowercase)")
        bucket, _, key = url[len(SCHEME):].partition("/")
        problem = _bucket_problem(bucket) or _key_problem(key)
        if problem:
            raise bad(problem)
        return cls(bucket, key)

    @property
    def is_folder(self) -> bool:
        """True for a folder prefix: the key is empty or ends with ``/``."""
        return not self.key or self.key.endswith("/")

    @property
    def prefix(self) -> str:
        """The key as a folder prefix: ``""``, or the key ending with ``/``."""
        return self.key if self.is_folder else self.key + "/"

    @property
    def folder(self) -> "ObjectUrl":
        """The folder this object is in (a folder prefix is its own folder)."""
        if self.is_folder:
            return self
        head, _, _ = self.key.rpartition("/")
        return ObjectUrl(self.bucket, head + "/" if head else "")

    def join(self, name: str) -> "ObjectUrl":
        """The object ``name`` (a relative path, ``/``-separated) in this folder (a key not
        ending in ``/`` is taken as a folder too). ``.`` and empty components are dropped, as a
        path library would normalise them, since in S3 ``./x`` would be another key; ``..`` is
        refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a member name is a non-empty str, not {quote(name)}")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if not parts or ".." in parts or name.startswith("/"):
            raise StorageError(f"cannot name {quote(name)} in this folder: only plain relative "
                               "paths inside it may be joined", url=str(self), usage=True)
        return ObjectUrl.parse(f"{SCHEME}{self.bucket}/{self.prefix}{'/'.join(parts)}")

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def _as_url(url: Union[str, ObjectUrl]) -> ObjectUrl:
    return url if isinstance(url, ObjectUrl) else ObjectUrl.parse(url)


def _iso(value: Any) -> str:
    """A Last-Modified time as ISO text in UTC, to the second: HEAD says it to the second (an
    HTTP date), a listing to the millisecond, and the two must give the same identity."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc).replace(microsecond=0).isoformat()
    return "" if value is None else str(value)


@dataclass(frozen=True)
class ObjectInfo:
    """An object as ``head`` or ``list_folder`` saw it: its URL, size, ETag (quoted, as S3
    gives it) and Last-Modified time (ISO 8601, UTC, to the second)."""

    url: str
    size: int
    etag: str
    last_modified: str

    @property
    def identity(self) -> list:
        """``[etag, size, last_modified]``: JSON-able, equal exactly when the object is the one
        that was seen (an overwrite changes the ETag and the time)."""
        return [self.etag, self.size, self.last_modified]


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


def coalesce(spans: Iterable[Sequence[int]], max_gap: int = MAX_GAP,
             small_gap: Optional[int] = None) -> list[tuple[int, int]]:
    """``[begin, end)`` byte spans sorted, overlapping and adjacent ones merged, empty ones
    dropped, and two runs of wanted bytes joined across the gap between them when the gap is
    at most ``small_gap`` (default ``SMALL_GAP``, 64 KiB), or at most ``max_gap`` (1 MiB) and
    at most a quarter of the run it joins.

    The bounded over-read rule: every byte asked for is read, and the bytes read that nobody
    asked for are at most 64 KiB per gap read through plus a quarter of the bytes asked for.
    Why read a gap at all: a ranged GET costs a round trip before its first byte (some 10-20 ms
    to S3 in-region), about what transferring 1 MiB costs one connection, so a small gap is
    cheaper read than skipped. Why not every gap under 1 MiB: on a small model the gaps between
    one worker's pieces are other workers' pieces, and reading through them would fetch the
    whole file on every worker.

    >>> coalesce([(10, 20), (0, 5), (5, 8), (21, 30), (100, 110)], max_gap=1)
    [(0, 8), (10, 30), (100, 110)]
    >>> coalesce([(0, 100), (150, 400), (420, 430)], max_gap=1000, small_gap=10)
    [(0, 400), (420, 430)]
    """
    if isinstance(max_gap, bool) or not isinstance(max_gap, int) or max_gap < 0:
        raise ValueError(f"max_gap is a whole number of bytes >= 0, not {quote(max_gap)}")
    small = min(max_gap, SMALL_GAP if small_gap is None else small_gap)
    checked = sorted(s for s in map(_check_span, spans) if s[1] > s[0])
    runs: list[tuple[int, int]] = []   # maximal runs of wanted bytes
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


class _Truncated(Exception):
    """The body ended before the bytes its headers promised."""


@dataclass
class _Verdict:
    """What to make of a failed request: retry it (``cause`` says why it failed, ``kind`` is
    ``server``, ``connect`` or ``transfer``), or raise ``error``."""

    cause: str = ""
    kind: str = "server"
    error: Optional[BaseException] = None


def _safe_code(value: Any) -> str:
    """An error code as our messages may repeat it: a short identifier, else nothing."""
    text = str(value or "")
    return text if _SAFE_CODE.fullmatch(text) else ""


def _safe_endpoint(url: Optional[str]) -> str:
    """An endpoint URL without userinfo, query or fragment (they could carry secrets)."""
    if not url:
        return "the default AWS endpoint"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    except ValueError:
        return "the configured endpoint"


def _os_reason(exc: BaseException) -> str:
    """The operating system's words for the errno behind ``exc`` (e.g. "Connection refused"),
    found through its causes, or ""."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and isinstance(e.errno, int) and e.errno > 0:
            return os.strerror(e.errno)
        kwargs = getattr(e, "kwargs", None)
        stack += [e.__cause__, e.__context__, getattr(e, "reason", None),
                  kwargs.get("error") if isinstance(kwargs, dict) else None]
    return ""


def _botocore_missing(url: str) -> StorageError:
    return StorageError('reading s3:// URLs needs botocore, which is not installed; '
                        'pip install "shardload[s3]"', url=url, usage=True)


# ------------------------------------------------------------------------------------- client

#: every client, so a forked child can give each a fresh lock (one held at the fork would stay
#: held in the child)
_CLIENTS: "weakref.WeakSet[S3Client]" = weakref.WeakSet()


def _whole(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} is a whole number {bound}, not {quote(value)}")
    return value


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 3600:
        raise ValueError(f"{name} is a number of seconds from 0 to 3600, not {quote(value)}")
    return float(value)


class S3Client:
    """Reads S3 objects by byte range. One per process (``default_client``) is the norm.

    The botocore client is made lazily, on first use, and made again in a child process after a
    fork (checked with ``os.getpid()``): a client and its connection pool are never shared
    across processes. Every method is thread-safe (botocore clients are).

    ``concurrency`` GETs run at once in ``fetch`` and ``get_into``, each of at most
    ``chunk_bytes``; ``retries`` retries follow a failed request's first attempt, after
    ``backoff * 2**(k-1)`` seconds (half of it jitter, capped at ``backoff_cap``).
    ``endpoint_url`` and ``region`` override botocore's chain (``AWS_ENDPOINT_URL``,
    ``AWS_REGION``), which is used when they are None.
    """

    def __init__(self, *, concurrency: int = DEFAULT_CONCURRENCY,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, retries: int = DEFAULT_RETRIES,
                 max_gap: int = MAX_GAP, backoff: float = BACKOFF_BASE,
                 backoff_cap: float = BACKOFF_CAP, connect_timeout: float = CONNECT_TIMEOUT,
                 read_timeout: float = READ_TIMEOUT, endpoint_url: Optional[str] = None,
                 region: Optional[str] = None,
                 max_folder_objects: int = MAX_FOLDER_OBJECTS):
        self.concurrency = _whole("concurrency", concurrency, 1, MAX_CONCURRENCY)
        self.chunk_bytes = _whole("chunk_bytes", chunk_bytes, 1)
        self.retries = _whole("retries", retries, 0, MAX_RETRIES)
        self.max_gap = _whole("max_gap", max_gap, 0)
        self.backoff = _seconds("backoff", backoff)
        self.backoff_cap = _seconds("backoff_cap", backoff_cap)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout) or CONNECT_TIMEOUT
        self.read_timeout = _seconds("read_timeout", read_timeout) or READ_TIMEOUT
        self.endpoint_url = endpoint_url
        self.region = region
        self.max_folder_objects = _whole("max_folder_objects", max_folder_objects, 1)
        self._lock = threading.Lock()
        # GETs in flight in this process, whichever fetch they serve (the workers of a
        # ThreadedSession fetch at once): at most `concurrency`, so memory stays chunk x that
        self._in_flight = threading.BoundedSemaphore(self.concurrency)
        self._client_obj: Any = None
        self._pid: Optional[int] = None
        _CLIENTS.add(self)

    def __repr__(self) -> str:
        return (f"S3Client(concurrency={self.concurrency}, chunk_bytes={self.chunk_bytes}, "
                f"retries={self.retries})")

    # -- the botocore client ------------------------------------------------------------------

    def _client(self, url: str) -> Any:
        client, pid = self._client_obj, os.getpid()
        if client is not None and self._pid == pid:
            return client
        with self._lock:
            if self._client_obj is None or self._pid != pid:
                self._client_obj = self._make_client(url)
                self._pid = pid
            return self._client_obj

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        # GETs in flight in this process, whichever fetch they serve (the workers of a
        # ThreadedSession fetch at once): at most `concurrency`, so memory stays chunk x that
        self._in_flight = threading.BoundedSemaphore(self.concurrency)
        self._client_obj = None  # the parent's pool: dropped, never closed or used here
        self._pid = None

    def _make_client(self, url: str) -> Any:
        try:
            import botocore.session
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError
        except ImportError:
            raise _botocore_missing(url) from None
        config = Config(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                        retries={"total_max_attempts": 1, "mode": "standard"},
                        max_pool_connections=max(64, 4 * self.concurrency),
                        user_agent_extra="shardload")
        try:
            return botocore.session.Session().create_client(
                "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)
        except BotoCoreError as exc:
            verdict = self._judge(exc, url, None, "read", None)
            raise (verdict.error if verdict and verdict.error else StorageError(
                f"botocore could not make an S3 client ({type(exc).__name__}); check the AWS "
                "configuration (AWS_PROFILE, AWS_REGION, ~/.aws/config)", url=url,
                usage=True)) from None
        except ValueError:  # botocore: "Invalid endpoint: ..."
            endpoint = quote(_safe_endpoint(self._configured_endpoint()))
            raise StorageError(f"the S3 endpoint URL {endpoint} is not a valid URL; check "
                               "AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3)", url=url,
                               usage=True) from None

    def _configured_endpoint(self) -> Optional[str]:
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))

    def _endpoint(self) -> str:
        client = self._client_obj
        try:
            url = client.meta.endpoint_url if client is not None else None
        except AttributeError:
            url = None
        return _safe_endpoint(url or self._configured_endpoint())

    # -- judging failures -------------------------------------------------------------------

    def _judge(self, exc: BaseException, url: str, byte_range: Optional[tuple[int, int]],
               action: str, loc: Optional[ObjectUrl]) -> Optional[_Verdict]:
        """A failed request's verdict (retry, or the error to raise), or None when ``exc`` is
        not a storage failure (a bug: raised as it is). ``action`` is ``read`` or ``list``."""
        import botocore.exceptions as bx

        def usage(message: str) -> _Verdict:
            return _Verdict(error=StorageError(message, url=url, byte_range=byte_range,
                                               usage=True))

        if isinstance(exc, bx.ClientError):
            return self._judge_answer(exc, url, byte_range, action, loc)
        if isinstance(exc, bx.NoCredentialsError):
            return usage("no AWS credentials found (environment, ~/.aws, instance metadata); "
                         "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
        if isinstance(exc, bx.PartialCredentialsError):
            return usage("incomplete AWS credentials (an access key id without its secret, or "
                         "the reverse); set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                         "or AWS_PROFILE")
        if isinstance(exc, bx.ProfileNotFound):
            return usage("the AWS profile named (AWS_PROFILE) is not in ~/.aws/config or "
                         "~/.aws/credentials; check AWS_PROFILE")
        if isinstance(exc, (getattr(bx, "TokenRetrievalError", ()),
                            getattr(bx, "SSOTokenLoadError", ()),
                            getattr(bx, "UnauthorizedSSOTokenError", ()))):
            return usage("the AWS SSO session could not be used (expired or never logged in); "
                         "run `aws sso login` or set other credentials")
        if isinstance(exc, bx.CredentialRetrievalError):
            return usage("the AWS credential provider configured failed to give credentials; "
                         "check the profile's credential_process or role settings, or set "
                         "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        if isinstance(exc, bx.SSLError):
            return usage(f"the TLS connection to {self._endpoint()} failed (a certificate not "
                         "trusted, or not a TLS endpoint); check AWS_ENDPOINT_URL and "
                         "AWS_CA_BUNDLE")
        if isinstance(exc, (bx.ConnectTimeoutError,)):
            return _Verdict(f"no connection within {self.connect_timeout:g} s", "connect")
        if isinstance(exc, (bx.EndpointConnectionError, bx.ProxyConnectionError)):
            return _Verdict(_os_reason(exc) or "the connection failed", "connect")
        if isinstance(exc, bx.ReadTimeoutError):
            return _Verdict(f"no data within {self.read_timeout:g} s (read timeout)", "transfer")
        if isinstance(exc, (bx.ResponseStreamingError, bx.IncompleteReadError,
                            bx.ConnectionClosedError, _Truncated)):
            return _Verdict("the connection dropped mid-response", "transfer")
        if isinstance(exc, bx.HTTPClientError):
            return _Verdict(_os_reason(exc) or f"a transport error ({type(exc).__name__})",
                            "transfer")
        if _is_transport_error(exc):
            return _Verdict(_os_reason(exc) or "the connection dropped mid-response",
                            "transfer")
        if isinstance(exc, bx.BotoCoreError):
            return _Verdict(error=StorageError(
                f"botocore failed ({type(exc).__name__}); check the AWS configuration "
                "(AWS_PROFILE, AWS_REGION, AWS_ENDPOINT_URL)", url=url, byte_range=byte_range,
                usage=False))
        return None

    def _judge_answer(self, exc: Any, url: str, byte_range: Optional[tuple[int, int]],
                      action: str, loc: Optional[ObjectUrl]) -> _Verdict:
        """The verdict on an error answer from the server (botocore's ``ClientError``)."""
        response = getattr(exc, "response", None) or {}
        error = response.get("Error") or {}
        meta = response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        status = status if isinstance(status, int) else 0
        code = _safe_code(error.get("Code"))
        said = f"HTTP {status} {code}" if code and code != str(status) else f"HTTP {status}"
        what = f"({code})" if code and code != str(status) else f"(HTTP {status})"

        def usage(message: str) -> _Verdict:
            return _Verdict(error=StorageError(message, url=url, byte_range=byte_range,
                                               usage=True))

        if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return _Verdict(said, "server")
        permission = "s3:ListBucket" if action == "list" else "s3:GetObject"
        bucket = loc.bucket if loc is not None else ""
        no_bucket = usage(f"no such bucket {quote(bucket)} (NoSuchBucket) at "
                          f"{self._endpoint()}; check the bucket name, and AWS_ENDPOINT_URL if "
                          "it is not on AWS")
        if code == "NoSuchBucket":
            return no_bucket
        if code == "NoSuchKey" or (status == 404 and action != "list"):
            if action == "get":  # it was there when seen: it is gone since
                return _Verdict(error=_ChangedMarker())
            if code != "NoSuchKey" and loc is not None and not self._bucket_exists(loc):
                return no_bucket  # HEAD's 404 has no body to say which is missing
            folder = str(loc.folder) if loc is not None else url
            return usage(f"no such key (NoSuchKey); check the path, or list it with "
                         f"`aws s3 ls {folder}`")
        if code in _CREDENTIAL_CODES:
            return usage(f"the AWS credentials in use were refused {what}; check "
                         "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) or "
                         "AWS_PROFILE")
        if code == "RequestTimeTooSkewed":
            return usage(f"this machine's clock is too far from the server's {what}; set the "
                         "clock right (NTP)")
        if code in ("PermanentRedirect", "AuthorizationHeaderMalformed") or status == 301:
            return usage(f"the bucket is in another region than the one in use {what}; set "
                         "AWS_REGION (or AWS_DEFAULT_REGION) to the bucket's region")
        if code == "InvalidObjectState":
            return usage(f"the object is archived {what}: Glacier or Deep Archive; restore it "
                         "before loading")
        if status == 403 or code in ("AccessDenied", "AllAccessDisabled", "403"):
            hint = " (or, without s3:ListBucket, the key may not exist)" \
                if action != "list" else ""
            return usage(f"access denied {what}; the credentials in use may not "
                         f"{'list' if action == 'list' else 'read'} it ({permission}){hint}")
        if status == 412 or code == "PreconditionFailed":
            return _Verdict(error=_ChangedMarker())
        if status == 416 or code == "InvalidRange":
            return _Verdict(error=_ChangedMarker())
        return _Verdict(error=StorageError(
            f"the server refused the request {what}; check the URL and the endpoint "
            f"({self._endpoint()})", url=url, byte_range=byte_range,
            usage=400 <= status < 500))

    def _bucket_exists(self, loc: ObjectUrl) -> bool:
        """Whether the bucket answers HEAD (a 404 on HEAD object does not say which is
        missing). Assumed to exist when that cannot be told."""
        try:
            self._client(str(loc)).head_bucket(Bucket=loc.bucket)
        except Exception as exc:  # noqa: BLE001 - only a clear 404 says "missing"
            response = getattr(exc, "response", None) or {}
            return (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") != 404
        return True

    def _exhausted(self, url: str, byte_range: Optional[tuple[int, int]], attempts: int,
                   verdict: _Verdict) -> StorageError:
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        if verdict.kind == "connect":
            message = (f"could not connect to the endpoint {self._endpoint()} ({verdict.cause}; "
                       f"{tries}); check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and the "
                       "network")
        elif verdict.kind == "transfer":
            message = (f"the transfer failed {tries} (last: {verdict.cause}); the network or "
                       f"the endpoint {self._endpoint()} is failing: try again later, or allow "
                       f"more retries ({RETRIES_ENV})")
        else:
            message = (f"the storage service failed {tries} (last: {verdict.cause}); it is "
                       f"failing or overloaded: try again later, or allow more retries "
                       f"({RETRIES_ENV})")
        return StorageError(message, url=url, byte_range=byte_range, usage=False)

    def _pause(self, attempt: int, stop: Optional[threading.Event]) -> None:
        delay = min(self.backoff_cap, self.backoff * 2 ** (attempt - 1))
        delay *= 0.5 + 0.5 * random.random()
        if stop is not None:
            if stop.wait(delay):
                raise _Stopped()
        elif delay > 0:
            time.sleep(delay)

    def _call(self, loc: ObjectUrl, action: str, request: Callable[[Any], Any]) -> Any:
        """``request(botocore_client)``, retried as the rules say; failures as errors."""
        url = str(loc)
        attempt = 0
        while True:
            client = self._client(url)
            try:
                return request(client)
            except ShardloadError:
                raise
            except Exception as exc:
                verdict = self._judge(exc, url, None, action, loc)
                if verdict is None:
                    raise
                if isinstance(verdict.error, _ChangedMarker):
                    verdict = _Verdict(error=StorageError(
                        "the server refused the request (a failed precondition); check the "
                        "URL", url=url, usage=True))
                if verdict.error is not None:
                    raise verdict.error from None
            attempt += 1
            if attempt > self.retries:
                raise self._exhausted(url, None, attempt, verdict) from None
            self._pause(attempt, None)

    def _changed(self, info: ObjectInfo, loc: ObjectUrl) -> FormatError:
        """The error for an object found changed mid-load, saying what it is now."""
        try:
            now = self.head(loc)
        except StorageError as exc:
            how = (f"it can no longer be read: {exc.reason.split(';')[0]}; "
                   f"was ETag {info.etag}")
        else:
            if now.etag != info.etag:
                how = f"ETag now {now.etag}, was {info.etag}"
            elif now.size != info.size:
                how = f"size now {now.size}, was {info.size}"
            else:  # it changed and changed back, or the server mis-answered a precondition
                how = f"the server said ETag {info.etag} no longer matched"
        return _changed_error(info, how)

    # -- public: metadata ---------------------------------------------------------------------

    def head(self, url: Union[str, ObjectUrl]) -> ObjectInfo:
        """The object's size and identity (a HEAD request)."""
        loc = _as_url(url)
        if loc.is_folder:
            raise StorageError("names a folder (a key prefix), not an object; name an object "
                               "in it, or list it", url=str(loc), usage=True)
        resp = self._call(loc, "read", lambda c: c.head_object(Bucket=loc.bucket, Key=loc.key))
        size = resp.get("ContentLength")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise StorageError("the server's answer to HEAD has no valid Content-Length; the "
                               f"endpoint {self._endpoint()} does not speak S3 as expected",
                               url=str(loc), usage=False)
        return ObjectInfo(str(loc), size, str(resp.get("ETag") or ""),
                          _iso(resp.get("LastModified")))

    def check_unchanged(self, info: ObjectInfo) -> None:
        """Refuse (``FormatError``) if the object is no longer the one ``info`` describes: its
        ETag or size differ now."""
        now = self.head(info.url)
        if now.etag != info.etag:
            raise _changed_error(info, f"ETag now {now.etag}, was {info.etag}")
        if now.size != info.size:
            raise _changed_error(info, f"size now {now.size}, was {info.size}")

    def list_folder(self, url: Union[str, ObjectUrl]) -> list[ObjectInfo]:
        """The objects directly under a folder prefix (``s3://b/dir/``; ``s3://b/dir`` is taken
        as ``dir/``), sorted by key, not those in sub-folders. A folder with more than
        ``max_folder_objects`` entries (objects and sub-folders) is refused."""
        loc = _as_url(url)
        folder = ObjectUrl(loc.bucket, loc.prefix)
        out: list[ObjectInfo] = []
        entries = 0
        token: Optional[str] = None
        while True:
            args = {"Bucket": loc.bucket, "Prefix": folder.key, "Delimiter": "/",
                    "MaxKeys": _LIST_PAGE}
            if token:
                args["ContinuationToken"] = token
            page = self._call(folder, "list", lambda c, a=args: c.list_objects_v2(**a))
            contents = page.get("Contents") or ()
            entries += len(contents) + len(page.get("CommonPrefixes") or ())
            if entries > self.max_folder_objects:
                raise StorageError(f"holds more than {self.max_folder_objects} entries directly "
                                   "under it; point at the checkpoint's own folder, not a "
                                   "bucket or a folder of many", url=str(folder), usage=True)
            for item in contents:
                key = item.get("Key")
                if not isinstance(key, str) or key == folder.key:  # a "folder" marker object
                    continue
                out.append(ObjectInfo(f"{SCHEME}{loc.bucket}/{key}", int(item.get("Size") or 0),
                                      str(item.get("ETag") or ""),
                                      _iso(item.get("LastModified"))))
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
            if not token:
                raise StorageError("the listing was cut short without a continuation token; "
                                   f"the endpoint {self._endpoint()} does not speak "
                                   "ListObjectsV2 as expected", url=str(folder), usage=False)
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
        loc = ObjectUrl.parse(info.url)

        def work(piece: tuple[int, int], stop: threading.Event, scratch: dict) -> None:
            b, e = piece
            self._get_range(info, loc, b, view[b - begin:e - begin], stop)

        self._run(_pieces([(begin, begin + n)], self.chunk_bytes), work)

    def get_bytes(self, info: ObjectInfo, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the object (for small reads: a header, an index)."""
        begin, end = _check_span((begin, end))
        _check_within(info, begin, end)
        buf = bytearray(end - begin)
        self.get_into(info, begin, buf)
        return bytes(buf)

    def read_capped(self, url: Union[str, ObjectUrl], max_bytes: int,
                    refuse: Callable[[int], BaseException]) -> bytes:
        """A small object whole (a plan, a config), its size checked before a byte of it is
        fetched: over ``max_bytes``, ``refuse(size)`` is raised."""
        info = self.head(url)
        if info.size > max_bytes:
            raise refuse(info.size)
        return self.get_bytes(info, 0, info.size)

    def fetch(self, info: ObjectInfo, spans: Iterable[Sequence[int]],
              write: Callable[[int, memoryview], None]) -> int:
        """Read the ``[begin, end)`` byte ``spans`` of the object, and hand them to ``write``.

        The spans are coalesced (``coalesce``, with this client's ``max_gap``), cut into GETs of
        at most ``chunk_bytes``, and run on up to ``concurrency`` threads. Each thread streams
        its GETs into one reusable buffer of ``chunk_bytes`` and calls ``write(offset, view)``
        when a GET is complete: ``view`` holds bytes ``[offset, offset + len(view))`` of the
        object, over-read gaps included, and is valid only during the call. ``write`` may be
        called from several threads at once, in any order. Memory is bounded by ``chunk_bytes
        * concurrency``. The first failure (a read, or ``write`` raising) stops the rest and is
        raised. Returns the bytes fetched, over-read included.
        """
        merged = coalesce(spans, self.max_gap)
        if merged:
            _check_within(info, merged[0][0], merged[-1][1])
        loc = ObjectUrl.parse(info.url)
        pieces = _pieces(merged, self.chunk_bytes)
        capacity = max((e - b for b, e in pieces), default=0)

        def work(piece: tuple[int, int], stop: threading.Event, scratch: dict) -> None:
            b, e = piece
            buf = scratch.get("buf")
            if buf is None:
                buf = scratch["buf"] = memoryview(bytearray(capacity))
            view = buf[:e - b]
            with self._in_flight:
                self._get_range(info, loc, b, view, stop)
                if stop.is_set():
                    raise _Stopped()
                write(b, view)

        self._run(pieces, work)
        return sum(e - b for b, e in merged)

    # -- the machinery ------------------------------------------------------------------------

    def _run(self, pieces: list[tuple[int, int]],
             work: Callable[[tuple[int, int], threading.Event, dict], None]) -> None:
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

        threads = [threading.Thread(target=worker, name=f"shardload-s3-{i}", daemon=True)
                   for i in range(min(self.concurrency, len(pieces)))]
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

    def _get_range(self, info: ObjectInfo, loc: ObjectUrl, begin: int, view: memoryview,
                   stop: threading.Event) -> None:
        """Fill ``view`` with bytes ``[begin, begin + len(view))``: one ranged GET, retried as
        the rules say, each retry asking only for the bytes not yet received."""
        url = info.url
        n = len(view)
        got = 0
        attempt = 0
        while True:
            if stop.is_set():
                raise _Stopped()
            lo, hi = begin + got, begin + n
            client = self._client(url)
            args = {"Bucket": loc.bucket, "Key": loc.key, "Range": f"bytes={lo}-{hi - 1}"}
            if info.etag:
                args["IfMatch"] = info.etag
            try:
                resp = client.get_object(**args)
                body = resp["Body"]
                try:
                    self._check_answer(resp, info, lo, hi)
                    readinto = getattr(body, "readinto", None)
                    while got < n:
                        if stop.is_set():
                            raise _Stopped()
                        part = view[got:got + min(_READ_SLICE, n - got)]
                        k = readinto(part) if readinto is not None else _read_into(body, part)
                        if not k:
                            raise _Truncated()
                        got += k
                finally:
                    body.close()
                return
            except (ShardloadError, _Stopped):
                raise
            except Exception as exc:
                verdict = self._judge(exc, url, (begin, begin + n), "get", loc)
                if verdict is None:
                    raise
                if isinstance(verdict.error, _ChangedMarker):
                    raise self._changed(info, loc) from None
                if verdict.error is not None:
                    raise verdict.error from None
            attempt += 1
            if attempt > self.retries:
                raise self._exhausted(url, (begin, begin + n), attempt, verdict) from None
            self._pause(attempt, stop)

    def _check_answer(self, resp: dict, info: ObjectInfo, lo: int, hi: int) -> None:
        """The GET's answer is the bytes asked for, of the object that was seen."""
        etag = resp.get("ETag")
        if etag and info.etag and etag != info.etag:
            raise _changed_error(info, f"ETag now {etag}, was {info.etag}")
        content_range = resp.get("ContentRange")
        m = _CONTENT_RANGE.fullmatch(content_range.strip()) if content_range else None
        if m:
            first, last, total = int(m[1]), int(m[2]), m[3]
            if total != "*" and int(total) != info.size:
                raise _changed_error(info, f"size now {total}, was {info.size}")
            if (first, last + 1) != (lo, hi):
                raise StorageError(f"the server answered bytes [{first}, {last + 1}) to a "
                                   f"request for [{lo}, {hi}); the endpoint "
                                   f"{self._endpoint()} does not serve ranged GETs correctly",
                                   url=info.url, byte_range=(lo, hi), usage=False)
        elif not (lo == 0 and hi == info.size):
            raise StorageError("the server answered a ranged GET without a Content-Range (it "
                               f"ignored the range); the endpoint {self._endpoint()} must "
                               "serve ranged GETs", url=info.url, byte_range=(lo, hi),
                               usage=False)
        length = resp.get("ContentLength")
        if isinstance(length, int) and length != hi - lo:
            raise StorageError(f"the server answered {length} bytes to a request for "
                               f"{hi - lo}; the endpoint {self._endpoint()} does not serve "
                               "ranged GETs correctly", url=info.url, byte_range=(lo, hi),
                               usage=False)


class _ChangedMarker(Exception):
    """A verdict's stand-in for "the object changed": the caller builds the real error (it
    needs a HEAD to say what the object is now)."""


def _changed_error(info: ObjectInfo, how: str) -> FormatError:
    return FormatError(f"the object changed while loading ({how}); do not replace a checkpoint "
                       "while it is loading", file=info.url)


def _check_within(info: ObjectInfo, begin: int, end: int) -> None:
    if end > info.size:
        raise ValueError(f"bytes [{begin}, {end}) are outside {info.url}, which has "
                         f"{info.size} bytes")


def _read_into(body: Any, view: memoryview) -> int:
    """``body.readinto(view)`` for bodies without ``readinto`` (older botocore)."""
    data = body.read(len(view))
    view[:len(data)] = data
    return len(data)


def _is_transport_error(exc: BaseException) -> bool:
    """A connection-level failure raised past botocore (urllib3's, http.client's, a socket's)."""
    import http.client

    if isinstance(exc, (http.client.IncompleteRead, http.client.HTTPException, OSError)):
        return True
    try:
        import urllib3.exceptions as ux
    except ImportError:  # pragma: no cover - botocore depends on urllib3
        return False
    return isinstance(exc, (ux.ProtocolError, ux.ReadTimeoutError, ux.TimeoutError))


# ------------------------------------------------------------------------- the default client

_DEFAULT: Optional[S3Client] = None
_DEFAULT_LOCK = threading.Lock()


def _env_number(environ: Any, name: str, default: Any, parse: Callable[[str], Any],
                low: float, high: float, what: str) -> Any:
    text = (environ.get(name) or "").strip()
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ValueError(f"{name}={text!r} is not {what} from {low:g} to {high:g}; set one, or "
                         f"unset it for the default ({default})")
    return value


def settings_from_env(environ: Any = None) -> dict:
    """``S3Client`` settings from ``$SHARDLOAD_S3_CONCURRENCY`` (default 8),
    ``$SHARDLOAD_S3_CHUNK_MB`` (MiB, default 8), ``$SHARDLOAD_S3_RETRIES`` (default 5) and
    ``$SHARDLOAD_S3_MAX_GAP_KB`` (KiB, default 1024; 0: only the bytes asked for); unset or
    empty means the default. A bad value is a ``ValueError`` naming the variable.

    >>> settings_from_env({"SHARDLOAD_S3_CHUNK_MB": "0.5"})["chunk_bytes"]
    524288
    """
    environ = os.environ if environ is None else environ
    chunk_mb = _env_number(environ, CHUNK_MB_ENV, DEFAULT_CHUNK_BYTES >> 20, _positive_float,
                           1 / 1024, MAX_CHUNK_MB, "a number of MiB")
    return {
        "concurrency": _env_number(environ, CONCURRENCY_ENV, DEFAULT_CONCURRENCY, int, 1,
                                   MAX_CONCURRENCY, "a whole number"),
        "chunk_bytes": int(chunk_mb * (1 << 20)),
        "retries": _env_number(environ, RETRIES_ENV, DEFAULT_RETRIES, int, 0, MAX_RETRIES,
                               "a whole number"),
        "max_gap": _env_number(environ, MAX_GAP_KB_ENV, MAX_GAP >> 10, int, 0,
                               MAX_CHUNK_MB << 10, "a whole number of KiB") << 10,
    }


def _positive_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(text)
    return value


def default_client() -> S3Client:
    """The process's S3 client, made on first use with ``settings_from_env()`` (a bad variable
    is a ``ValueError`` naming it). A forked child gets its own botocore client from it."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = S3Client(**settings_from_env())
        return _DEFAULT


def _after_fork_in_child() -> None:
    global _DEFAULT_LOCK
    _DEFAULT_LOCK = threading.Lock()
    for client in list(_CLIENTS):
        client._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
