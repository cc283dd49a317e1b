"""Stopping a run: Ctrl-C, SIGTERM and SIGUSR2 ask for a checkpoint after the current step; a second Ctrl-C
stops at once.

- SIGINT (Ctrl-C in a terminal), SIGTERM (scancel, a scheduler's preemption, `kill`, `docker stop`) and SIGUSR2
  (what submitit has Slurm send before a time limit) ask the run to finish the step in flight, save a
  checkpoint and stop: nothing trained is lost. The ranks agree on the step through the loss all-reduce, so a
  signal that reaches one rank stops them all after the same step.
- A second Ctrl-C while that step finishes or its checkpoint is written stops at once (`StopNow`): the step in
  flight is lost, a checkpoint being written stays hidden (`.step_N.partial/`, never resumed from).
- Ctrl-C before the first step or after the last (loading, the cache, the export) stops at once too.

A terminal's Ctrl-C reaches every process of its foreground group, and torchrun (or `accelerate launch`) then
passes it on to its ranks: a rank sees two SIGINTs within milliseconds for one key press. A second SIGINT
counts only after `AGAIN_AFTER_S`. torchrun kills its ranks 30 s after passing a signal on (its
`--shutdown-timeout`), which bounds the time to save there.

A process whose SIGINT is ignored (a shell's background job, nohup) keeps ignoring it. Whoever handled SIGTERM or
SIGUSR2 before the run (submitit: requeue the job on SIGUSR2) gets the signal once the checkpoint is saved.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ds_trainer")

AGAIN_AFTER_S = 1.0
_received: list[int] = []  # every stop signal this process got (the startup handler and StopRequest record them)


def received() -> int | None:
    """The first stop signal this process received, if any: whatever failed after it, the run was stopped."""
    return _received[0] if _received else None


def name(signum: int | None) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name if signum else "a signal"


def exit_status(signum: int | None) -> int:
    """What a shell reports for a process ended by `signum`: 128 + its number (130 for Ctrl-C)."""
    return 128 + int(signum) if signum else 1


class StopNow(KeyboardInterrupt):
    """A second Ctrl-C (or Ctrl-C outside the training loop): stop where the run is. A KeyboardInterrupt, so
    that no library's `except Exception` swallows it."""


def _ignored(signum: int) -> bool:
    return signal.getsignal(signum) is signal.SIG_IGN


def _immediate(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal's handler signature
    _received.append(signum)
    raise StopNow(signum)


class Immediate:
    """Outside the training loop: Ctrl-C stops at once, recorded (so the run reports `interrupted`, not an error)."""

    def __enter__(self) -> Immediate:
        self._previous = None if _ignored(signal.SIGINT) else signal.signal(signal.SIGINT, _immediate)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class StopRequest:
    """The training loop's handler of SIGINT, SIGTERM and SIGUSR2 (see the module docstring)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)

    def __init__(self, terminal: bool = False) -> None:
        self.signum: int | None = None
        self._at = 0.0
        self._previous: dict[int, Any] = {}
        self._announced = False
        self._terminal = terminal  # rank 0: say at once, on stderr, that Ctrl-C was heard

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return name(self.signum)

    def __enter__(self) -> StopRequest:
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS
                          if not (signum == signal.SIGINT and _ignored(signum))}
        if callable(signal.getsignal(signal.SIGCONT)):
            # Slurm sends SIGCONT with its time-limit signal, and submitit's handler for it only logs. A handler
            # that logs fails when the signal lands in the middle of a log write (a traceback in the job's log),
            # so it is ignored while the loop runs. The process continues either way: that is the kernel's.
            self._previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal's handler signature
        # No logging here: the signal may arrive while a log handler is writing, and a write from inside the
        # handler then fails ("reentrant call inside BufferedWriter") with a traceback in the job's log.
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._at = signum, now
            _received.append(signum)
            if signum == signal.SIGINT and self._terminal:
                os.write(2, b"\nds_trainer: Ctrl-C: stopping after this step with a checkpoint "
                            b"(Ctrl-C again to stop at once, without it)\n")
            return
        if signum == signal.SIGINT == self.signum and now - self._at > AGAIN_AFTER_S:
            raise StopNow(signum)

    def announce(self, progress: Any = None) -> None:
        """Log the request once, from the loop (outside the signal handler), and show it on the progress bar."""
        if self.signum is not None and not self._announced:
            self._announced = True
            log.warning("%s: stopping after this step with a checkpoint", self.name)
            if progress is not None:
                progress.set_description(f"stopping ({self.name})", refresh=True)

    def forward(self) -> None:
        """Call the handler SIGTERM or SIGUSR2 had before the run, if it was a Python function (SIGINT's was
        Python's KeyboardInterrupt, which is what this module replaces)."""
        handler = self._previous.get(self.signum) if self.signum and self.signum != signal.SIGINT else None
        if callable(handler):
            handler(self.signum, None)


class Interrupted(Exception):
    """A signal stopped the run: after a step with its checkpoint saved, or (`now`) at once."""

    def __init__(self, signum: int | None, step: int, path: Path | None, stop: StopRequest | None = None,
                 now: bool = False) -> None:
        where = f"checkpoint {path}" if path else "no checkpoint"
        if now:
            stopped = (f"stopped at once by {name(signum)} during step {step}: no checkpoint was written for this "
                       f"step" if step else f"stopped by {name(signum)} before the first step")
            text = f"{stopped}; resume=latest continues from " + (f"{where}" if path else "the start")
        else:
            text = f"stopped by {name(signum)} after step {step}; {where}. resume=latest continues from it"
        super().__init__(text)
        self.signum, self.stop = signum, stop
