"""The test suite stands on its own (DESIGN.md §8): no test module imports another test module or
``conftest``. What several modules share lives in ``tests/helpers`` (imported as ``helpers.*``)
or, for fixtures, in ``conftest.py``, which pytest loads itself.

Every ``import`` counts, including those inside functions and those of the Python scripts a test
keeps in a string to run in a subprocess (``python -c``). The modules are read with ``ast``, so
nothing is imported; ``tests/helpers`` is held to the same rule.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
#: a test module (``test_x``) or conftest, as a module name: bare (tests/ is on sys.path),
#: under the package ``tests``, or relative (``.conftest``)
FORBIDDEN = re.compile(r"^(tests\.)?(conftest|test_\w+)(\.|$)")


def _modules() -> list[str]:
    """tests/test_*.py and every module under tests/helpers, relative to tests/."""
    found = sorted(f for f in os.listdir(TESTS) if f.startswith("test_") and f.endswith(".py"))
    for folder, _, files in os.walk(os.path.join(TESTS, "helpers")):
        found += sorted(
            os.path.relpath(os.path.join(folder, f), TESTS) for f in files if f.endswith(".py")
        )
    return found


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (``from tests import conftest``: tests.conftest)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if base in ("", "tests"):  # from . import x, from tests import x: x may be a module
        return [f"{base}.{alias.name}".lstrip(".") for alias in node.names]
    return [base]


def _scripts(tree: ast.AST):
    """(line, tree) of each string constant that is Python with an import in it: the scripts a
    test runs in a subprocess."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "import " in node.value
        ):
            try:
                yield node.lineno, ast.parse(textwrap.dedent(node.value))
            except SyntaxError:
                continue


def offences(source: str, name: str, scripts: bool = True) -> list[str]:
    """``name:line imports module`` for each import of a test module or conftest in ``source``
    (and, with ``scripts``, in the scripts it keeps in strings)."""
    tree = ast.parse(source)
    found = []
    parts = [(0, tree)]
    if scripts:
        parts += [(line - 1, script) for line, script in _scripts(tree)]
    for offset, part in parts:
        for node in ast.walk(part):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for module in _imported(node):
                    if FORBIDDEN.match(module):
                        found.append(f"{name}:{offset + node.lineno} imports {module}")
    return found


def test_the_modules_are_read():
    modules = _modules()
    assert "test_suite_layout.py" in modules and "helpers/paths.py" in modules
    assert len([m for m in modules if m.startswith("test_")]) > 50


@pytest.mark.parametrize("module", _modules())
def test_no_test_module_imports_another_or_conftest(module):
    with open(os.path.join(TESTS, module), encoding="utf-8") as f:
        # this module's own strings are the examples of what the rule refuses
        found = offences(f.read(), f"tests/{module}", scripts=module != "test_suite_layout.py")
    assert not found, (
        "a test module imports another test module or conftest; move what it "
        "needs to tests/helpers (fixtures: conftest.py): " + "; ".join(found)
    )


def test_the_rule_catches_every_form():
    # written line by line, so that no line of this module starts with such an import
    source = "\n".join(
        [
            "import test_planner",
            "from conftest import EXAMPLE",
            "from .conftest import REPO",
            "from tests.conftest import subprocess_env",
            "from tests import test_vllm",
            "import tests.test_plan as plan_tests",
            "def lazily():",
            "    from test_planner_gguf_mlc import write_gguf",
            "SCRIPT = 'import helpers.fault_plugins; from test_faults import hang_plan'",
        ]
    )
    assert offences(source, "t.py") == [
        "t.py:1 imports test_planner",
        "t.py:2 imports conftest",
        "t.py:3 imports conftest",
        "t.py:4 imports tests.conftest",
        "t.py:5 imports tests.test_vllm",
        "t.py:6 imports tests.test_plan",
        "t.py:8 imports test_planner_gguf_mlc",
        "t.py:9 imports test_faults",
    ]
    fine = "\n".join(
        [
            "import helpers.fault_plugins",
            "from helpers.paths import EXAMPLE",
            "from helpers import test_tools_are_not_test_modules",
            "from shardload.testing import conftest_like",
            "SCRIPT = 'import numpy as np; from helpers.fault_plans import params'",
        ]
    )
    assert offences(fine, "t.py") == []
