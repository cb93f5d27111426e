"""Built-in shard functions, registered under the ``shardload.`` namespace on import."""

from . import builtin  # noqa: F401
