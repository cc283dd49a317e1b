"""Failures a user can act on, reported in one line without a traceback. Torch-free."""


class TrainingError(Exception):
    """Training stopped for a reason the user can fix (bad data, a missing op, out of memory)."""

    exit_status = 1


class InputError(TrainingError):
    """What the user pointed the run at (images, weights) cannot be trained on, found before training
    starts: a user mistake, so `python -m ds_trainer` exits 2 as for a bad override."""

    exit_status = 2


class DataError(InputError):
    """Data that cannot be trained on, found before training starts."""


class NodesError(TrainingError):
    """The ranks of a multi-node run could not meet at the master address, or do not share the run
    directory. A sweep cell's job fails with it: the launcher may not see the run directory to read why."""


class Stopped(TrainingError):
    """A signal stopped the run (Ctrl-C, SIGTERM, SIGUSR2): the exit status is the shell's, 128 + the signal."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status
