"""`python -m ds_trainer`: compose, check, write the run files, then train (or stop: dry run)."""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ds_trainer import CONF_DIR, console
from ds_trainer.config import (
    accelerate_file,
    checks,
    distributed,
    ds_config,
    optimizers,
    overrides,
    phases,
    portability,
    rundir,
    runlock,
    schema,
)
from ds_trainer.config.problems import ConfigError, Problem, Report, first_problem, refuse
from ds_trainer.errors import NodesError, TrainingError
from ds_trainer.launch import sweep
from ds_trainer.train.observe import startup
from ds_trainer.train.state import checkpoint

log = logging.getLogger("ds_trainer")

console.install()  # before any library is imported: their known messages go to the run's log file
schema.register()
sweep.register()
try:  # installed from ds_trainer/hydra_plugin by `pip install`; a bare source checkout lacks it
    import hydra_plugins.ds_trainer_launcher as _launcher_plugin

    _launcher_plugin.register()
except ImportError:
    log.debug("hydra_plugins.ds_trainer_launcher is not installed: only the stock submitit launchers")
rundir.register_resolvers()


def prepare(cfg: DictConfig, run_dir: Path, resumes: bool = True) -> tuple[DictConfig, dict | None]:
    """Check `cfg` and take the run folder (its lock); raises ConfigError with the report on a user
    mistake. Nothing is written into the folder before `write_files`. `resumes`: whether the run
    resumes itself (a run in phases does not: each phase does, in its own folder)."""
    report = checks.check(cfg)
    if not report.ok:
        raise ConfigError(report.render())
    cfg = report.cfg
    carried: list[str] = []
    if resumes:
        carried = _resumable(cfg, run_dir)
    cfg.resolved.warnings = [*report.warnings, *carried]  # recorded in config.yaml
    for warning in cfg.resolved.warnings:
        log.warning("%s", warning)
    world_size = int(cfg.resolved.world_size)
    ds = ds_config.build(cfg, world_size) if cfg.resolved.backend == "deepspeed" else None
    if not cfg.dry_run:
        _lock(run_dir)  # before any run file is written: a second run must leave the first untouched
    return cfg, ds


def _resumable(cfg: DictConfig, run_dir: Path) -> list[str]:
    """A resume under another optimizer or architecture is refused here, before anything starts;
    and so is one that would train nothing. What a resume carries over, as warnings."""
    resumed = checkpoint.find_resume(cfg, run_dir, say=False)
    problems, carried = portability.check(cfg, resumed)
    if problems:
        raise ConfigError(Report(cfg, problems).render())
    if (nothing := _nothing_left(cfg, resumed, run_dir)) is not None:
        raise ConfigError(Report(cfg, [nothing]).render())
    return list(carried)


def write_files(cfg: DictConfig, ds: dict | None, run_dir: Path, composed: str) -> None:
    """Rank 0: the run files (config.yaml, ds_config.json, accelerate_config.yaml) and Hydra's
    `.hydra/` where Hydra left them to this run (config/rundir.py), once every check passed."""
    if distributed.is_main():
        ds_json = run_dir / "ds_config.json" if ds is not None else None
        accelerate = accelerate_file.config_file(cfg, ds_json, int(cfg.resolved.world_size))
        rundir.write_run_files(run_dir, cfg, ds, accelerate)
        rundir.write_hydra_files(run_dir, composed)


def _finished(run_dir: Path) -> bool:
    """Whether the run folder's summary.json says its run ended well."""
    try:
        return bool(json.loads((run_dir / "summary.json").read_text()).get("status") == "ok")
    except (OSError, ValueError, AttributeError):
        return False


def _nothing_left(cfg: DictConfig, resumed: Path | None, run_dir: Path) -> Problem | None:
    """A run that continues from a checkpoint past train.max_steps, or at it in its own finished
    folder, would train nothing and write records (summary, card, config) that do not describe the
    weights: refused. At it otherwise, the run only exports (a run whose export failed)."""
    state = checkpoint.complete(resumed) if resumed is not None else None
    if resumed is None or state is None or int(state["step"]) < int(cfg.train.max_steps):
        return None
    step = int(state["step"])
    own_finished = resumed.parent.parent == run_dir and _finished(run_dir)
    if step == int(cfg.train.max_steps) and not own_finished:
        return None
    return Problem("train.max_steps", cfg.train.max_steps, f"this run continues from {resumed} "
                   f"at step {step}: nothing is left to train, and the folder's summary, card and "
                   "config would no longer describe its weights",
                   f"train.max_steps={2 * step} (above {step}), or "
                   "a new run folder (another hydra.run.dir, or none: a fresh one)")


def _lock(run_dir: Path) -> None:
    """Rank 0 takes the run directory's lock; on one machine the other ranks wait to see it taken, or
    refused (then they stop too, with the same message, instead of waiting for rank 0 in the process
    group). Across nodes the rendezvous check, bounded in time, stops them instead: a node may not see
    this folder at all, which that check names."""
    try:
        if distributed.is_main():
            runlock.acquire(run_dir)
        elif distributed.one_machine():
            runlock.follow(run_dir)
    except runlock.Busy as busy:
        problem = Problem("hydra.run.dir", str(run_dir), f"another run is training in this folder: {busy}",
                          "wait for it to end (or stop it); resume=latest then continues from its checkpoints")
        raise ConfigError(overrides.render([problem])) from None


def run(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """One run: check, write the run files, then train unless it is a dry run."""
    composed = OmegaConf.to_yaml(cfg)  # as Hydra composed it: .hydra/config.yaml
    phased, given = phases.of(cfg), copy.deepcopy(cfg)  # a phase's config starts from the composed
    cfg, ds = prepare(cfg, run_dir, resumes=not phased)
    if phased:
        log.info("%s", phases.describe(cfg, phased, run_dir))
    startup.mark("validate")
    if cfg.dry_run:
        write_files(cfg, ds, run_dir, composed)
        if ds is not None:
            print(json.dumps(ds, indent=2))
        elif cfg.resolved.backend == "fsdp":  # what FSDP2 will run, as config.yaml records it
            print(json.dumps(OmegaConf.to_container(cfg.resolved.fsdp), indent=2))
        else:
            print(f"zero=ddp: plain Accelerate data parallel, no DeepSpeed config ({cfg.resolved.platform})")
        print(f"run files written to {run_dir}", file=sys.stderr)
        return
    from ds_trainer.train.process import imports

    imports.for_run(optimizers.CLIENT_PACKAGE.get(str(cfg.resolved.optimizer), ("",))[0] == "bitsandbytes",
                    deferred_muon=cfg.resolved.backend == "deepspeed")
    from ds_trainer.tools import plan
    from ds_trainer.train import recipe
    from ds_trainer.train.adapters import adapter
    from ds_trainer.train.observe import metrics

    problems, cfg.resolved.trainable_params = adapter.inspect(cfg)  # what needs the model's module names
    if problems:
        raise ConfigError(Report(cfg, problems).render())
    write_files(cfg, ds, run_dir, composed)
    if phased:
        _run_phases(given, run_dir, overrides, composed)
        return
    recipe.run(cfg, ds, run_dir, metrics.run_name(overrides), memory_plan=plan.log_for_run)


def _run_phases(cfg: DictConfig, run_dir: Path, given: list[str], composed: str) -> None:
    """A run in phases (config/phases.py): each checked, written and trained in its folder, in
    order, in this process (one done by an earlier launch of this command is not trained again);
    then rank 0 joins their exports in the run's folder and writes its summary.json, however they
    ended."""
    from ds_trainer.tools import plan
    from ds_trainer.train import recipe
    from ds_trainer.train.export import joined
    from ds_trainer.train.observe import metrics

    phased = phases.of(cfg)
    configs = [phases.config(cfg, p, run_dir, _phase_resume(cfg, phased, k))
               for k, p in enumerate(phased)]
    todo = [k for k, p in enumerate(phased) if not phases.done(configs[k], run_dir / p.folder)]
    try:
        for k, phase in enumerate(phased):
            folder = run_dir / phase.folder
            if k not in todo:
                log.info("phase %s: done in %s by an earlier launch", phase.name, folder)
                continue
            log.info("phase %s of %d: %s in %s", phase.name, len(phased),
                     " ".join(phases.overrides(phase, run_dir)), folder)
            phase_cfg, ds = prepare(configs[k], folder)
            write_files(phase_cfg, ds, folder, composed)
            if distributed.is_main():
                phases.write_overrides(folder, given, phase, run_dir)
            with console.also_to(folder / "ds_trainer.log", distributed.is_main()):
                recipe.run(phase_cfg, ds, folder, f"{metrics.run_name(given)}-{phase.name}",
                           memory_plan=plan.log_for_run, last=k == todo[-1])
    finally:
        if distributed.is_main():
            joined.finish(cfg, run_dir, phased)


def _phase_resume(cfg: DictConfig, phased: list[phases.Phase], k: int) -> str | None:
    """What phase `k` continues from: `resume` as given (its own folder; latest), or with a
    checkpoint of a phase, that checkpoint for it, the newest intact checkpoint of the same run's
    folder for each phase before it (what trained them), nothing for those after it."""
    if cfg.resume in (None, "latest"):
        return None if cfg.resume is None else "latest"
    at, source = phases.located(phased, Path(str(cfg.resume))) or (k, Path())
    if k >= at:
        return str(cfg.resume) if k == at else None
    saved = [path for _, path in checkpoint.checkpoints(source / phased[k].folder)]
    found = checkpoint.newest_intact(saved, say=False)
    return None if found is None else str(found)


def main(argv: list[str] | None = None) -> None:
    """`python -m ds_trainer [overrides]`: a mistake at any layer exits 2 with one screen, no traceback; Ctrl-C
    before training starts exits 130 with one line (once training runs, the recipe handles it)."""
    startup.mark("import")
    try:
        overrides.guarded(hydra_main, argv)
    except KeyboardInterrupt:
        print("\nds_trainer: stopped by Ctrl-C before training started; nothing was trained", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        # What was to be saved is saved and said: a late Ctrl-C must not cut the process's exit short (at
        # interpreter shutdown Python gives SIGINT back to the kernel, which would end it with status -2).
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
@overrides.task
def hydra_main(cfg: DictConfig) -> None:
    startup.mark("compose")
    distributed.export_submitit_env()  # a submitit task is one rank: RANK, WORLD_SIZE, MASTER_* from SLURM
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        try:
            run(cfg, run_dir, overrides)
        except ConfigError as exc:
            refuse(str(exc))
        except TrainingError as exc:  # the run's summary, already printed, says what failed and why
            raise SystemExit(exc.exit_status) from None
        return
    # A sweep cell: record any failure in its summary.json and let the sweep go on.
    if cfg.logger.group is None:
        cfg.logger.group = Path(hydra_cfg.sweep.dir).name  # a sweep's cells share a W&B group
    if "SUBMITIT_EXECUTOR" not in os.environ:
        sweep.run_cell_process(cfg, run_dir, overrides)
        return
    try:  # a submitit job is a process of its own: train here
        run(cfg, run_dir, overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        sweep.failed_cell(cfg, run_dir, "error", first_problem(str(exc)))
    except NodesError:
        raise  # the job fails with the message, which the launcher records where it can see
    except TrainingError as exc:
        log.error("cell failed: %s", exc)
    except Exception as exc:  # noqa: BLE001 - a crashed cell must not end the sweep
        log.exception("cell crashed")
        sweep.failed_cell(cfg, run_dir, "error", f"{type(exc).__name__}: {exc}")
