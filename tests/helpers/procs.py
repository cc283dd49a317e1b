"""Waiting on and stopping the processes a test starts."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_until(condition: Callable[[], Any], message: str, *, deadline: float,
               proc: subprocess.Popen | None = None, interval: float = 0.2) -> Any:
    """Poll `condition` until it returns something true, and return that; fail with `message` when the
    deadline passes or `proc` (the process expected to make it true) ends first."""
    while not (value := condition()):
        assert (proc is None or proc.poll() is None) and time.time() < deadline, message
        time.sleep(interval)
    return value


def sigint_at_default() -> None:
    """A `preexec_fn`: SIGINT at its default disposition, as a terminal's foreground job has it. A child inherits
    an ignored SIGINT (a shell's background job, a test runner's worker may have one), and Python then installs no
    KeyboardInterrupt handler: Ctrl-C would do nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kill_9_at(proc: subprocess.Popen, root: Path, moment: str, target: int, rng: random.Random,
              jitter: float) -> None:
    """SIGKILL the training run `proc` (its outputs under `root`) while step `target` trains (`moment="step"`: once
    step target-1's checkpoint is complete, after up to `jitter` s more) or while step `target`'s checkpoint is
    being written (`moment="save"`), then reap it."""
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
        ckpt = list(root.glob("outputs/runs/*/*/checkpoints"))
        names = {p.name for p in ckpt[0].iterdir()} if ckpt else set()
        if moment == "save" and f".step_{target:08d}.partial" in names:
            break
        if moment == "step" and f"step_{target - 1:08d}" in names:
            time.sleep(rng.uniform(0.0, jitter))
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
