"""Object storage URLs: ``s3://bucket/key``, ``gs://bucket/key``, ``az://container/blob``.

The one place that knows the schemes: ``ObjectUrl.parse`` checks a URL strictly (the bucket or
container against its service's naming rules, the key for length and control characters) and
says what is wrong, so that a mistyped URL fails before any request; ``SCHEMES`` lists them.

>>> u = ObjectUrl.parse("gs://models/llama/")
>>> u.scheme, u.bucket, u.key, u.is_folder
('gs', 'models', 'llama/', True)
>>> str(u.join("model.safetensors"))
'gs://models/llama/model.safetensors'
>>> ObjectUrl.parse("s3://My_Bucket/k")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
shardload.errors.StorageError: s3://My_Bucket/k: not a valid object storage URL: the bucket ...
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StorageError, quote

__all__ = ["MAX_KEY_BYTES", "SCHEMES", "ObjectUrl", "as_url"]

#: an object's key (GCS: object name; Azure: blob name) in UTF-8 bytes, at most: S3's and GCS's
#: limit (Azure allows 1024 characters)
MAX_KEY_BYTES = 1024

_S3_CHARS = re.compile(r"[a-z0-9.\-]*")
_GCS_CHARS = re.compile(r"[a-z0-9._\-]*")
_AZ_CHARS = re.compile(r"[a-z0-9\-]*")
_IP_LIKE = re.compile(r"\d+\.\d+\.\d+\.\d+")
_S3_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_S3_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def _chars_problem(name: str, what: str, chars: re.Pattern, allowed: str) -> str | None:
    if not chars.fullmatch(name):
        bad = next(c for c in name if not chars.fullmatch(c))
        return f"the {what} name {quote(name, 70)} holds {quote(bad)}: only {allowed} are allowed"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return f"the {what} name {quote(name, 70)} must begin and end with a letter or a digit"
    return None


def _length_problem(name: str, what: str, low: int, high: int) -> str | None:
    if not name:
        return f"the {what} name is empty"
    if not low <= len(name) <= high:
        return f"the {what} name {quote(name, 70)} is {len(name)} characters long ({low} to {high})"
    return None


def _s3_bucket_problem(bucket: str) -> str | None:
    """AWS's general-purpose bucket rules."""
    problem = _length_problem(bucket, "bucket", 3, 63) or _chars_problem(
        bucket, "bucket", _S3_CHARS, "lowercase letters, digits, '.' and '-'"
    )
    if problem:
        return problem
    name = quote(bucket, 70)
    if ".." in bucket:
        return f"the bucket name {name} has two adjacent periods"
    if _IP_LIKE.fullmatch(bucket):
        return f"the bucket name {name} is formatted as an IP address"
    for prefix in _S3_RESERVED_PREFIXES:
        if bucket.startswith(prefix):
            return f"the bucket name {name} starts with the reserved prefix {prefix!r}"
    for suffix in _S3_RESERVED_SUFFIXES:
        if bucket.endswith(suffix):
            return f"the bucket name {name} ends with the reserved suffix {suffix!r}"
    return None


def _gcs_bucket_problem(bucket: str) -> str | None:
    """Google Cloud Storage's bucket rules (3 to 63 characters, 222 with dots)."""
    return (
        _length_problem(bucket, "bucket", 3, 222 if "." in bucket else 63)
        or _chars_problem(
            bucket, "bucket", _GCS_CHARS, "lowercase letters, digits, '.', '_' and '-'"
        )
        or (
            f"the bucket name {quote(bucket, 70)} starts with the reserved prefix 'goog'"
            if bucket.startswith("goog")
            else None
        )
    )


def _azure_container_problem(container: str) -> str | None:
    """Azure Blob Storage's container rules."""
    return (
        _length_problem(container, "container", 3, 63)
        or _chars_problem(container, "container", _AZ_CHARS, "lowercase letters, digits and '-'")
        or (
            f"the container name {quote(container, 70)} has two adjacent dashes"
            if "--" in container
            else None
        )
    )


@dataclass(frozen=True)
class _Scheme:
    name: str
    service: str
    bucket_word: str  # what the service calls a bucket
    bucket_problem: Callable[[str], str | None]


#: the object storage schemes, and how each names its buckets
SCHEMES: dict[str, _Scheme] = {
    s.name: s
    for s in (
        _Scheme("s3", "S3", "bucket", _s3_bucket_problem),
        _Scheme("gs", "Google Cloud Storage", "bucket", _gcs_bucket_problem),
        _Scheme("az", "Azure Blob Storage", "container", _azure_container_problem),
    )
}


def _key_problem(key: str) -> str | None:
    """Why ``key`` is not a key shardload accepts (valid UTF-8, at most ``MAX_KEY_BYTES``
    bytes, no control character), or None."""
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "the key is not valid Unicode (a lone surrogate)"
    if size > MAX_KEY_BYTES:
        return f"the key is {size} bytes long in UTF-8 (at most {MAX_KEY_BYTES})"
    for c in key:
        if unicodedata.category(c) == "Cc":
            return f"the key holds a control character (U+{ord(c):04X})"
    return None


@dataclass(frozen=True)
class ObjectUrl:
    """``SCHEME://bucket/key``: an object, or (``key`` empty or ending in ``/``) a folder
    prefix. ``bucket`` is Azure's container."""

    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> ObjectUrl:
        """``url`` split into scheme, bucket and key, checked strictly; a bad URL is a
        ``StorageError`` (``usage=True``) saying what is wrong."""
        if not isinstance(url, str):
            raise TypeError(f"an object storage URL is a str, not {type(url).__name__}")
        scheme, sep, rest = url.partition("://")

        def bad(why: str, form: str = "SCHEME://BUCKET/KEY") -> StorageError:
            return StorageError(
                f"not a valid object storage URL: {why}; write it as {form}", url=url, usage=True
            )

        if not sep or scheme not in SCHEMES:
            names = ", ".join(f"{s}://" for s in SCHEMES)
            raise bad(f"it does not start with one of {names} (lowercase)")
        kind = SCHEMES[scheme]
        bucket, _, key = rest.partition("/")
        problem = kind.bucket_problem(bucket) or _key_problem(key)
        if problem:
            raise bad(problem, f"{scheme}://{kind.bucket_word.upper()}/KEY")
        return cls(scheme, bucket, key)

    @property
    def service(self) -> str:
        """The service's name, for messages (``S3``, ``Google Cloud Storage``)."""
        return SCHEMES[self.scheme].service

    @property
    def root(self) -> str:
        """``SCHEME://bucket``: what one store of the library serves."""
        return f"{self.scheme}://{self.bucket}"

    @property
    def is_folder(self) -> bool:
        """True for a folder prefix: the key is empty or ends with ``/``."""
        return not self.key or self.key.endswith("/")

    @property
    def prefix(self) -> str:
        """The key as a folder prefix: ``""``, or the key ending with ``/``."""
        return self.key if self.is_folder else self.key + "/"

    @property
    def folder(self) -> ObjectUrl:
        """The folder this object is in (a folder prefix is its own folder)."""
        if self.is_folder:
            return self
        head, _, _ = self.key.rpartition("/")
        return ObjectUrl(self.scheme, self.bucket, head + "/" if head else "")

    def join(self, name: str) -> ObjectUrl:
        """The object ``name`` (a relative path, ``/``-separated) in this folder (a key not
        ending in ``/`` is taken as a folder too). ``.`` and empty components are dropped, as a
        path library would normalise them, since in object storage ``./x`` would be another
        key; ``..`` is refused."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a member name is a non-empty str, not {quote(name)}")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if not parts or ".." in parts or name.startswith("/"):
            raise StorageError(
                f"cannot name {quote(name)} in this folder: only plain relative "
                "paths inside it may be joined",
                url=str(self),
                usage=True,
            )
        return ObjectUrl.parse(f"{self.root}/{self.prefix}{'/'.join(parts)}")

    def __str__(self) -> str:
        return f"{self.root}/{self.key}"


def as_url(url: str | ObjectUrl) -> ObjectUrl:
    return url if isinstance(url, ObjectUrl) else ObjectUrl.parse(url)
