"""An object as the service describes it (``ObjectInfo``): its size, and the identity that
tells it from any object written in its place since."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..errors import StorageError

__all__ = ["ObjectInfo", "etag", "info_from_meta"]


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


def info_from_meta(url: str, meta: Any) -> ObjectInfo:
    size = meta.get("size") if isinstance(meta, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise StorageError(
            "the service's answer has no valid object size; the endpoint does "
            "not speak its storage API as expected",
            url=url,
            usage=False,
        )
    return ObjectInfo(url, size, etag(meta.get("e_tag")), _iso(meta.get("last_modified")))


def etag(value: Any) -> str:
    """An ETag in its HTTP form, a quoted string (a weak one's ``W/`` kept). Headers say it
    quoted, but some listings bare (Azure's, and GCS's XML API as fake-gcs-server writes it):
    an object listed and then read must have one identity, and ``If-Match`` takes it quoted.

    >>> etag("0x8DC1A2B3C4D5E6F"), etag('"abc"'), etag('W/"abc"'), etag(None)
    ('"0x8DC1A2B3C4D5E6F"', '"abc"', 'W/"abc"', '')
    """
    text = "" if value is None else str(value).strip()
    if not text or text.startswith(('"', 'W/"')):
        return text
    return f'"{text}"'
