"""Ctrl-C in the CLI's own process: at once before work starts, in order after.

Before a command starts work (parsing its arguments, importing torch and the loader: nothing
exists yet that needs cleaning up), SIGINT ends the process at once, "Interrupted." and exit
130. Python's own handler would raise ``KeyboardInterrupt`` wherever the main thread is, and
during an import that can be lost: raised in importlib's weakref callback, CPython prints
"Exception ignored" and the command runs on to exit 0; raised in torch's initialisation, the
process has aborted (SIGABRT).

Once work starts (a session, a scratch folder, a child process), ``KeyboardInterrupt`` is
wanted: the orderly path closes what was opened. The interrupt is also recorded, and ``check``
at the boundaries between a command's phases raises it again where CPython swallowed it.

Only ``main()`` (the CLI's own process) installs anything; a test calling ``cli.main`` keeps the
handlers it has.

>>> work_starts(); check()      # nothing installed, nothing recorded: no-op
"""

from __future__ import annotations

import os
import signal
import threading

from .codes import EXIT_INTERRUPTED

_installed = False
_interrupted = False


def _exit_at_once(signum, frame) -> None:
    """Nothing to clean up yet: say so and end, without unwinding through an import."""
    try:
        os.write(2, b"\nInterrupted.\n")
    finally:
        os._exit(EXIT_INTERRUPTED)


def _record_and_raise(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    signal.default_int_handler(signum, frame)


def exit_at_once() -> None:
    """Install the exit-at-once handler: called by ``main()`` before anything is parsed."""
    global _installed
    # only over Python's own handler: SIGINT ignored (a background job) stays ignored
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _exit_at_once)
        _installed = True


def work_starts() -> None:
    """From here on Ctrl-C raises ``KeyboardInterrupt`` (Python's default), so that what the
    command opens is closed. Called before the first session, checkpoint or scratch folder is
    made; calling it again is harmless."""
    if _installed and signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, _record_and_raise)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if Ctrl-C came after work started: a no-op unless CPython
    swallowed the first one (in a weakref callback or a ``__del__``, it only prints "Exception
    ignored")."""
    if _interrupted:
        raise KeyboardInterrupt
