"""Built-in shard functions (``builtin.BUILTINS``), registered under ``shardload.`` by the
registry the first time it is asked for a function."""
