"""What a failed call of the object-store library means, said our way (``verdict``).

The library raises typed errors (``obstore.exceptions``: ``PreconditionError``,
``PermissionDeniedError``, ...; Python's own ``FileNotFoundError`` for a missing object); we
classify by type first. Its text is read only for what no type says (named where it is read):
an HTTP status, a missing bucket, a timeout, a refused connection, missing credentials, a
failure at the instance metadata service. The text itself is never repeated (it can hold a
signed URL): every message is built from our own words, the URL and a status code.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from ..errors import FormatError, StorageError, quote
from .settings import StoreSettings
from .store_config import RETRIES_ENV
from .urls import ObjectUrl

__all__ = [
    "Changed",
    "Stopped",
    "Verdict",
    "changed_error",
    "is_library_error",
    "no_bucket",
    "verdict",
]

#: what a request was for: ``read`` an object named by the user, ``list`` a folder, or
#: ``get`` a range of an object seen before (gone since means changed, not missing)
Action = Literal["read", "list", "get"]


class Stopped(Exception):
    """Another piece failed: this one stops without an error of its own."""


class Changed(Exception):
    """The object is no longer the one seen (a failed If-Match, a 404 or 416 mid-load): the
    caller builds the error, which needs a HEAD to say what the object is now."""


def changed_error(url: str, how: str) -> FormatError:
    return FormatError(
        f"the object changed while loading ({how}); do not replace a checkpoint "
        "while it is loading",
        file=url,
    )


def is_library_error(exc: BaseException) -> bool:
    """Whether a call of the library raised ``exc`` as its answer (not a bug of ours)."""
    from obstore.exceptions import BaseError

    return isinstance(exc, (BaseError, FileNotFoundError))


# Text the library's errors carry for causes its types do not tell apart (most failures
# are a GenericError; the status is in the text only)
_STATUS = re.compile(r"status code: (\d{3})|Server returned non-2xx status code: (\d{3})")
# a key refused outright, which some services answer with 403 (PermissionDeniedError)
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
# a missing bucket and a missing key are both FileNotFoundError
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


def no_bucket(exc: BaseException) -> bool:
    """The library said that the bucket (not a key in it) is missing: both are
    FileNotFoundError, only the service's words tell them apart."""
    from obstore.exceptions import NotFoundError

    return isinstance(exc, (FileNotFoundError, NotFoundError)) or any(
        w in str(exc) for w in _NO_BUCKET_WORDS
    )


def _from_metadata_service(text: str) -> bool:
    """The library's error text says a request to an instance metadata service failed (the
    credential source of last resort), not one to the storage endpoint: no type says so."""
    hosts = list(_METADATA_HOSTS)
    for name in _METADATA_ENV:
        try:
            host = urlsplit(os.environ.get(name) or "").netloc
        except ValueError:
            continue
        if host:
            hosts.append(host)
    return any(f"//{host}/" in text or f"//{host}:" in text for host in hosts)


@dataclass(frozen=True)
class Verdict:
    """A failure said our way: what happened, what to do, and whose move it is."""

    what: str
    todo: str
    usage: bool

    def error(self, url: str, byte_range: tuple[int, int] | None = None) -> StorageError:
        return StorageError(
            f"{self.what}; {self.todo}", url=url, byte_range=byte_range, usage=self.usage
        )


def verdict(
    exc: BaseException,
    loc: ObjectUrl,
    action: Action,
    settings: StoreSettings,
    retries: int,
    request_timeout: float,
    bucket_exists: Callable[[], bool],
) -> Verdict | Changed:
    """What the library's error ``exc`` (``is_library_error``) means: ``Changed`` where the
    object seen is gone or replaced mid-load. ``bucket_exists()`` is asked only where a
    missing object may be a missing bucket."""
    from obstore.exceptions import (
        NotFoundError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )

    text, service = str(exc), loc.service

    def usage(what: str, todo: str) -> Verdict:
        return Verdict(what, todo, usage=True)

    def failed(what: str, todo: str) -> Verdict:
        return Verdict(what, todo, usage=False)

    # the HTTP status: no type carries it
    status = next((int(g) for m in _STATUS.finditer(text) for g in m.groups() if g), 0)
    if _from_metadata_service(text):
        # no credentials are set, and the cloud's metadata service (where the library looks
        # last) gave none: off the cloud it is not there, or it refuses (HTTP 403, 404)
        how = f"HTTP {status}" if status else "it did not answer"
        return usage(
            f"no {service} credentials found: none are set, and the cloud's "
            f"instance metadata service gave none ({how})",
            f"set {settings.credentials}",
        )
    if isinstance(exc, PreconditionError) or (action == "get" and status == 416):
        return Changed()
    if isinstance(exc, (FileNotFoundError, NotFoundError)) or status == 404:
        if action == "get":  # it was there when seen: it is gone since
            return Changed()
        # a listing finds no object missing, only a bucket
        if (
            action == "list"
            or any(w in text for w in _NO_BUCKET_WORDS)
            or (action == "read" and not bucket_exists())
        ):
            word = "container" if loc.scheme == "az" else "bucket"
            return usage(
                f"no such {service} {word} {quote(loc.bucket)} at {settings.where}",
                "check its name, and the endpoint if it is not the service's own",
            )
        return usage(
            "no such object", f"check the path, or list the folder it should be in ({loc.folder})"
        )
    if isinstance(exc, UnauthenticatedError) or any(c in text for c in _CREDENTIAL_CODES):
        return usage(
            f"the {service} credentials in use were refused", f"check {settings.credentials}"
        )
    if isinstance(exc, PermissionDeniedError) or status == 403:
        verb = "list" if action == "list" else "read"
        return usage(
            "access denied",
            f"the credentials in use may not {verb} it; check {settings.credentials}",
        )
    # missing credentials, timeouts and refused connections are all GenericError
    if any(w in text for w in _NO_CREDENTIAL_WORDS):
        return usage(f"no {service} credentials found", f"set {settings.credentials}")
    tries = f"{retries + 1} attempt{'s' if retries else ''}"
    if status >= 500 or status == 429:
        return failed(
            f"the storage service failed {tries} (last: HTTP {status})",
            f"it is failing or overloaded: try again later, or allow more retries ({RETRIES_ENV})",
        )
    if any(w in text for w in _TIMEOUT_WORDS):
        limit = settings.carried.get("timeout")
        limit = f"the time {limit} sets" if limit else f"{request_timeout:g} s"
        return failed(
            f"the transfer timed out {tries} (a GET must finish within {limit})",
            f"the network or the endpoint {settings.where} is failing: try again later",
        )
    if any(w in text for w in _CONNECT_WORDS):
        return failed(
            f"could not connect to the endpoint {settings.where} ({tries})",
            f"check {settings.check}",
        )
    if 400 <= status < 500:
        return usage(
            f"the service refused the request (HTTP {status})",
            f"check the URL and the endpoint ({settings.where})",
        )
    return failed(
        f"the {service} request failed ({type(exc).__name__}"
        f"{f', HTTP {status}' if status else ''}, {tries})",
        f"check the endpoint ({settings.where}) and the network",
    )
