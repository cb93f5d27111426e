"""The CLI's exit codes (docs/cli.md, "Exit codes and errors"): what a script sees.

0 ok, 1 load failure (or output that cannot be written: a full disk), 2 bad usage / plan /
checkpoint (an unreadable input path too), 130 interrupted, 141 standard output closed early
(``shardload funcs | head -1``: quiet, as a tool killed by SIGPIPE would be; the shell shows
141 for those too).
"""

EXIT_OK, EXIT_LOAD_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
#: standard output closed before all was written (128 + SIGPIPE, as the shell reports a tool
#: that SIGPIPE ended)
EXIT_BROKEN_PIPE = 141
