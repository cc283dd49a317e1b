"""Where the time from process start to the first training step goes, logged once at the first step.

A requeued Slurm job signalled before its first step makes no progress however often it comes back, so
start-up time matters. `mark(part)` closes a part (the time since the previous mark); the first
metrics row logs the line `start-up: 9.1 s to the first step (import 2.3, compose/validate 0.8, ...)`.
The clock starts at the process's creation (from /proc), so the interpreter's own imports count too.
Torch-free.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("ds_trainer")

_parts: list[tuple[str, float]] = []
_last: list[float] = []
_done: list[bool] = []


def process_start() -> float:
    """The process's start as a time.time() value (Linux: /proc; elsewhere: the first call).

    The boot time comes from the uptime (1/100 s), not /proc/stat's `btime`, which is rounded to a whole
    second and made every start-up total read up to a second high."""
    from ds_trainer.config.rundir import since_boot

    started = since_boot(os.getpid())
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() if started is None else time.time() - uptime + started


def mark(part: str) -> None:
    """Close the part of start-up that ends now (a later mark of the same part adds to it)."""
    now = time.time()
    if not _last:
        _last.append(process_start())
    _parts.append((part, max(0.0, now - _last[0])))
    _last[0] = now


def finished() -> bool:
    """Whether the first training step has ended (start-up is over)."""
    return bool(_done)


def first_step() -> None:
    """Log the start-up line once, at the end of the first training step."""
    if _done or not _last:
        return
    _done.append(True)
    total = time.time() - process_start()
    mark("first step")
    merged: dict[str, float] = {}
    for part, seconds in _parts:
        merged[part] = merged.get(part, 0.0) + seconds
    parts = ", ".join(f"{p} {s:.1f}" for p, s in merged.items())
    log.info("start-up: %.1f s to the end of the first step (%s; seconds)", total, parts)
