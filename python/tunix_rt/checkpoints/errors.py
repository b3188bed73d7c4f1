"""Errors a user can act on when a checkpoint cannot be read (CLI prints them as one line)."""


class CheckpointError(ValueError):
    """A model path that is missing, unreadable, corrupt or inconsistent with its config."""
