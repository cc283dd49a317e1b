"""The quality tune's study, shared by every worker: Optuna's storage, sampler and pruner, what the
trials have spent of the budget, and the trials of workers that were lost.

The storage is a journal file in the tune folder (Optuna's JournalFileBackend, whose lock works on
NFS) or any Optuna RDB URL (`tune.storage`), so workers on several machines share one study. A
worker says every `tune.heartbeat_s` that its trial lives (the trial's `alive` attribute, with the
worker's host and process); a running trial whose worker is gone (its process ended on this host,
or no word for 4 heartbeats from another) is failed by whichever worker looks next, and its
parameters are run once more (`retry_of`). The same command continues a study: finished trials
stay as they are.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config.problems import Problem

STALE_BEATS = 4.0


@dataclass(frozen=True)
class Budget:
    """What stops the search: device seconds (trial seconds x ranks), optimizer steps, trials."""

    seconds: float | None
    steps: int | None
    trials: int | None

    def describe(self) -> str:
        parts = [(self.seconds, f"{(self.seconds or 0) / 3600:g} device-hours"),
                 (self.steps, f"{self.steps} steps"), (self.trials, f"{self.trials} trials")]
        return ", ".join(text for amount, text in parts if amount) or "the whole grid"

    def afforded(self, trial_steps: int) -> int | None:
        """The full trials the budget holds (None: a budget of time alone, or none)."""
        counts = [self.trials, None if self.steps is None else self.steps // trial_steps]
        known = [n for n in counts if n is not None]
        return min(known) if known else None


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "steps": None}


def budget(t: DictConfig) -> tuple[Budget, list[Problem]]:
    """tune.budget (`8h`, `90m`, `600s`, `4000steps`) and tune.trials, read."""
    import re

    trials = None if t.trials is None else int(t.trials)
    problems = []
    if trials is not None and trials < 1:
        problems.append(Problem("tune.trials", trials, "must be at least 1", "tune.trials=20"))
    if t.budget is None:
        return Budget(None, None, trials), problems
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|h|steps)\s*", str(t.budget))
    if match is None or float(match.group(1)) <= 0:
        problems.append(Problem("tune.budget", t.budget, "is a positive number and a unit: s, m "
                                "or h of device time, or steps", "tune.budget=8h, or "
                                "tune.budget=4000steps"))
        return Budget(None, None, trials), problems
    amount, unit = float(match.group(1)), match.group(2)
    scale = _UNITS[unit]
    if scale is None:
        return Budget(None, int(amount), trials), problems
    return Budget(amount * scale, None, trials), problems


def storage(t: DictConfig, tune_dir: Path) -> Any:
    """The study's storage: tune.storage's RDB URL, else a journal file in the tune folder."""
    if t.storage:
        return str(t.storage)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    tune_dir.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(tune_dir / "study.journal")))


def sampler(t: DictConfig, axes: list[Any], startup: int, worker: int = 0) -> Any:
    """tune.sampler, seeded with tune.seed + the worker's index (workers side by side with one
    seed drew the same random trials); TPE draws `startup` trials at random, then models all the
    axes together (multivariate; a running trial counts as the worst so far: constant liar, so
    workers side by side do not draw the same point)."""
    import optuna

    seed = int(t.seed) + worker
    if t.sampler.value == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if t.sampler.value == "grid":
        space = {a.key: list(a.distribution.choices) for a in axes}
        return optuna.samplers.GridSampler(space, seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                      n_startup_trials=startup)


def pruner(t: DictConfig, rung: int, last: int) -> Any:
    """tune.pruner over images seen: the first rung `rung`, a trial's end `last`."""
    import optuna

    name, factor = t.pruner.value, int(t.reduction)
    if name == "halving":
        from ds_trainer.tools.tune.halving import ReachedHalving

        return ReachedHalving(rung, factor)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=rung, max_resource=last,
                                              reduction_factor=factor)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=factor, n_warmup_steps=rung - 1)
    return optuna.pruners.NopPruner()


def open_study(  # noqa: PLR0913 - the study's facts, one argument each
        t: DictConfig, tune_dir: Path, identity: dict[str, Any], axes: list[Any],
        rung: int, last: int, startup: int = 10, worker: int = 0) -> Any:
    """Create the study, or join the one the same command made (refused if it searched
    something else: another tune.name is another study); `worker` seeds this worker's sampler."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    chosen = sampler(t, axes, startup, worker)
    study = optuna.create_study(storage=storage(t, tune_dir), sampler=chosen,
                                pruner=pruner(t, rung, last), study_name=str(t.name),
                                direction="minimize", load_if_exists=True)
    earlier = study.user_attrs.get("identity")
    if earlier is None:
        study.set_user_attr("identity", identity)
        study.set_user_attr("sampler_seed", int(t.seed))
    elif earlier != identity:
        from ds_trainer.tools.tune.space import BadInput

        changed = sorted(k for k in {*earlier, *identity} if earlier.get(k) != identity.get(k))
        raise BadInput([Problem("tune.name", t.name, f"its study ({tune_dir}) searched with "
                                f"another {', '.join(changed)}: {earlier}",
                                "run that study's own command to continue it, or name a new "
                                "study: tune.name=<another name>")])
    return study


def me() -> dict[str, Any]:
    """This worker: its host, process and the process's start (a reused pid is another)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_tick(os.getpid())}


def _start_tick(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _lost(trial: Any, now: float, heartbeat_s: float) -> str | None:
    """Why a running trial's worker is gone, or None while it lives."""
    worker, alive = trial.user_attrs.get("worker"), trial.user_attrs.get("alive")
    if worker is None or alive is None:  # asked, not started yet: the asker is about to say
        started = trial.datetime_start.timestamp() if trial.datetime_start else now
        return f"no worker claimed it in {now - started:.0f} s" if now - started > 600 else None
    if worker["host"] == socket.gethostname() and _start_tick(worker["pid"]) != worker["start"]:
        return f"its worker (pid {worker['pid']} on {worker['host']}) ended"
    if now - float(alive) > STALE_BEATS * heartbeat_s:
        return f"no word from its worker on {worker['host']} for {now - float(alive):.0f} s"
    return None


def sweep_checkpoints(study: Any) -> None:
    """Remove what pruned runs saved on their way out (a launcher's run may write it after its
    trial was told): a pruned trial never resumes."""
    import shutil

    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)):
        if "run_dir" in trial.user_attrs:
            shutil.rmtree(Path(trial.user_attrs["run_dir"]) / "checkpoints", ignore_errors=True)


def abandon(study: Any, trial: Any, why: str) -> None:
    """Fail a trial that will not end by itself, and run its parameters once more (a retry is
    not retried)."""
    from optuna.trial import TrialState

    if f"lost_{trial.number}" in study.user_attrs:
        return  # another worker got there first
    study.set_user_attr(f"lost_{trial.number}", why)
    tell(study, trial.number, state=TrialState.FAIL, skip_if_finished=True)
    if "retry_of" not in trial.user_attrs:
        study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number})


def tell(study: Any, trial: Any, value: float | None = None, **kwargs: Any) -> None:
    """`study.tell`, where the grid sampler's end of the grid is no error: it calls `study.stop`,
    which raises outside `study.optimize` (the trial is stored all the same, before)."""
    try:
        study.tell(trial, value, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def fail_lost(study: Any, heartbeat_s: float) -> list[str]:
    """Fail the running trials whose worker is gone; what happened to each, to print."""
    from optuna.trial import TrialState

    said, now = [], time.time()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        why = _lost(trial, now, heartbeat_s)
        if why is not None:
            abandon(study, trial, why)
            said.append(f"trial {trial.number} failed: {why}; its parameters run again")
    return said


def spent(trials: list[Any]) -> tuple[float, int]:
    """(device seconds, optimizer steps) the trials have used so far, running ones included."""
    seconds = sum(float(t.user_attrs.get("device_s", 0.0)) for t in trials)
    return seconds, sum(int(t.user_attrs.get("steps", 0)) for t in trials)


def started(trials: list[Any]) -> int:
    """Trials that ran (or run) a training: not those refused before, nor repeats of a result."""
    return sum(1 for t in trials if "worker" in t.user_attrs)


def held(trials: list[Any], trial_steps: int) -> int:
    """The steps the running trials may still take: each to its end (one asked and not yet
    planned, a whole trial's)."""
    running = [t for t in trials if t.state.name == "RUNNING"]
    return sum(max(0, int(t.user_attrs.get("max_steps", trial_steps))
                   - int(t.user_attrs.get("steps", 0))) for t in running)


def waits(study: Any, limit: Budget, trial_steps: int) -> bool:
    """Whether a trial of `trial_steps` fits a step budget only once a running trial ends short
    of its end (pruned): then a worker waits for it rather than start."""
    if limit.steps is None:
        return False
    trials = study.get_trials(deepcopy=False)
    return spent(trials)[1] + held(trials, trial_steps) + trial_steps > limit.steps


@contextmanager
def starting(tune_dir: Path) -> Iterator[None]:
    """One worker at a time checks the budget and asks for its trial (a lock file in the tune
    folder, Optuna's, safe on NFS; one left by a killed worker is broken after 30 s): two at once
    each saw room for the last trial and both ran it, a step budget passed by a trial."""
    from optuna.storages.journal import JournalFileOpenLock

    tune_dir.mkdir(parents=True, exist_ok=True)  # an RDB study's folder is made by its first trial
    lock = JournalFileOpenLock(str(tune_dir / "starting"), grace_period=30)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def over(study: Any, limit: Budget, trial_steps: int = 0) -> str | None:
    """Why no further trial starts, or None. A step budget is never passed: a trial starts only
    if its `trial_steps` fit beside what was spent (a time budget: a trial started before it is
    spent runs on)."""
    trials = study.get_trials(deepcopy=False)
    seconds, steps = spent(trials)
    if limit.seconds is not None and seconds >= limit.seconds:
        return f"budget spent: {seconds / 3600:.3g} of {limit.seconds / 3600:g} device-hours"
    if limit.steps is not None and steps + max(1, trial_steps) > limit.steps:
        return (f"budget spent: {steps} of {limit.steps} steps (a trial takes up to "
                f"{trial_steps})")
    if limit.trials is not None and started(trials) >= limit.trials:
        return f"{limit.trials} trials run"
    sampler = study.sampler
    if hasattr(sampler, "is_exhausted") and sampler.is_exhausted(study):
        return "every cell of the grid has run"
    return None
