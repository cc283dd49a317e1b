"""Stopping a run between steps: SIGTERM and SIGUSR2 ask for a checkpoint after the current step."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

log = logging.getLogger("ds_trainer")


class StopRequest:
    """SIGTERM (scancel, a scheduler's preemption, `kill`, `docker stop`) or SIGUSR2 (what submitit has
    Slurm send before a time limit) asks the run to stop at the end of the current step with a
    checkpoint, instead of dying mid-step: nothing is lost. The ranks agree on the step through the loss
    all-reduce, so a signal that reaches one rank stops them all together. Whoever handled the signal
    before the run (submitit: requeue the job on SIGUSR2) gets it once the checkpoint is saved."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._announced = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    def __enter__(self) -> StopRequest:
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        if callable(signal.getsignal(signal.SIGCONT)):
            # Slurm sends SIGCONT with its time-limit signal, and submitit's handler for it only logs. A handler
            # that logs fails when the signal lands in the middle of a log write (a traceback in the job's log),
            # so it is ignored while the loop runs. The process continues either way: that is the kernel's.
            self._previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        # No logging here: the signal may arrive while a log handler is writing, and a write from inside the
        # handler then fails ("reentrant call inside BufferedWriter") with a traceback in the job's log.
        if self.signum is None:
            self.signum = signum

    def announce(self) -> None:
        """Log the request once, from the loop (outside the signal handler)."""
        if self.signum is not None and not self._announced:
            self._announced = True
            log.warning("%s: stopping after this step with a checkpoint", self.name)

    def forward(self) -> None:
        """Call the handler the signal had before the run, if it was a Python function."""
        handler = self._previous.get(self.signum) if self.signum else None
        if callable(handler):
            handler(self.signum, None)


class Interrupted(Exception):
    """A signal stopped the run after a step; its checkpoint is saved."""

    def __init__(self, step: int, path: Path | None, stop: StopRequest) -> None:
        where = f"checkpoint {path}" if path else "no checkpoint (it stopped before the first step)"
        super().__init__(f"stopped by {stop.name} after step {step}; {where}. resume=latest continues from it")
        self.stop = stop
