"""The README runs as written: every command and snippet in it, and the blocks of ``docs/``
that carry a directive.

Each fenced block the README shows is preceded by a directive, an HTML comment the reader does
not see, and this test does what it says:

* ``<!-- test: setup -->``: one of the two set-up commands. The test command must be what
  ``.ci/run`` runs, verbatim (CI runs it on a fresh clone); the first one's install is that
  same install, and what follows its ``&&`` is run here;
* ``<!-- test: run -->`` (``slow``, ``real_model``, ``vllm``, ``azurite``, ``extended``: marks;
  a block naming an environment is told where it is, as a reader who made it knows, and
  ``vllm`` also runs it in vLLM's environment, ``scripts/vllm-env.sh``): run as a reader would
  run it. The block is saved to a file and run in a fresh process from the repository root,
  ``bash`` blocks by bash (``-e -o pipefail``), ``python`` blocks by python, with the
  environment a reader has (``reader_env``): shardload installed, nothing on ``PYTHONPATH``,
  none of the tests' own settings. A ``vllm`` block runs with vLLM's python first on
  ``PATH``, as the README says (a newcomer's empty home: ``tests/test_fresh_clone.py``);
* ``<!-- test: output -->``: the standard output of the block before it, line for line (``...``
  stands for any text, for timings); of its last command, for a block of several (an install,
  then the command whose output is shown).

A README block with no directive fails the test: nothing in the README goes unchecked. In
``docs/``, a block with a ``run`` directive is run the same way (a page there may also show
commands that need what a reader has and CI does not, a cloud account or a GPU: those carry no
directive).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
from helpers.environments import require
from helpers.paths import REPO

from devtools.environments import ENVIRONMENTS, environment

DIRECTIVE = re.compile(r"<!-- test: ([a-z_ ]+) -->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Block:
    file: str  # relative to the repository
    line: int
    lang: str
    code: str
    directive: str | None
    output: str | None = None

    @property
    def words(self) -> list[str]:
        return (self.directive or "").split()


def _blocks(file: str) -> list[Block]:
    with open(os.path.join(REPO, file), encoding="utf-8") as f:
        text = f.read()
    blocks: list[Block] = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        directive = DIRECTIVE.fullmatch(before.strip())
        block = Block(
            file,
            text[: match.start()].count("\n") + 1,
            match.group(1),
            match.group(2),
            directive.group(1).strip() if directive else None,
        )
        if block.words == ["output"]:
            assert blocks, "an output block with no block before it"
            blocks[-1].output = block.code
            continue
        blocks.append(block)
    return blocks


BLOCKS = _blocks("README.md")
DOC_BLOCKS = [
    block
    for page in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    for block in _blocks(os.path.relpath(page, REPO))
    if block.directive is not None
]


def _param(block: Block):
    marks = [getattr(pytest.mark, word) for word in block.words[1:]]
    first = block.code.strip().splitlines()[0][:40]
    page = "" if block.file == "README.md" else os.path.basename(block.file) + "-"
    return pytest.param(block, marks=marks, id=f"{page}line{block.line}-{first}")


#: what the tests' own environment holds that a reader's does not: the tests' import path and
#: their settings (the README states every variable a block needs, in the block)
_NOT_A_READERS = (
    "PYTHONPATH",
    "PYTEST_",
    "SHARDLOAD_REQUIRE_",
    "SHARDLOAD_VLLM_PYTHON",
    "SHARDLOAD_QUANT_PYTHON",
    "SHARDLOAD_AZURITE",
    "VLLM_",
)


def reader_env() -> dict:
    """The environment a reader runs the README's blocks in: this one without what only the
    tests set."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_NOT_A_READERS)}


def _run(lang: str, code: str, timeout: float, needs: tuple = ()) -> subprocess.CompletedProcess:
    env = reader_env()
    for name in needs:  # where the environments it names are, as a reader who made them knows
        env[environment(name).program_env] = require(name)
    python = sys.executable
    if "vllm" in needs:  # vLLM's own environment first on PATH: its python, its `vllm`
        python = require("vllm")
        env["PATH"] = os.pathsep.join([os.path.dirname(python), env.get("PATH", "")])
    else:  # the python the README's install went into, first on PATH
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="shardload-readme-") as folder:
        script = os.path.join(folder, "block.sh" if lang == "bash" else "block.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        command = ["bash", "-e", "-o", "pipefail", script] if lang == "bash" else [python, script]
        return subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )


def _matches(expected: str, got: str, whole: bool = True) -> bool:
    """``got`` is ``expected`` (``...``: any text), or, not ``whole``, ends with it."""
    pattern = ".*?".join(re.escape(part) for part in expected.rstrip().split("..."))
    if not whole:
        pattern = rf"(?:.*\n)?{pattern}"
    return re.fullmatch(pattern, got.rstrip(), re.S) is not None


def test_every_block_says_how_it_is_checked():
    unchecked = [b.line for b in BLOCKS if b.directive is None]
    assert not unchecked, f"README blocks with no <!-- test: ... --> directive: lines {unchecked}"
    assert all(b.words[0] in ("setup", "run") for b in BLOCKS), [b.directive for b in BLOCKS]
    # the set-up commands are the README's; a page of docs/ only runs its blocks
    assert all(b.words[0] == "run" for b in DOC_BLOCKS), [(b.file, b.line) for b in DOC_BLOCKS]
    assert any(b.file == "docs/objects.md" for b in DOC_BLOCKS)


SETUP = [b for b in BLOCKS if b.words[:1] == ["setup"]]


def test_the_test_command_is_what_ci_runs():
    install, tests = (b.code.strip() for b in SETUP)
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert tests in ci.splitlines(), f"{tests!r} is not a line of .ci/run"
    # the first command installs the same way, without the test extra
    assert install.startswith("pip install torch==2.13.0 -e . && ")
    assert tests.startswith('pip install torch==2.13.0 -e ".[test]" && ')


def test_the_first_command_loads_the_example_as_shown():
    install = SETUP[0]
    command = install.code.strip().split(" && ", 1)[1]
    done = _run("bash", command, 300)
    assert done.returncode == 0, done.stderr
    assert _matches(install.output, done.stdout), done.stdout


@pytest.mark.parametrize(
    "block", [_param(b) for b in BLOCKS + DOC_BLOCKS if b.words[:1] == ["run"]]
)
def test_the_block_runs_as_written(block: Block):
    done = _run(block.lang, block.code, 900, tuple(w for w in block.words if w in ENVIRONMENTS))
    where = f"{block.file} line {block.line}"
    assert done.returncode == 0, f"{where}:\n{done.stdout}\n{done.stderr}"
    if block.output is not None:
        commands = [line for line in block.code.splitlines() if line.strip()]
        assert _matches(block.output, done.stdout, whole=len(commands) == 1), (
            f"{where} prints\n{done.stdout}\nnot\n{block.output}"
        )
