"""A toy command for ``tests/test_cli_extending.py``: what a new command is, a module of its
own built on the CLI's app layer, registered with one ``cli.add_command`` line."""

from __future__ import annotations

import click

from shardload.cli.app import Command, json_option, out


@click.command(cls=Command)
@click.option("--name", default="world", help="Whom to greet.")
@json_option("Print one JSON object.")
def hello(name: str, as_json: bool) -> None:
    """Say hello (a toy command, for the tests)."""
    out(f'{{"hello": "{name}"}}' if as_json else f"hello, {name}")
