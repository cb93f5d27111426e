"""The ``shardload`` command line: the only package that knows about the terminal.

``app`` is the group (exit codes, output that fails where it can be reported, ``--json``
errors, Ctrl-C), ``options`` what several commands take, ``tables`` how they print; each
command is a module of its own, registered here, one line each. A new command is a new module
and one ``cli.add_command`` line below.

>>> from click.testing import CliRunner
>>> CliRunner().invoke(cli, ["funcs"]).output.splitlines()[0].split()
['name', 'array', 'args', 'description']
"""

from .app import cli, main
from .codes import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_LOAD_FAILED, EXIT_OK
from .funcs import funcs
from .inspect import inspect
from .load import load
from .plan import plan
from .run import run
from .validate import validate
from .vllm_overrides import vllm_overrides

cli.add_command(load)
cli.add_command(plan)
cli.add_command(validate)
cli.add_command(inspect)
cli.add_command(run)
cli.add_command(vllm_overrides)
cli.add_command(funcs)

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERRUPTED",
    "EXIT_LOAD_FAILED",
    "EXIT_OK",
    "cli",
    "main",
]
