"""Ctrl-C during training stops at the next step boundary, not wherever the signal lands.

A KeyboardInterrupt raised inside a garbage-collection callback or a finalizer (XLA's run during compiles) is
printed and dropped by Python, and the run would go on; raised inside a checkpoint save it could cut the save
short. So the first Ctrl-C only sets a flag the training loop reads between steps; a second one raises at
once, as usual.
"""

from __future__ import annotations

import signal
import threading


class StopOnInterrupt:
    """Context manager: `requested` turns true on the first SIGINT (the default handler is back after it)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C interrupts at once

    def __enter__(self) -> StopOnInterrupt:
        # Only where Python's own handler is installed: not off the main thread, not over a caller's handler, and
        # not where SIGINT is ignored (a background job).
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, self._previous)
