"""The README's test command on a fresh clone, as a newcomer runs it: with an empty home folder
and none of the environments ``.ci/run`` makes first (vLLM's, GPTQModel's, Azurite).

CI makes every optional environment before it runs the suite, so the suite itself never shows
what a newcomer meets. This runs, in fresh pytest processes with an empty ``HOME`` and none of
CI's settings, the part of the suite those environments decide:

1. every block of the README and every run block of docs/ (``tests/test_readme.py``): they pass
   as written, a block needing an environment skipping with the script that makes it;
2. every test marked as needing an environment (``vllm``, ``quant_tools``, ``azurite``): each
   skips before it starts, naming that script.

And nothing is installed meanwhile: no environment appears in the empty home, and npm is never
run. The published GGUF's download cache (``SHARDLOAD_MODEL_CACHE``) is shared with this run:
it is a download, not an environment, and 98 MB need not cross the network twice.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers.paths import REPO
from helpers.real_models import cache_dir, smollm2_gguf

from devtools.environments import ENVIRONMENTS

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

#: what CI sets, and the tests' own settings: a newcomer has none of them
_CI_ONLY = (
    "SHARDLOAD_",
    "PYTEST_",
    "VLLM_",
    "PYTHONPATH",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "npm_config_",
)


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> Iterator[dict]:
    """A newcomer's environment: this one without CI's settings, an empty ``HOME`` (removed
    afterwards: the README's vLLM example makes 160 MB there)."""
    smollm2_gguf()  # in the shared download cache first (see the module's docstring)
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CI_ONLY)}
    env.update(HOME=str(home), SHARDLOAD_MODEL_CACHE=str(cache_dir()))
    yield env
    shutil.rmtree(home, ignore_errors=True)


def _pytest(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def _summary(done: subprocess.CompletedProcess) -> str:
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]


def _nothing_installed(env: dict) -> None:
    home = env["HOME"]
    made = [
        e.name
        for e in ENVIRONMENTS.values()
        if os.path.exists(os.path.join(home, ".cache", "shardload", e.folder))
    ]
    assert not made, f"the suite made environments by itself: {made}"
    assert not os.path.exists(os.path.join(home, ".npm")), "the suite ran npm"


def test_the_readme_and_docs_blocks_pass_with_nothing_made_first(newcomer):
    done = _pytest(newcomer, "tests/test_readme.py")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", _summary(done)) and "failed" not in _summary(done)
    _nothing_installed(newcomer)


def test_every_test_needing_an_environment_skips_naming_its_script(newcomer):
    done = _pytest(newcomer, "-m", "vllm or quant_tools or azurite or gpu_sim", "tests")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = _summary(done)
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    for env in ENVIRONMENTS.values():
        assert f"make it with {env.script}" in done.stdout, (env.name, done.stdout[-3000:])
    _nothing_installed(newcomer)
