"""The `tunix-rt` console script's start, kept free of imports so that it runs before jax, flax and the model.

Importing jax and flax and loading a model make about a million objects that live as long as the process.
Python's cyclic collector walks them again and again while they are made (a warm `tunix-rt generate` on the
default model spent 0.15 s of its 1.6 s in ~450 collections that freed almost nothing), so the console
script pauses it before the first import, and the command resumes it (`resume_gc`) once its model is loaded,
after freezing what is alive then (`gc.freeze`: those objects are never walked again). A command that does not
call `resume_gc` before its work has it resumed before it starts (`tunix_rt.cli.main`).
"""

from __future__ import annotations

import gc

_paused = False


def pause_gc() -> None:
    """Stop cyclic collection until `resume_gc` (a no-op where it is already off: the caller's choice stands)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """Freeze what is alive and restart the collection `pause_gc` stopped; a no-op otherwise."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def entry() -> None:
    pause_gc()
    from tunix_rt.cli import entry as cli_entry

    cli_entry()
