"""Failures a user can act on, reported in one line without a traceback. Torch-free."""


class TrainingError(Exception):
    """Training stopped for a reason the user can fix (bad data, a missing op, out of memory)."""


class DataError(TrainingError):
    """Data that cannot be trained on, found before training starts."""
