"""The GPU machine ``benchmarks/gpu_check.sh`` runs on, as far as the check needs it: its Python,
what its image already holds, and the wheels carried to it, because it can fetch nothing.

The machine (one H100 or H200, lent for 15 minutes at a time) reaches no network: ``pip install``
fails there whatever the index. What the check needs and the image lacks travels with the
checkout as wheels, downloaded here for that machine's Python and platform::

    python -m devtools.gpu_machine download              # cp312 wheels into .gpu-wheels/
    python -m devtools.gpu_machine download --python-version 3.11 --dest DIR   # the dry run's
    python -m devtools.gpu_machine image                 # the image's packages, one per line

``download`` takes each wheel with ``--no-deps`` at the version pinned in ``WHEELS`` and checks
that every requirement it declares (extras aside) is in ``IMAGE``: the machine already holds it,
so nothing is missing there and nothing it holds is replaced, torch above all (the check installs
with ``--no-index --no-deps --target``). ``scripts/gpu-sim-env.sh`` makes a virtual environment
holding ``IMAGE`` alone (with a CPU torch) for the dry run. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the machine's interpreter (``python3`` there: Python 3.12.3 with torch 2.11.0+cu130)
PYTHON_VERSION = "3.12"

#: manylinux tags its glibc takes; pip matches each tag exactly, so every one a wheel of
#: ``WHEELS`` is published under is named
PLATFORMS = (
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

#: what the machine's image holds that the check and the carried wheels use, with the version
#: read there (2026-11) where one matters; the dry run's environment is made of these alone.
#: torch is the machine's own CUDA build there (2.11.0+cu130); the dry run takes this
#: machine's CPU build (2.13.0, from its disk) instead.
IMAGE = {
    "torch": "2.11.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "transformers": "5.17.0",
    "accelerate": "1.15.0",
    "cupy-cuda13x": "14.2.0",
    "click": None,
    "tqdm": None,
    "psutil": None,
    "pytest": None,
    "hypothesis": None,
    "matplotlib": None,
    # what the carried wheels need, all in the image too
    "pyyaml": None,
    "requests": None,
    "typer": None,
    "humanize": None,
}

#: where the dry run's environment (Python 3.11 here) differs from ``IMAGE``: torch is this
#: machine's CPU build (on its disk, for Python 3.11; the machine's CUDA build of 2.11 is
#: several GB), and numpy 2.5 needs Python 3.12, so the newest for 3.11
DRY_RUN = {"torch": "2.13.0", "numpy": None}


@dataclass(frozen=True)
class Wheel:
    """One carried distribution: its pinned version and why the check needs it."""

    name: str
    version: str
    why: str


#: what the image lacks: shardload's one required package it does not hold, and the peers the
#: benchmark compares with (each needs only what ``IMAGE`` holds; ``download`` checks it)
WHEELS = (
    Wheel("gguf", "0.19.0", "shardload's own requirement (GGUF files)"),
    Wheel("orjson", "3.13.0", "shardload's own requirement (safetensors headers)"),
    Wheel("fastsafetensors", "0.5.0", "a peer loader"),
    Wheel("runai-model-streamer", "0.17.1", "a peer loader (Run:ai Model Streamer)"),
    Wheel("instanttensor", "0.2.2", "a peer loader (CUDA only)"),
)

#: where ``download`` puts them by default (``.gitignore`` names it: the device call carries it)
DEFAULT_DEST = REPO / ".gpu-wheels"


def canonical(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[str]:
    """The names a wheel requires, extras' requirements left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            spec = line.split(":", 1)[1].strip()
            if re.search(r"\bextra\s*==", spec):
                continue
            out.append(canonical(re.split(r"[\s;(<>=!~\[]", spec, maxsplit=1)[0]))
    return out


def wheel_name(path: Path) -> str:
    return canonical(path.name.split("-", 1)[0])


def unmet(dest: Path) -> dict[str, list[str]]:
    """Each wheel in ``dest`` -> what it requires that neither ``IMAGE`` nor ``dest`` holds."""
    have = {canonical(n) for n in IMAGE} | {wheel_name(p) for p in dest.glob("*.whl")}
    return {
        p.name: missing
        for p in sorted(dest.glob("*.whl"))
        if (missing := [r for r in requirements(p) if r not in have])
    }


def download(dest: Path, python_version: str) -> list[Path]:
    """Every wheel of ``WHEELS`` for ``python_version`` on x86-64 Linux into ``dest`` (which
    holds these and nothing else afterwards); raises SystemExit naming what failed."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {canonical(w.name): w for w in WHEELS}
    for old in dest.glob("*.whl"):  # another version of one of ours, or a stranger: out
        if wheel_name(old) not in wanted or f"-{wanted[wheel_name(old)].version}-" not in old.name:
            old.unlink()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--dest",
        str(dest),
    ]
    for tag in PLATFORMS:
        cmd += ["--platform", tag]
    cmd += [f"{w.name}=={w.version}" for w in WHEELS]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        noise = "is neither a file nor a directory"  # this machine's extra index, harmless
        said = "\n".join(line for line in done.stdout.splitlines() if noise not in line)
        raise SystemExit(f"pip download failed (exit {done.returncode}):\n{said}")
    got = sorted(dest.glob("*.whl"))
    names = [wheel_name(p) for p in got]
    if sorted(names) != sorted(wanted) or len(set(names)) != len(names):
        raise SystemExit(f"{dest} holds {names}; expected one wheel each of {sorted(wanted)}")
    missing = unmet(dest)
    if missing:
        raise SystemExit(
            "these wheels need what the GPU machine's image does not hold (name "
            f"it in WHEELS or IMAGE): {missing}"
        )
    return got


def shown(path: Path) -> str:
    """``path`` relative to here where it is below here, else as it is."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devtools.gpu_machine", description=__doc__.split("\n\n")[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download", help="the carried wheels, for the GPU machine's Python")
    d.add_argument(
        "--python-version",
        default=PYTHON_VERSION,
        help=f"the interpreter they are for (default {PYTHON_VERSION}, the machine's)",
    )
    d.add_argument(
        "--dest",
        type=Path,
        default=DEFAULT_DEST,
        help=f"where (default {DEFAULT_DEST.relative_to(REPO)}/)",
    )
    i = sub.add_parser(
        "image",
        help="the image's packages as the dry run's environment takes "
        "them, as pip requirements (DRY_RUN)",
    )
    i.add_argument("--pinned", action="store_true", help="at the versions read there")
    args = ap.parse_args(argv)
    if args.command == "image":
        for name, version in IMAGE.items():
            version = DRY_RUN.get(name, version if args.pinned else None)
            print(f"{name}=={version}" if version else name)
        return 0
    got = download(args.dest, args.python_version)
    total = sum(p.stat().st_size for p in got)
    for p in got:
        print(f"{p.stat().st_size / 1e6:7.2f} MB  {p.name}")
    print(
        f"{total / 1e6:7.2f} MB  in all, {len(got)} wheels for Python {args.python_version} "
        f"in {shown(args.dest)}/ (each needs only what the machine's image holds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
