"""Start a Python command as a terminal would, with SIGINT's default action whatever the test runner's is.

A runner started in the background ignores SIGINT and its children inherit that. Resetting it in a preexec_fn
forks the multithreaded test process and runs Python in the child, which can deadlock there (JAX's threads may
hold locks at the fork); here a fresh interpreter resets it and execs the command.
"""

import sys

_RESET_AND_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def python_from_a_terminal(*args: str) -> list[str]:
    """argv running `python ARGS...` with SIGINT at its default action."""
    return [sys.executable, "-c", _RESET_AND_EXEC, *args]
