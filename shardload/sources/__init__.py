"""Where checkpoint bytes come from besides local files: object storage, named by URL.

``is_object_url`` says whether a path names an object (``s3://bucket/key``) rather than a local
file. The client layer is ``shardload.sources.s3``; nothing here imports it, and it imports
botocore only when an ``s3://`` URL is actually used, so ``import shardload`` and
``shardload --help`` never load botocore.

>>> is_object_url("s3://models/llama/model.safetensors")
True
>>> is_object_url("models/llama"), is_object_url("https://example.com/x")
(False, False)
"""

from __future__ import annotations

__all__ = ["OBJECT_SCHEMES", "is_object_url"]

#: URL prefixes that name objects in object storage (other schemes are not objects)
OBJECT_SCHEMES = ("s3://",)


def is_object_url(path: object) -> bool:
    """True when ``path`` is a string naming an object in object storage (``s3://...``).

    Only a ``str`` can be a URL: an ``os.PathLike`` is a local path, whatever it spells."""
    return isinstance(path, str) and path.startswith(OBJECT_SCHEMES)
