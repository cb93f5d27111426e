"""The Hugging Face hub cache layout: a repository folder stands for its ``refs/main`` snapshot.

``huggingface_hub`` keeps a downloaded model as::

    models--org--name/
        refs/main                       the commit hash main pointed at when downloaded
        snapshots/<commit>/config.json  -> ../../blobs/<git sha1>   (relative symlinks)
        snapshots/<commit>/model-00001-of-00002.safetensors -> ../../blobs/<sha256>
        blobs/<sha256>                  the bytes

A snapshot folder is an ordinary checkpoint folder whose files are symlinks, and the readers
open it as one. This module lets the user pass the repository folder itself (no revision):
``resolve_snapshot`` turns ``models--org--name`` into ``models--org--name/snapshots/<refs/main>``
(or into its one snapshot when there is no ``refs/main``: a download by commit hash writes none)
and leaves every other path alone.

Trust rules: ``refs/main`` is a small regular file (at most 1 KiB) holding one plain name (a
commit hash in practice): UTF-8, no ``/`` or ``\\``, not ``.`` or ``..``, no NUL or control
characters; ``snapshots/<name>`` must be a folder. Anything else is a ``FormatError`` naming
the file.
"""

from __future__ import annotations

import os

from ..errors import FormatError, quote
from ..files import read_capped

__all__ = ["MAX_REF_BYTES", "is_repo_folder", "resolve_snapshot"]

#: a ref holds a 40-character commit hash; anything much longer is not a ref
MAX_REF_BYTES = 1024


def is_repo_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` looks like a hub cache repository folder: it has a ``snapshots/``
    folder (``refs/`` is missing when a model was downloaded by commit hash)."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isdir(os.path.join(path, "snapshots"))


def resolve_snapshot(path: str | os.PathLike[str]) -> str:
    """``path`` itself, or for a hub cache repository folder, its ``refs/main`` snapshot folder.

    >>> resolve_snapshot("~/.cache/huggingface/hub/models--org--name")   # doctest: +SKIP
    '~/.cache/huggingface/hub/models--org--name/snapshots/0123456789abcdef0123456789abcdef01234567'
    """
    path = os.fspath(path)
    if not is_repo_folder(path):
        return path
    ref_file = os.path.join(path, "refs", "main")
    snapshots = os.path.join(path, "snapshots")
    if not os.path.lexists(ref_file):
        try:
            found = sorted(
                f for f in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, f))
            )
        except OSError:
            found = []
        if len(found) == 1:  # downloaded by commit hash: no ref, one snapshot, no doubt
            return os.path.join(snapshots, found[0])
        hint = (
            f" (snapshots here: {', '.join(quote(f) for f in found[:5])})"
            if found
            else " (and snapshots/ is empty)"
        )
        raise FormatError(
            f"a Hugging Face cache folder with no refs/main: pass a snapshot "
            f"folder, {os.path.join(path, 'snapshots', '<revision>')}{hint}",
            file=path,
        )
    raw = read_capped(ref_file, MAX_REF_BYTES, "refs/main")
    try:
        ref = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(
            "refs/main is not UTF-8 text; it should hold a commit hash", file=ref_file
        ) from None
    # huggingface_hub writes the bare hash; a hand edit may add a newline
    ref = ref.strip()
    problem = (
        "is empty"
        if not ref
        else "holds a path separator"
        if "/" in ref or "\\" in ref
        else "is '.' or '..'"
        if ref in (".", "..")
        else "holds a NUL or control character"
        if not ref.isprintable()
        else None
    )
    if problem:
        raise FormatError(
            f"refs/main {problem} ({quote(ref)}); it must hold a plain revision "
            f"name, the commit hash of a folder in snapshots/",
            file=ref_file,
        )
    snapshot = os.path.join(snapshots, ref)
    if not os.path.isdir(snapshot):
        raise FormatError(
            f"refs/main names revision {quote(ref)}, but {snapshot} is not a "
            f"folder (an interrupted download? download the model again, or pass "
            f"a snapshot folder that exists)",
            file=ref_file,
        )
    return snapshot
