"""Adding a command to the CLI: one module (``helpers/hello_command.py``) and one
registration, the ``cli.add_command`` line every real command has in ``shardload/cli/__init__.py``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import hello_command

from shardload.cli import cli

CLI_INIT = Path(__file__).resolve().parent.parent / "shardload" / "cli" / "__init__.py"


@pytest.fixture
def registered(monkeypatch):
    # the group's table of commands is restored afterwards: other tests see the real CLI
    monkeypatch.setattr(cli, "commands", dict(cli.commands))
    cli.add_command(hello_command.hello)  # the one registration


def test_a_new_command_is_one_module_and_one_registration(registered):
    top = CliRunner().invoke(cli, ["--help"])
    assert top.exit_code == 0 and "hello" in top.output and "Say hello" in top.output
    done = CliRunner().invoke(cli, ["hello", "--name", "shardload"])
    assert done.exit_code == 0 and done.stdout == "hello, shardload\n"
    # it shares the app layer: --json, and usage errors as one JSON object under --json
    assert json.loads(CliRunner().invoke(cli, ["hello", "--json"]).stdout) == {"hello": "world"}
    bad = CliRunner().invoke(cli, ["hello", "--json", "--bogus"])
    assert bad.exit_code == 2 and json.loads(bad.stderr)["error"]["type"] == "NoSuchOption"


def test_the_real_commands_are_registered_the_same_way():
    # each command in cli/__init__.py: imported from its own module, added by one call
    tree = ast.parse(CLI_INIT.read_text())
    added = [
        node.value.args[0].id
        for node in tree.body
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "cli.add_command"
    ]
    assert sorted(added) == sorted(name.replace("-", "_") for name in cli.commands)
    sources = {
        alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert all(sources[name] == name for name in added), sources
