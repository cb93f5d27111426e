"""Object storage: byte ranges of objects in S3, Google Cloud Storage or Azure Blob Storage,
read through obstore.

Everything shardload needs from object storage: ``head`` an object (its size and identity),
``list_folder`` a key prefix, and read byte ranges of an object, into a buffer (``get_into``,
``get_bytes``) or as spans of a whole object's buffer (``fetch``), on a bounded number of
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
* **Bounded memory and threads.** At most ``concurrency`` GETs of at most ``chunk_bytes`` in
  flight per process, each streamed straight into its place, on one long-lived pool of
  threads per client (``store_pool``).
* **Messages carry no secret.** Every message is built from our own words, the URL and
  status codes, never the library's error text (it can hold a signed URL), and errors are
  raised ``from None`` (``store_errors``).

Its setup (defaults, ``settings_from_env``, the library's stores) is ``store_config``.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

from ..errors import FormatError, StorageError
from .settings import StoreSettings, default_settings
from .store_config import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    CONNECT_TIMEOUT,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CONCURRENCY,
    DEFAULT_RETRIES,
    MAX_CONCURRENCY,
    MAX_GAP,
    MAX_RETRIES,
    REQUEST_TIMEOUT,
    RETRIES_ENV,
    make_store,
    require_obstore,
    seconds_arg,
    settings_from_env,
    whole_arg,
)
from .store_errors import (
    Action,
    Changed,
    Stopped,
    Verdict,
    changed_error,
    is_library_error,
    no_bucket,
    verdict,
)
from .store_info import ObjectInfo, etag, info_from_meta
from .store_pool import WorkPool
from .store_spans import check_span, check_within, coalesce, pieces
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
    "reset_default_client",
    "settings_from_env",
    "use_client",
]

#: the small requests opening a checkpoint makes at once (``each``: headers, side files)
OPEN_CONCURRENCY = 32
#: a folder listing holding more entries than this is refused: a checkpoint is not a bucket
MAX_FOLDER_OBJECTS = 100_000

# ------------------------------------------------------------------------------------- client

#: every client, so that a forked child makes its own stores and locks
_CLIENTS: weakref.WeakSet[ObjectClient] = weakref.WeakSet()
#: the pool ``each`` runs on, shared by every open in the process
_OPEN_POOL = WorkPool(OPEN_CONCURRENCY, "shardload-open")


class ObjectClient:
    """Reads objects by byte range, from any scheme. One per process (``default_client``).

    A store of the library is made per bucket on first use. The library's runtime (threads,
    connections) does not survive ``fork``: a process forked after its parent used object
    storage is refused (``StorageError``, at once) rather than left to hang; worker processes
    are started fresh (``ProcessSession``'s fork server, ``spawn``), never forked from a
    process that read objects.

    At most ``concurrency`` GETs are in flight at once per process and client (``get_into``,
    ``fetch``: whatever the calls, from whatever threads), each of at most ``chunk_bytes``,
    run on the client's one pool of ``concurrency`` threads (``close`` ends them); the
    library retries a failed request ``retries`` times after ``backoff * 2**(k-1)`` seconds
    (capped at ``backoff_cap``), and a body dropped mid-transfer is resumed as often.
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
        self.concurrency = whole_arg("concurrency", concurrency, 1, MAX_CONCURRENCY)
        self.chunk_bytes = whole_arg("chunk_bytes", chunk_bytes, 1)
        self.retries = whole_arg("retries", retries, 0, MAX_RETRIES)
        self.max_gap = whole_arg("max_gap", max_gap, 0)
        self.backoff = seconds_arg("backoff", backoff)
        self.backoff_cap = seconds_arg("backoff_cap", backoff_cap)
        self.connect_timeout = seconds_arg("connect_timeout", connect_timeout) or CONNECT_TIMEOUT
        self.request_timeout = seconds_arg("request_timeout", request_timeout) or REQUEST_TIMEOUT
        self.max_folder_objects = whole_arg("max_folder_objects", max_folder_objects, 1)
        self._pool = WorkPool(self.concurrency, "shardload-get")
        self._after_fork()
        _CLIENTS.add(self)

    def __repr__(self) -> str:
        return (
            f"ObjectClient(concurrency={self.concurrency}, chunk_bytes={self.chunk_bytes}, "
            f"retries={self.retries})"
        )

    def close(self) -> None:
        """End the client's threads once idle (also done at exit); a later read starts new
        ones."""
        self._pool.close()

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        # GETs in flight in this process, whichever call they serve (the workers of a
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
                self._stores[loc.root], self._settings[loc.root] = make_store(loc, self)
            return self._stores[loc.root]

    def _settings_of(self, loc: ObjectUrl) -> StoreSettings:
        """The settings ``loc``'s store was made with, for messages."""
        return self._settings.get(loc.root) or default_settings(loc.scheme)

    # -- judging failures ---------------------------------------------------------------------

    def _error(
        self,
        exc: BaseException,
        loc: ObjectUrl,
        action: Action,
        byte_range: tuple[int, int] | None = None,
    ) -> BaseException:
        """The error to raise for the library's ``exc``: a ``StorageError``, or ``Changed``
        mid-load; any other exception is returned as it is (a bug: raised unchanged)."""
        if not is_library_error(exc):
            return exc
        said = self._verdict(exc, loc, action)
        return said if isinstance(said, Changed) else said.error(str(loc), byte_range)

    def _verdict(self, exc: BaseException, loc: ObjectUrl, action: Action) -> Verdict | Changed:
        """``store_errors.verdict`` with this client's settings."""
        return verdict(
            exc,
            loc,
            action,
            self._settings_of(loc),
            self.retries,
            self.request_timeout,
            lambda: self._bucket_exists(loc),
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
            return not no_bucket(exc)
        return True

    def _call(self, loc: ObjectUrl, action: Action, request: Callable[[Any], Any]) -> Any:
        """``request(store)``; a failure as one error (the library has retried it)."""
        store = self._store(loc)
        try:
            return request(store)
        except Exception as exc:
            error = self._error(exc, loc, action)
            if error is exc:
                raise
            if isinstance(error, Changed):
                error = StorageError(
                    "the service refused the request (a failed precondition); check the URL",
                    url=str(loc),
                    usage=True,
                )
            raise error from None

    def _changed(self, info: ObjectInfo, loc: ObjectUrl) -> FormatError:
        """The error for an object found changed mid-load, saying what it is now."""
        obstore = require_obstore(loc)
        try:
            meta = obstore.head(self._store(loc), loc.key)
        except Exception as exc:
            if not is_library_error(exc):
                raise
            said = self._verdict(exc, loc, "read")
            what = "it changed again" if isinstance(said, Changed) else said.what
            how = f"it can no longer be read: {what}; was ETag {info.etag}"
        else:
            now = info_from_meta(info.url, meta)
            if now.etag != info.etag:
                how = f"ETag now {now.etag}, was {info.etag}"
            elif now.size != info.size:
                how = f"size now {now.size}, was {info.size}"
            else:  # it changed and changed back, or the server mis-answered a precondition
                how = f"the server said ETag {info.etag} no longer matched"
        return changed_error(info.url, how)

    # -- public: metadata ---------------------------------------------------------------------

    def head(self, url: str | ObjectUrl) -> ObjectInfo:
        """The object's size and identity (a HEAD request)."""
        loc = as_url(url)
        obstore = require_obstore(loc)
        if loc.is_folder:
            raise StorageError(
                "names a folder (a key prefix), not an object; name an object in it, or list it",
                url=str(loc),
                usage=True,
            )
        return info_from_meta(str(loc), self._call(loc, "read", lambda s: obstore.head(s, loc.key)))

    def list_folder(self, url: str | ObjectUrl) -> list[ObjectInfo]:
        """The objects directly under a folder prefix (``s3://b/dir/``; ``s3://b/dir`` is taken
        as ``dir/``), sorted by key, not those in sub-folders. A folder with more than
        ``max_folder_objects`` entries (objects and sub-folders) is refused."""
        loc = as_url(url)
        obstore = require_obstore(loc)
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
            out.append(info_from_meta(f"{loc.root}/{key}", meta))
        out.sort(key=lambda i: i.url)
        return out

    # -- public: bytes ------------------------------------------------------------------------

    def get_into(self, info: ObjectInfo, begin: int, buf: Any) -> None:
        """Fill the writable, contiguous buffer ``buf`` (bytearray, memoryview, numpy array:
        anything with the buffer protocol) with bytes ``[begin, begin + len)`` of the object,
        ``len`` being ``buf``'s size in bytes. Read by ranged GETs of at most ``chunk_bytes``,
        each streamed straight into its part of ``buf``, and each one of the ``concurrency``
        in flight."""
        view = memoryview(buf)
        if view.readonly:
            raise TypeError("get_into needs a writable buffer")
        if not view.c_contiguous:
            raise ValueError("get_into needs a C-contiguous buffer")
        n = view.nbytes
        begin, end = check_span((begin, operator.index(begin) + n))
        check_within(info.url, info.size, begin, end)
        if n == 0:
            return
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        parts = pieces([(begin, begin + n)], self.chunk_bytes)
        self._get_pieces(info, parts, lambda b, e: view[b - begin : e - begin])

    def get_bytes(self, info: ObjectInfo, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the object (for small reads: a header, an index)."""
        begin, end = check_span((begin, end))
        check_within(info.url, info.size, begin, end)
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
        *,
        into: memoryview,
        small: bool = False,
    ) -> int:
        """Read the ``[begin, end)`` byte ``spans`` of the object into ``into``, a writable
        view of the whole object's bytes: each GET lands where its bytes belong, no copy, no
        buffer. Returns the bytes fetched, over-read included.

        The spans are coalesced (``coalesce``, with this client's ``max_gap``), cut into GETs of
        at most ``chunk_bytes``, and run on up to ``concurrency`` threads. The first failure
        stops the rest and is raised once they have ended; bytes of ``into`` a failed GET
        touched are then not to be read.

        ``small=True``: a few bytes that opening a checkpoint waits for (a header), not one of
        the ``concurrency`` GETs in flight, which pace a load's data: an open fetches many
        headers at once (``each``), a round trip each, and bounds them itself. For example,
        ``client.fetch(info, [(0, 8), (4096, 8192)], into=memoryview(bytearray(info.size)))``.
        """
        merged = coalesce(spans, self.max_gap)
        if merged:
            check_within(info.url, info.size, merged[0][0], merged[-1][1])
        if len(into) < info.size:
            raise ValueError(f"into holds {len(into)} bytes, the object {info.size}")
        self._get_pieces(info, pieces(merged, self.chunk_bytes), lambda b, e: into[b:e], small)
        return sum(e - b for b, e in merged)

    # -- the machinery ------------------------------------------------------------------------

    def _get_pieces(
        self,
        info: ObjectInfo,
        parts: list[tuple[int, int]],
        view_of: Callable[[int, int], memoryview],
        small: bool = False,
    ) -> None:
        """Fill ``view_of(begin, end)`` with the object's bytes ``[begin, end)`` for every
        piece, on the client's pool; each GET is one of the ``concurrency`` in flight unless
        ``small``. The first failure stops the rest, and is raised once all have ended."""
        loc = as_url(info.url)

        def work(piece: tuple[int, int], stop: threading.Event) -> None:
            b, e = piece
            with nullcontext() if small else self._in_flight:
                self._get_range(info, loc, b, view_of(b, e), stop)

        failed = self._pool.run(parts, work, width=self.concurrency)
        first = next((exc for exc in failed.values() if not isinstance(exc, Stopped)), None)
        if first is not None:
            raise first

    def _get_range(
        self, info: ObjectInfo, loc: ObjectUrl, begin: int, view: memoryview, stop: threading.Event
    ) -> None:
        """Fill ``view`` with bytes ``[begin, begin + len(view))``: one ranged GET (which the
        library retries), and, where its body breaks off, GETs of the bytes not yet
        received, up to ``retries`` of them."""
        obstore = require_obstore(loc)
        store, n, got, resumed = self._store(loc), len(view), 0, 0
        while True:
            if stop.is_set():
                raise Stopped()
            lo, hi = begin + got, begin + n
            options: Any = {"range": (lo, hi)}  # the library's GetOptions
            if info.etag:
                options["if_match"] = info.etag
            try:
                result = obstore.get(store, loc.key, options=options)
            except Exception as exc:
                error = self._error(exc, loc, "get", (lo, hi))
                if error is exc:
                    raise
                raise (self._changed(info, loc) if isinstance(error, Changed) else error) from None
            self._check_answer(result, info, lo, hi)
            try:
                for chunk in result.stream(min_chunk_size=1 << 20):
                    if stop.is_set():
                        raise Stopped()
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
            except (StorageError, Stopped):
                raise
            except Exception as exc:
                if not is_library_error(exc):
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
        now = etag(meta.get("e_tag"))
        if now and info.etag and now != info.etag:
            raise changed_error(info.url, f"ETag now {now}, was {info.etag}")
        size = meta.get("size")
        if isinstance(size, int) and size != info.size:
            raise changed_error(info.url, f"size now {size}, was {info.size}")
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
    it did). Returns the failures by the index of their item; after the first one no further
    item starts, and this returns once every item started has ended, so nothing is left
    running. Every item before a failed one was started, so the failure of the earliest item
    is the one a loop in order would have met first.

    >>> each(["a", "b"], lambda item: None)
    {}
    """
    width = OPEN_CONCURRENCY if threads is None else threads
    return _OPEN_POOL.run(items, lambda item, stop: work(item), width=max(width, 1))


# -------------------------------------------------------------------------------- the default

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


def reset_default_client() -> None:
    """Drop the process's client (its threads ended), so that the next ``default_client()``
    reads the environment again: after changing ``$SHARDLOAD_OBJECT_*`` or a cloud's
    settings, which a client reads once.

    >>> reset_default_client()
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        client, _DEFAULT = _DEFAULT, None
    if client is not None:
        client.close()


@contextmanager
def use_client(client: ObjectClient | None = None) -> Iterator[ObjectClient]:
    """``default_client()`` is ``client`` (None: a fresh one, from the environment as it is
    now) within the block; the one before is back after it::

        with use_client(ObjectClient(concurrency=2)):
            open_checkpoint("s3://models/tiny/")
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        before, _DEFAULT = _DEFAULT, None if client is None else client
    try:
        yield default_client()
    finally:
        with _DEFAULT_LOCK:
            used, _DEFAULT = _DEFAULT, before
        if used is not before and used is not client and used is not None:
            used.close()


def _after_fork_in_child() -> None:
    global _DEFAULT_LOCK
    _DEFAULT_LOCK = threading.Lock()
    for client in list(_CLIENTS):
        client._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
