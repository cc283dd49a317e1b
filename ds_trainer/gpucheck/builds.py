"""DeepSpeed's op builds, started in the background when the check starts (review 3's K3).

A cold FusedAdam build (nvcc) or CPU Adam build (two C++ units at -O3) takes a minute or more;
run inside a step's timeout it was killed, and every later DeepSpeed step then found its lock and
built again inside its own timeout, in turn. Here each op the call's steps load is built once, in
a process of its own started at launch (`python -m ds_trainer.tools.ops BUILDER`), with a deadline
it can meet, while the steps that load no op run. A step that loads one waits for its build
first; a build that failed or ran past its deadline skips those steps with its reason.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ds_trainer.gpucheck.steps import BUILDERS

GPU_BUILD_S = 300.0  # cold FusedAdam 30-90 s, CPU Adam 40-60 s on 16 cores, both at once
CPU_BUILD_S = 600.0  # two cores


@dataclass
class Build:
    """One op's background build: its process, its log, when it started and must end."""

    op: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    deadline: float
    ended: float | None = None
    status: str | None = None  # ok, failed, timeout

    def poll(self) -> str | None:
        """The build's status once it has ended (it is stopped at its deadline), else None."""
        if self.status is None and self.proc.poll() is not None:
            self.ended = time.monotonic()
            self.status = "ok" if self.proc.returncode == 0 else "failed"
        if self.status is None and time.monotonic() > self.deadline:
            stop(self.proc)
            self.ended, self.status = time.monotonic(), "timeout"
        return self.status

    def wait(self, until: float) -> str | None:
        """Wait for the build's end, at most until the monotonic time `until`."""
        while self.poll() is None and time.monotonic() < until:
            time.sleep(0.2)
        return self.status

    def seconds(self) -> float:
        return round((self.ended or time.monotonic()) - self.started, 1)

    def said(self) -> str:
        """What the build printed about its op (`name: ready`, `name: FAILED (...)`), or its
        last line."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        mine = [ln for ln in lines if ln.startswith(f"{BUILDERS[self.op]}:")]
        return (mine or lines or ["no output"])[-1][:300]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in a session of its own, with everything it started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
            return


def start(ops: list[str], logs: Path, cpu: bool) -> dict[str, Build]:
    """Start a build of each op (in the order given), each in a session of its own."""
    logs.mkdir(parents=True, exist_ok=True)
    builds = {}
    for op in ops:
        log = logs / f"build_{op}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "ds_trainer.tools.ops", BUILDERS[op]],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        now = time.monotonic()
        builds[op] = Build(op, proc, log, now, now + (CPU_BUILD_S if cpu else GPU_BUILD_S))
    return builds


def stop_all(builds: dict[str, Build]) -> None:
    """At the end of the check: a build still running is stopped (its lock is cleared by the next
    run's watcher, ds_trainer/train/process/op_builds.py)."""
    for build in builds.values():
        if build.poll() is None:
            stop(build.proc)
            build.status = "timeout"
