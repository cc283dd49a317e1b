"""The quality tune's course (`tune.objective=quality`): which settings reach the lowest validation
loss in a budget.

1. The axes are the overrides given as sweeps (axes.py); the rest are the training's. Each trial
   trains `train.max_steps` steps and validates every `validation.every` (at the training's own
   batch: a trial of another batch runs the same images, so its steps differ). The rungs are
   `tune.rungs` before its end, the first at `train.max_steps / tune.reduction**tune.rungs`.
2. Workers (`tune.workers` here, and any other process running the same command on the same
   storage) ask the shared study (study.py) for a trial, check it as a run is checked (a refused
   combination, or one the planner predicts above the GPU, is failed with the reason, never
   started), and run it (trial.py); the pruner stops the worse trials at the rungs.
3. The search stops when `tune.budget` (device time or steps) or `tune.trials` is spent; the
   chosen trial (the lowest loss of those that ran to their end) is trained once more from scratch
   and the report written (quality_report.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config.problems import Problem, first_problem
from ds_trainer.tools.tune import cell
from ds_trainer.tools.tune import study as shared
from ds_trainer.tools.tune import trial as trials
from ds_trainer.tools.tune.axes import Axis
from ds_trainer.tools.tune.space import GIB, MEASURE_KEYS, BadInput, override_key

WORKER_ENV = "DS_TRAINER_TUNE_WORKER"  # set on the workers a tune starts: they search, never report
# Set by the tune on each trial: the user's own values of these are read, then replaced.
TRIAL_KEYS = (*MEASURE_KEYS, "validation.every", "train.checkpoint_every_minutes")
BATCH_KEYS = ("train.micro_batch_size", "train.gradient_accumulation_steps")
IDLE_LIMIT = 50  # trials in a row that started nothing (refused, repeats): the space is used up
WAIT_S = 2.0  # how often a worker waiting on the running trials' steps looks again


@dataclass
class Setup:
    """Everything a worker needs to turn a trial's parameters into a run."""

    cfg: DictConfig
    base: list[str]
    axes: list[Axis]
    rung: int  # images seen at the first rung
    last: int  # images seen at a trial's end
    every: int  # images seen between validations
    ranks: int
    limit: shared.Budget
    tune_dir: Path
    vram: float | None
    factor: float
    info: Any

    @property
    def distributions(self) -> dict[str, Any]:
        return {a.key: a.distribution for a in self.axes}

    @property
    def trial_steps(self) -> int:
        """A trial's steps at the training's own batch (what the budget counts one trial as)."""
        return int(self.cfg.train.max_steps)

    def startup(self) -> int:
        """TPE's trials drawn at random before it models the losses (startup_trials)."""
        return startup_trials(self.cfg.tune.startup, len(self.axes),
                              self.limit.afforded(self.trial_steps))

    def identity(self) -> dict[str, Any]:
        """What makes a study this study (a continued one must match it)."""
        t = self.cfg.tune
        return {"overrides": self.base, "axes": {a.key: a.given for a in self.axes},
                "rung_images": self.rung, "trial_images": self.last, "every_images": self.every,
                "sampler": t.sampler.value, "pruner": t.pruner.value, "reduction": int(t.reduction)}


def startup_trials(given: int | None, axes: int, afforded: int | None) -> int:
    """TPE's trials drawn at random first: tune.startup (`given`), else a third of the full trials
    the budget affords (at least 2), at most 3 an axis and 10 (TPE's own default): a budget of a
    few trials is mostly spent by the model, not by chance."""
    if given is not None:
        return int(given)
    cap = min(10, 3 * axes)
    return cap if afforded is None else max(2, min(cap, afforded // 3))


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose

    return compose(config_name="config", overrides=overrides)


def images_per_step(cfg: DictConfig, ranks: int) -> int:
    """Images one optimizer step sees: micro x accumulation x the data groups (the ranks form a
    data x context mesh: a context group's ranks share their images)."""
    groups = ranks // int(cfg.parallel.context)
    return int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps) * groups


def first_rung(cfg: DictConfig) -> int:
    """The first rung's steps: train.max_steps / tune.reduction**tune.rungs, down to a multiple
    of validation.every (0: before the first validation)."""
    every = max(1, int(cfg.validation.every))
    share = int(cfg.train.max_steps) // int(cfg.tune.reduction) ** max(0, int(cfg.tune.rungs))
    return share // every * every


def _problems(cfg: DictConfig, found: list[Axis], limit: shared.Budget) -> list[Problem]:
    """The settings a quality tune cannot start with."""
    t, out = cfg.tune, []
    if not found:
        out.append(Problem("the axes", "(none)", "a quality tune searches the overrides given as "
                           "sweeps", "e.g. 'optimizer.lr=tag(log,interval(1e-5,1e-3))' "
                           "adapter.rank=4,8,16"))
    steps, fraction = int(cfg.train.max_steps), int(t.reduction) ** max(0, int(t.rungs))
    if int(cfg.validation.every) <= 0:
        out.append(Problem("validation.every", cfg.validation.every, "trials are compared by "
                           "their validations at rungs", f"validation.every="
                           f"{max(1, steps // fraction)} (the first rung: train.max_steps / "
                           "tune.reduction**tune.rungs)"))
    elif int(t.rungs) >= 1 and first_rung(cfg) == 0:
        out.append(Problem("tune.rungs", t.rungs, f"the first rung (train.max_steps / "
                           f"tune.reduction**tune.rungs = {steps / fraction:g} steps) comes "
                           f"before the first validation (validation.every="
                           f"{cfg.validation.every})", f"validation.every="
                           f"{max(1, steps // fraction)}, or tune.rungs={int(t.rungs) - 1}"))
    if limit.seconds is None and limit.steps is None and limit.trials is None \
            and t.sampler.value != "grid":
        out.append(Problem("tune.budget", None, "a search needs an end", "tune.budget=8h, "
                           "tune.budget=4000steps or tune.trials=30"))
    if limit.steps is not None and limit.steps < int(cfg.train.max_steps):
        out.append(Problem("tune.budget", t.budget, f"cannot run one trial to its end "
                           f"(train.max_steps={cfg.train.max_steps})",
                           f"tune.budget={int(cfg.train.max_steps) * 10}steps"))
    for key, low, value in (("tune.workers", 1, t.workers), ("tune.reduction", 2, t.reduction),
                            ("tune.rungs", 1, t.rungs)):
        if int(value) < low:
            out.append(Problem(key, value, f"must be at least {low}", f"{key}={low + 1}"))
    if t.sampler.value == "grid":
        out += [Problem(a.key, a.given, "tune.sampler=grid runs every combination of choices",
                        f"{a.key}=a,b,c, or tune.sampler=tpe")
                for a in found if not hasattr(a.distribution, "choices")]
    return out


def _axis_problems(base: list[str], found: list[Axis], every: int, ranks: int) -> list[Problem]:
    """Each axis value composes, and a batch axis's batches divide the images between
    validations."""
    from ds_trainer.config import overrides

    out = []
    for a in found:
        if a.key.lstrip("+") in BATCH_KEYS and not hasattr(a.distribution, "choices"):
            out.append(Problem(a.key, a.given, "a batch axis is a choice of batches",
                               f"{a.key}=1,2,4"))
            continue
        for value in a.values():
            line = [*base, a.override(value)]
            try:
                cfg = _compose(line)
            except Exception as exc:  # Hydra's own message, as training says it
                problem = overrides.explain(exc, line, False)
                out.append(problem or Problem(a.key, value, str(exc).splitlines()[0], a.given))
                break
            images = images_per_step(cfg, ranks)
            if every % images:
                out.append(Problem(a.key, value, f"{images} images a step do not divide the "
                                   f"{every} images between validations (validation.every x "
                                   "the training's batch)", "batches that divide it"))
    return out


def prepare(base: list[str], found: list[Axis]) -> Setup:
    """Compose the training, read the budget, check every setting and axis (BadInput)."""
    from ds_trainer.config import hardware
    from ds_trainer.config.checks import resolve
    from ds_trainer.tools.plan import calibration
    from ds_trainer.tools.tune import space

    tool = ("tune.", "plan.")
    given = [o for o in base if not override_key(o).startswith((*tool, *TRIAL_KEYS))]
    if not any(override_key(o) == "validation" for o in given):
        given.append("validation=on")
    kept = [o for o in base if override_key(o).startswith(tool)
            or override_key(o) in ("train.max_steps", "validation.every")]
    cfg = _compose([*given, *kept])
    limit, problems = shared.budget(cfg.tune)
    ranks, info = resolve.world_size_of(cfg), hardware.detect(cfg.platform.value)
    per_step = images_per_step(cfg, ranks)
    rung, last = first_rung(cfg) * per_step, int(cfg.train.max_steps) * per_step
    every = int(cfg.validation.every) * per_step
    problems += _problems(cfg, found, limit)
    if not problems:
        problems += _axis_problems(given, found, every, ranks)
    if problems:
        raise BadInput(problems)
    vram = space.vram_budget(cfg.tune, info)
    factor = calibration.for_config(cfg, info).factor
    return Setup(cfg, given, found, rung, last, every, ranks, limit,
                 Path(str(cfg.tune.dir)).absolute(), vram, factor, info)


def plan(setup: Setup, params: dict[str, Any]) -> trials.Plan | str:
    """The run of a trial's parameters, or why it cannot run (the checks', the planner's)."""
    from ds_trainer.config import checks, overrides
    from ds_trainer.tools.tune import space

    chosen = [a.override(params[a.key]) for a in setup.axes]
    try:
        cfg = _compose([*setup.base, *chosen])
    except Exception as exc:
        problem = overrides.explain(exc, [*setup.base, *chosen], False)
        return problem.render().strip() if problem else str(exc).splitlines()[0]
    per_step = images_per_step(cfg, setup.ranks)
    if setup.every % per_step or setup.last % per_step:
        return f"{per_step} images a step do not divide the {setup.every} between validations"
    steps, every = setup.last // per_step, setup.every // per_step
    wandb = cfg.logger.name.value == "wandb"
    logger = [f"logger.group=tune-{setup.cfg.tune.name}"] if wandb else []
    line = [*setup.base, *chosen, f"train.max_steps={steps}", f"validation.every={every}",
            "train.export=false", "train.final_checkpoint=false", "train.checkpoint_every=0",
            "train.checkpoint_every_minutes=0", "resume=null", *logger]
    report = checks.check(_compose(line), setup.info)
    if not report.ok:
        return first_problem(report.render())
    if setup.vram is not None:
        peak = space.predict(report.cfg, setup.factor).gpu
        if peak > setup.vram:
            return f"planner: {peak / GIB:.2f} GiB per rank > budget {setup.vram / GIB:.2f} GiB"
    seeds = {"train.seed": int(cfg.train.seed), "validation.seed": int(cfg.validation.seed)}
    return trials.Plan(line, per_step, steps, every, setup.ranks, seeds)


def _say(text: str) -> None:
    print(f"tune: {text}", file=sys.stderr, flush=True)


def _repeat(study: Any, trial: Any) -> bool:
    """A trial whose parameters already have a result gets that result, at no cost."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED)
    for earlier in study.get_trials(deepcopy=False, states=done):
        if earlier.params == trial.params and "worker" in earlier.user_attrs:
            trial.set_user_attr("repeat_of", earlier.number)
            for images, value in sorted(earlier.intermediate_values.items()):
                trial.report(value, images)
            complete = earlier.state == TrialState.COMPLETE
            shared.tell(study, trial, earlier.value if complete else None, state=earlier.state)
            return True
    return False


def _gate(study: Any, number: int) -> Any:
    """Whether trial `number`, at a rung of tune.pruner=halving, waits for the trials running
    short of it (halving.ReachedHalving.waits; see trial.Watch); None for the other pruners."""
    from ds_trainer.tools.tune.halving import ReachedHalving

    pruner = study.pruner
    if not isinstance(pruner, ReachedHalving):
        return None
    return lambda images: pruner.waits(study, images, number)


def _threads(setup: Setup) -> int | None:
    """Local workers share the cores: each trial gets its share (None: the run decides)."""
    workers = int(setup.cfg.tune.workers)
    if setup.cfg.tune.launcher is not None or workers < 2:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


def _run(study: Any, trial: Any, job: trials.Plan, setup: Setup, label: str) -> None:
    from optuna.trial import TrialState

    t = setup.cfg.tune
    attrs: dict[str, Any] = {"worker": shared.me(), "seeds": job.seeds, "max_steps": job.max_steps,
                             "overrides": job.overrides, "images_per_step": job.images_per_step}
    for key, value in attrs.items():
        trial.set_user_attr(key, value)
    shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in trial.params.items())
    _say(f"{label}: trial {trial.number}: {shown}: running")
    folder = setup.tune_dir / "trials" / f"{trial.number:04d}"
    try:
        out = trials.run(trial, job, folder, t.launcher, t.trial_limit_s, float(t.heartbeat_s),
                         _threads(setup), _gate(study, trial.number))
    except BaseException:
        shared.abandon(study, trial, "its worker was stopped")
        raise
    trial.set_user_attr("run_dir", str(out.run_dir))
    if out.message:
        trial.set_user_attr("message", out.message)
    if out.state == "complete":
        shared.tell(study, trial, out.value)
    else:
        ended = TrialState.PRUNED if out.state == "pruned" else TrialState.FAIL
        shared.tell(study, trial, state=ended)
    value = f" {out.value:.6f}" if out.value is not None else ""
    _say(f"{label}: trial {trial.number}: {out.state}{value}"
         + (f" ({out.message})" if out.message else ""))


def claim(study: Any, setup: Setup, idle: int) -> tuple[str | None, Any]:
    """(why no trial starts, or None; the trial asked, or None: wait for the running ones to end
    short), the budget checked and the trial asked under the tune's start lock."""
    with shared.starting(setup.tune_dir):
        why = shared.over(study, setup.limit, setup.trial_steps)
        if why is None and idle >= IDLE_LIMIT:
            why = f"{IDLE_LIMIT} trials in a row had a result or were refused: the space is used up"
        if why is not None or shared.waits(study, setup.limit, setup.trial_steps):
            return why, None
        return None, study.ask(setup.distributions)


def work(study: Any, setup: Setup, label: str) -> None:
    """Ask, check and run trials until the budget is spent."""
    from optuna.trial import TrialState

    idle = 0
    while True:
        cell.raise_if_stopped()
        for line in shared.fail_lost(study, float(setup.cfg.tune.heartbeat_s)):
            _say(f"{label}: {line}")
        why, trial = claim(study, setup, idle)
        if why is not None:
            _say(f"{label}: {why}; done")
            return
        if trial is None:
            time.sleep(WAIT_S)  # the running trials may end early (pruned): then one more fits
            continue
        if _repeat(study, trial):
            idle += 1
            continue
        job = plan(setup, trial.params)
        if isinstance(job, str):
            trial.set_user_attr("refused", job)
            shared.tell(study, trial, state=TrialState.FAIL)
            _say(f"{label}: trial {trial.number}: refused, not run: {job}")
            idle += 1
            continue
        idle = 0
        _run(study, trial, job, setup, label)


def _workers(argv: list[str], n: int) -> list[subprocess.Popen[bytes]]:
    """The other workers: the same command, searching the same study."""
    procs = []
    for i in range(1, n):
        env = {**os.environ, WORKER_ENV: str(i)}
        procs.append(subprocess.Popen([sys.executable, "-m", "ds_trainer.tune", *argv], env=env,
                                      preexec_fn=trials.die_with_parent(15)))
    return procs


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def tune(argv: list[str], base: list[str], found: list[Axis]) -> int:
    """The quality tune; `argv` the whole command line (the other workers run it too)."""
    from ds_trainer.tools.tune import quality_report

    setup = prepare(base, found)
    t = setup.cfg.tune
    worker = os.environ.get(WORKER_ENV)
    study = shared.open_study(t, setup.tune_dir, setup.identity(), found, setup.rung, setup.last,
                              startup=setup.startup(), worker=int(worker or 0))
    if worker is not None:
        work(study, setup, f"worker {worker}")
        return 0
    _say(f"quality search of {', '.join(a.key for a in found)} in {setup.limit.describe()}: "
         f"the first rung at {setup.rung} images, a trial {setup.last}, "
         f"{setup.startup()} trials drawn at random first; study {setup.tune_dir}")
    others = _workers(argv, int(t.workers))
    try:
        work(study, setup, "worker 0")
        for proc in others:
            proc.wait()
    finally:
        _stop_all(others)
    shared.sweep_checkpoints(study)
    again = rerun(study, setup) if t.rerun else None
    return quality_report.finish(study, setup, again)


def rerun(study: Any, setup: Setup) -> dict[str, Any] | None:
    """Train the chosen trial once more from scratch: its loss beside the search's."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return None
    best = min(complete, key=lambda t: t.value)
    done = study.user_attrs.get("rerun")
    if done and done.get("trial") == best.number:
        return done
    job = plan(setup, best.params)
    if isinstance(job, str):
        return None
    _say(f"trial {best.number} (the chosen one): trained again from scratch")
    t = setup.cfg.tune
    out = trials.run(trials.Unscored(), job, setup.tune_dir / "rerun" / f"{best.number:04d}",
                     t.launcher, t.trial_limit_s, float(t.heartbeat_s))
    record = {"trial": best.number, "val_loss": out.value, "search_val_loss": best.value,
              "state": out.state, "message": out.message, "steps": out.steps,
              "device_s": round(out.seconds * setup.ranks, 2), "curve": out.curve}
    study.set_user_attr("rerun", record)
    return record
