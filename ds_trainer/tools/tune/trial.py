"""One trial of a quality tune: a real training run, followed through its `metrics.jsonl`.

The run (`python -m ds_trainer`, or a one-run multirun through `tune.launcher`, as a speed cell)
validates at every rung; each validation loss is reported to the study at the images the run has
seen (its step x images a step), so trials compare at the same images, and for one batch at the
same steps. At a rung that trials running beside it have not reached yet, the ruling waits for them
(Watch). When the pruner says so the run is stopped cleanly (SIGTERM, or Ctrl-C to a launcher:
it finishes its step and writes `summary.json`), its checkpoint removed, and the trial is pruned.
The run dies with its worker (the kernel sends it SIGTERM when the worker's process ends), so a
killed worker leaves no training behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_trainer.tools.tune import cell

_PR_SET_PDEATHSIG = 1
# How often the run's metrics are read: a pruned run trains on until the next read and its stop (a
# tiny model's steps take 0.1 s: at 0.5 s a trial pruned at its rung after a wait reached its end)
POLL_S = 0.2


@dataclass
class Plan:
    """What one trial runs: its overrides and its schedule in steps of its own batch."""

    overrides: list[str]
    images_per_step: int
    max_steps: int
    every: int
    ranks: int
    seeds: dict[str, int] = field(default_factory=dict)


@dataclass
class Outcome:
    """How a trial ended: `complete` (its last validation), `pruned` or `failed`, and its curve."""

    state: str
    value: float | None
    message: str | None
    curve: list[list[float]]  # [images seen, seconds since its start, validation loss]
    steps: int
    seconds: float
    run_dir: Path


def die_with_parent(sig: int) -> Any:
    """A preexec_fn: the child gets `sig` when the process that started it ends (Linux)."""
    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    return preexec if sys.platform.startswith("linux") else None


class Unscored:
    """A run followed outside the study (the chosen trial trained again): nothing reported."""

    intermediate_values: dict[int, float] = {}

    def report(self, value: float, step: int) -> None:
        """Nothing: the run is not a trial of the study."""

    def should_prune(self) -> bool:
        return False

    def set_user_attr(self, key: str, value: Any) -> None:
        """Nothing: the rerun's record is written once it ends."""


class Follower:
    """The validation rows and the last step a run has written so far (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step = path, 0, 0
        self.rows: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        """The validation rows written since the last read."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = []
        for line in complete.decode().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            self.step = max(self.step, int(row.get("step", 0)))
            if "val_loss" in row:
                new.append(row)
        self.rows += new
        return new


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads is not None and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(threads)  # local workers share the machine's cores
    return env


class Watch:
    """The trial's side of the study while its run goes: reports, the heartbeat, what it spent.

    `gate(images)`: whether trials still short of that rung run beside this one. The pruner rules
    at a rung on the trials that reached it; the first to get there has none to compare with and
    would go on however it did. So while the gate says so the ruling waits (the run trains on, its
    later validations held back), for at most as many steps again as it took to reach the rung."""

    def __init__(self, trial: Any, plan: Plan, heartbeat_s: float,
                 gate: Callable[[int], bool] | None = None) -> None:
        self.trial, self.plan, self.heartbeat_s, self.gate = trial, plan, heartbeat_s, gate
        self.start = time.time()
        self.beat = 0.0
        self.curve: list[list[float]] = []
        self.pruned_at: int | None = None  # the rung (images) the pruner stopped it at
        self.queue: list[dict[str, Any]] = []  # validations read, not yet ruled on
        self.told: set[int] = set()  # the images reported

    def progress(self, follower: Follower, final: bool = False) -> bool:
        """Report the new validations (and the heartbeat when due); True when the pruner stops
        the trial (never after its last step, nor once the run has ended)."""
        new = follower.read()
        for row in new:
            self.curve.append([int(row["step"]) * self.plan.images_per_step,
                               round(time.time() - self.start, 2), float(row["val_loss"])])
        if self.pruned_at is None:  # a pruned run's validations on its way out: drawn, not reported
            self.queue += new
        prune = False
        # never once the run has trained its last step: it ended as it would have, not pruned
        ruled = not final and follower.step < self.plan.max_steps
        while self.queue and not prune:
            row = self.queue[0]
            images = int(row["step"]) * self.plan.images_per_step
            if images not in self.told:
                self.told.add(images)
                self.trial.report(float(row["val_loss"]), images)
            if ruled and self._held(images, follower.step):
                break
            self.queue.pop(0)
            if ruled:
                prune = self.trial.should_prune()
                self.pruned_at = images if prune else None
        if prune:
            self.queue.clear()  # validated past the rung while held: drawn, never reported
        if new or final or time.time() - self.beat >= self.heartbeat_s:
            self.say(follower)
        return prune

    def _held(self, images: int, step: int) -> bool:
        """Whether the ruling at `images` waits for the trials still short of it: while the run
        has trained fewer steps past the rung than it took to reach it."""
        rung_step = images // self.plan.images_per_step
        return self.gate is not None and step - rung_step < rung_step and self.gate(images)

    def say(self, follower: Follower) -> None:
        """The heartbeat: alive now, the steps and device seconds spent, the curve so far."""
        self.beat = time.time()
        elapsed = self.beat - self.start
        for key, value in (("alive", self.beat), ("steps", follower.step),
                           ("device_s", round(elapsed * self.plan.ranks, 2)),
                           ("curve", self.curve)):
            self.trial.set_user_attr(key, value)


def run(  # noqa: PLR0913 - the trial, its run and how it is followed, one argument each
        trial: Any, plan: Plan, trial_dir: Path, launcher: str | None, limit_s: float | None,
        heartbeat_s: float, threads: int | None = None,
        gate: Callable[[int], bool] | None = None) -> Outcome:
    """Run the trial to its end, its pruning or its time limit (`gate`: see Watch)."""
    cmd, run_dir = cell.command(plan.overrides, trial_dir, launcher)
    if trial_dir.exists():
        shutil.rmtree(trial_dir)  # a trial number is used once; a folder left is a lost run's
    trial_dir.mkdir(parents=True)
    watch = Watch(trial, plan, heartbeat_s, gate)
    watch.say(Follower(run_dir / "metrics.jsonl"))
    follower = Follower(run_dir / "metrics.jsonl")
    death = signal.SIGINT if launcher is not None else signal.SIGTERM
    with (trial_dir / "trial.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_env(threads), preexec_fn=die_with_parent(death))
        ended = _follow(proc, watch, follower, launcher, limit_s)
    watch.progress(follower, final=True)
    steps, seconds = follower.step, time.time() - watch.start
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if ended == "pruned":
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a pruned trial never resumes
        why = f"pruned at the rung of {watch.pruned_at} images (stopped after step {steps})"
        return Outcome("pruned", None, why, watch.curve, steps, seconds, run_dir)
    if ended == "timeout":
        return Outcome("failed", None, f"no end within tune.trial_limit_s={limit_s:g} s; stopped",
                       watch.curve, steps, seconds, run_dir)
    if summary.get("status") == "ok" and watch.curve and steps >= plan.max_steps:
        return Outcome("complete", watch.curve[-1][2], None, watch.curve, steps, seconds, run_dir)
    tail = (trial_dir / "trial.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    why = summary.get("message") or f"exit status {proc.returncode}: {tail[0][:300]}"
    return Outcome("failed", None, f"{summary.get('status', 'error')}: {why}", watch.curve, steps,
                   seconds, run_dir)


def _follow(proc: subprocess.Popen[bytes], watch: Watch, follower: Follower,
            launcher: str | None, limit_s: float | None) -> str:
    """Poll the run until it ends ("ended"), is pruned ("pruned") or runs out of time."""
    try:
        while proc.poll() is None:
            cell.raise_if_stopped()
            if watch.progress(follower):
                cell.stop(proc, launcher)
                return "pruned"
            if limit_s is not None and time.time() - watch.start > limit_s:
                cell.stop(proc, launcher)
                return "timeout"
            time.sleep(POLL_S)
        return "ended"
    except BaseException:  # the worker is stopped (Ctrl-C, SIGTERM): its run must not go on alone
        cell.stop(proc, launcher)
        raise
