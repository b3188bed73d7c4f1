"""Errors the training CLI reports as one line (kept free of heavy imports)."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss or gradient); the message says where and why."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run; the message says at which step and which checkpoint a re-run resumes from."""
