"""Where checkpoint bytes come from besides local files: object storage, named by URL.

``is_object_url`` says whether a path names an object (``s3://bucket/key``, ``gs://...``,
``az://...``) rather than a local file. The client layer is ``shardload.sources.store`` (over
obstore; the schemes' URL rules in ``sources.urls``); nothing here imports it, and it imports
obstore only when a URL is actually used, so ``import shardload`` and ``shardload --help``
never load it.

>>> is_object_url("s3://models/llama/model.safetensors")
True
>>> is_object_url("models/llama"), is_object_url("https://example.com/x")
(False, False)
"""

from __future__ import annotations

from .urls import SCHEMES

__all__ = ["OBJECT_SCHEMES", "is_object_url"]

#: URL prefixes that name objects in object storage (other schemes are not objects)
OBJECT_SCHEMES = tuple(f"{scheme}://" for scheme in SCHEMES)


def is_object_url(path: object) -> bool:
    """True when ``path`` is a string naming an object in object storage (``s3://...``,
    ``gs://...``, ``az://...``).

    Only a ``str`` can be a URL: an ``os.PathLike`` is a local path, whatever it spells."""
    return isinstance(path, str) and path.startswith(OBJECT_SCHEMES)
