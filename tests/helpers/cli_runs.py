"""The CLI run in-process, as the CLI tests run it: ``run_cli`` (click's ``CliRunner``; every
argument given as a string; stdout and stderr kept apart, click >= 8.2) and ``invoke_ok``
(the same, asserting exit code 0)."""

from __future__ import annotations

from click.testing import CliRunner

from shardload.cli import cli


def run_cli(*args):
    """Invoke the CLI in-process with ``args`` (each as a string); click's ``Result``."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def invoke_ok(*args):
    """``run_cli(*args)``, which must exit 0; its ``Result``."""
    result = run_cli(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result
