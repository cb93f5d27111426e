"""``shardload funcs``: the registered shard functions."""

from __future__ import annotations

import click

from .app import Command, out
from .tables import table


@click.command(cls=Command)
@click.option(
    "--plugin", "plugins", multiple=True, metavar="MODULE", help="Import MODULE first. Repeatable."
)
def funcs(plugins: tuple[str, ...]) -> None:
    """List the registered shard functions."""
    from ..registry import list_shard_funcs, load_plugins

    load_plugins(plugins)
    entries = list_shard_funcs()
    out(
        table(
            ["name", "array", "args", "description"],
            [[f.name, f.array, f.arity_text(), f.doc.replace("``", "")] for f in entries],
        )
    )
    out(
        "Plans name these functions; add your own with @register_shard_func in a module "
        "passed as --plugin MODULE."
    )
