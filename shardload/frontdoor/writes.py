"""Writing a file whole or not at all (a plan, a report): ``write_atomic``, and ``write_plan``.

A regular file (or a new one) is written through a temporary file in its folder, fsynced, then
renamed over it (a rename within a folder is atomic), keeping the old file's mode, and the
folder is fsynced so the rename survives a crash; a symlink is followed, so the file it points
at is what gets replaced. Anything else (``/dev/stdout``, ``/dev/null``, a pipe from ``-o
>(cmd)``) cannot be replaced and is written in place. A failure (a full disk) leaves a regular
``path`` as it was and no temporary file behind, and is raised as the ``OSError`` it was.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import TYPE_CHECKING

from ..errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import ShardInfo

__all__ = ["write_atomic", "write_plan"]


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may take only part)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _umask() -> int:
    """The process's umask, read without changing it (Linux reports it in /proc)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def _fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable; best effort (not every platform can)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (see the module docstring)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    folder = os.path.dirname(real)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(real)}.", suffix=".tmp", dir=folder)
    replaced = False
    try:
        try:
            _write_all(fd, text.encode())
            # mkstemp makes the file private (0600): keep the replaced file's mode, or give a
            # new one what a plain open would (0666 less the umask)
            mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()
            with contextlib.suppress(OSError):  # some file systems (vfat, CIFS) refuse chmod
                os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
        replaced = True
        _fsync_folder(folder)
    finally:
        if not replaced:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_plan(info: ShardInfo, path: str | None = None) -> str:
    """``info`` as ``shard_info.json`` text, written whole or not at all to ``path`` when given
    (``OSError`` if it cannot be); a plan too large for shardload to read back is refused."""
    from ..plan import MAX_PLAN_BYTES

    text = info.dumps()
    size = len(text.encode())
    if size > MAX_PLAN_BYTES:
        raise PlanError(
            f"the plan is {size} bytes, over the {MAX_PLAN_BYTES}-byte limit a "
            "plan file may have; a zero-padded plan lists every unit, so try an N "
            "the model divides",
            source=info.source,
        )
    if path is not None:
        write_atomic(path, text)
    return text
