"""The file-system half of trust: which names a checkpoint may carry, and which paths may be read.

Two rules, applied by every reader, the plan loader and every config reader:

1. **Names are checked by name.** A file name found *inside* a checkpoint (a
   ``model.safetensors.index.json`` weight map, an MLC ``dataPath``) must be a plain relative path
   inside its folder: a non-empty string of at most ``MAX_MEMBER_NAME`` characters, no NUL or
   other control character, not absolute, no drive letter, no backslash, no ``..`` component
   (``./`` and ``//`` are harmless and allowed, as a path library normalises them). It is
   refused by name, before anything is opened (``check_member_name``). Where the *user's* file
   system keeps the
   bytes is not the checkpoint's business: the Hugging Face hub cache stores
   ``snapshots/<rev>/model.safetensors`` as a symlink to ``../../blobs/<sha256>``, and that must
   load.
2. **What a path finally resolves to must be a regular file**, checked with ``stat`` before it is
   opened, and again with ``fstat`` on the opened descriptor (``open_regular``): a FIFO would
   block forever, ``/dev/zero`` never ends, a directory or a symlink loop would surface as a
   traceback. Each becomes one clean error naming the path.

Small side files (indexes, configs, plans) are read with a stated cap (``read_capped``), so a
1.6 GB "index" is refused before it is read.

A data file (a safetensors file, a GGUF, an MLC shard) is found and mapped through a
``sources.bytesource.Files`` (this machine's, or a checkpoint's in object storage), with
``open_regular``.

>>> check_member_name("model-00001-of-00002.safetensors", index="model.safetensors.index.json")
>>> check_member_name("../etc/passwd", index="i.json")
Traceback (most recent call last):
...
shardload.errors.FormatError: i.json: names file '../etc/passwd', which has a '..' component; ...
"""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from collections.abc import Callable
from typing import Any, BinaryIO, Union

from . import strict_json
from .errors import FormatError, quote

__all__ = [
    "MAX_MEMBER_NAME",
    "MAX_SIDE_FILE_BYTES",
    "check_member_name",
    "format_error",
    "kind_of",
    "open_regular",
    "parse_json",
    "read_capped",
    "read_json",
    "regular_file",
]

#: longest file name a checkpoint may carry (real ones are under 100 characters)
MAX_MEMBER_NAME = 1024
#: cap on a small JSON side file (config.json, quantize_config.json, mlc-chat-config.json)
MAX_SIDE_FILE_BYTES = 16 << 20

PathLike = Union[str, "os.PathLike[str]"]
ErrorFactory = Callable[[str], Exception]


def check_member_name(name: object, *, index: PathLike, what: str = "names file") -> None:
    """Refuse ``name`` (as written in ``index``) unless it is a plain relative path inside the
    index's folder. Nothing is opened or resolved."""

    def bad(why: str) -> FormatError:
        return FormatError(
            f"{what} {quote(name)}, which {why}; a checkpoint may only name "
            f"files by plain relative paths inside its own folder",
            file=str(index),
        )

    if not isinstance(name, str):
        raise bad(f"is a {type(name).__name__}, not a string")
    if not name:
        raise bad("is empty")
    if len(name) > MAX_MEMBER_NAME:
        raise bad(f"is {len(name)} characters long (at most {MAX_MEMBER_NAME})")
    if "\x00" in name:
        raise bad("holds a NUL character")
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise bad("holds a control character")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("is not valid Unicode (a lone surrogate)") from None
    if "\\" in name:
        raise bad("holds a backslash")
    if name.startswith("/") or os.path.isabs(name):
        raise bad("is an absolute path")
    if len(name) >= 2 and name[1] == ":" and name[0].isalpha():
        raise bad("starts with a drive letter")
    parts = name.split("/")
    if ".." in parts:
        raise bad("has a '..' component")
    # "./model.safetensors" and "dir//m.safetensors" stay inside the folder, as a path library
    # would normalise them; only a name that is nothing but such components names no file
    if all(p in ("", ".") for p in parts):
        raise bad("names the folder itself, not a file in it")


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _os_error(exc: OSError, what: str, error: ErrorFactory) -> Exception:
    if exc.errno == errno.ELOOP:
        return error(f"{what} is a symlink loop (or too many levels of symlinks)")
    if exc.errno == errno.ENOENT:
        return error(f"{what} does not exist (a missing file, or a symlink to one)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return error(f"cannot read {what}: permission denied")
    if exc.errno == errno.ENAMETOOLONG:
        return error(f"cannot open {what}: its name is too long for the file system")
    return error(f"cannot read {what}: {exc.strerror or exc}")


def format_error(path: PathLike) -> ErrorFactory:
    """The default refusal: a ``FormatError`` naming ``path``."""
    return lambda msg: FormatError(msg, file=str(path))


def regular_file(
    path: PathLike, what: str = "the file", error: ErrorFactory | None = None
) -> os.stat_result:
    """``os.stat(path)`` (symlinks followed), refused unless it is a regular file."""
    error = error or format_error(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _os_error(exc, what, error) from None
    except ValueError:  # embedded NUL
        raise error(f"{what} has a NUL character in its path") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} is {kind_of(st.st_mode)}, not a regular file")
    return st


def open_regular(
    path: PathLike, what: str = "the file", error: ErrorFactory | None = None
) -> tuple[BinaryIO, os.stat_result]:
    """Open ``path`` for reading, refused unless it is a regular file.

    Checked before opening (``stat``) and after (``fstat`` of the descriptor): a FIFO swapped in
    between is still refused, and opening with ``O_NONBLOCK`` means even that race cannot block.
    Returns the open binary file and its ``fstat``.
    """
    error = error or format_error(path)
    regular_file(path, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _os_error(exc, what, error) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} is {kind_of(st.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def read_capped(
    path: PathLike, max_bytes: int, what: str = "the file", error: ErrorFactory | None = None
) -> bytes:
    """The bytes of a small regular file, refused (with the cap in the message) if it is larger
    than ``max_bytes``. Never reads more than ``max_bytes + 1`` bytes."""
    error = error or format_error(path)
    f, st = open_regular(path, what, error)
    with f:
        if st.st_size > max_bytes:
            raise error(
                f"{what} is {st.st_size} bytes, over the {max_bytes}-byte limit for "
                f"such a file: it is corrupt or not what it claims to be"
            )
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise _os_error(exc, what, error) from None
    if len(data) > max_bytes:
        raise error(f"{what} grew past the {max_bytes}-byte limit while being read")
    return data


def parse_json(data: bytes, what: str, error: ErrorFactory, hint: str = "") -> Any:
    """``data`` as strict JSON (``strict_json``), decoded as UTF-8 here: ``json.loads(bytes)``
    would silently take UTF-16 and UTF-32 too. ``hint`` ends each refusal (what to do)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not valid UTF-8 ({exc}); JSON files must be UTF-8{hint}") from None
    try:
        return strict_json.loads(text)
    except ValueError as exc:  # includes json.JSONDecodeError
        raise error(f"{what} is not valid JSON: {exc}{hint}") from None


def read_json(
    path: PathLike,
    max_bytes: int,
    what: str = "the file",
    error: ErrorFactory | None = None,
    hint: str = "",
) -> Any:
    """A small JSON side file (an index, a config): a regular file of at most ``max_bytes``,
    strict UTF-8 JSON; every refusal ``error(message)`` (a ``FormatError`` naming ``path`` by
    default)."""
    error = error or format_error(path)
    return parse_json(read_capped(path, max_bytes, what, error), what, error, hint)
