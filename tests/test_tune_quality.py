"""`python -m ds_trainer.tune tune.objective=quality` on the CPU with sdxl_tiny: a real Optuna study in a journal
file, real training runs as trials, two real local workers; one worker killed mid-trial (its trial failed and run
again), then the whole tune killed and continued by the same command; the report, its preset and the rerun of the
chosen trial; the settings and axes it refuses on one screen.

The machine may be loaded by others: these tests assert what ran and what was decided, never timings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.cfg import make_cfg
from helpers.procs import wait_until

# Tiny runs: 32 px, 8 images (2 held out, 2 timesteps each), 8 steps validated every 2, rungs at 2, 4 and 8 images
# (halving by 2).
TRAINING = ["model=sdxl_tiny", "resolution.width=32", "resolution.height=32", "logger=none", "data.num_samples=8",
            "validation=on", "validation.split=2", "validation.timesteps=2", "adapter=lora", "scheduler=constant",
            "train.max_steps=8", "validation.every=2"]
AXES = ["optimizer.lr=tag(log,interval(1e-3,3e-1))", "adapter.rank=1,4"]
# Two rungs (steps 2 and 4, then the end at 8) and every trial drawn at random: of ten trials, two are
# killed and run again with their values, so eight are drawn. A trial goes on past a rung only if it
# is in the better half of those that reached it: with four draws (six trials), each better than the
# last often enough, none was pruned; TPE modelling early draws beside the best so far, as bad.
SEARCH = ["tune.objective=quality", "tune.trials=10", "tune.workers=2", "tune.heartbeat_s=5",
          "tune.reduction=2", "tune.rungs=2", "tune.startup=10"]


def command(root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ds_trainer.tune", *TRAINING, *AXES, *SEARCH,
            f"paths.outputs={root / 'outputs'}", *extra]


def load(tune_dir: Path) -> Any:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(tune_dir / "study.journal")))
    return optuna.load_study(study_name="tuned", storage=storage)


def _running(tune_dir: Path, pid: int | None = None, other_than: int | None = None, after: int = -1) -> Any:
    """A running trial after trial `after` that has reported a validation (of worker `pid`, or of any but
    `other_than`)."""
    if not (tune_dir / "study.journal").exists():
        return None
    for t in load(tune_dir).get_trials(deepcopy=False):
        worker = t.user_attrs.get("worker")
        if t.state.name != "RUNNING" or not worker or not t.intermediate_values or t.number <= after:
            continue
        if (pid is None or worker["pid"] == pid) and worker["pid"] != other_than:
            return t
    return None


def _finished(tune_dir: Path) -> dict[int, tuple[str, float | None, str]]:
    """{trial: (state, value, its metrics.jsonl's hash)} of the trials that ran to their end or were pruned."""
    out: dict[int, tuple[str, float | None, str]] = {}
    if not (tune_dir / "study.journal").exists():
        return out
    for t in load(tune_dir).get_trials(deepcopy=False):
        if t.state.name in ("COMPLETE", "PRUNED") and "run_dir" in t.user_attrs:
            metrics = Path(t.user_attrs["run_dir"]) / "metrics.jsonl"
            out[t.number] = (t.state.name, t.value, hashlib.sha256(metrics.read_bytes()).hexdigest())
    return out


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def tuned(module_tmp: Callable[[str], Path]) -> dict[str, Any]:
    """A quality tune on two workers: the started worker is SIGKILLed during a trial once a trial has a result; then
    the tune itself is SIGKILLed during a trial; then the same command runs it to its end."""
    root = module_tmp("quality")
    tune_dir = root / "outputs" / "tune" / "tuned"
    first = subprocess.Popen(command(root), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900
    child = wait_until(lambda: _finished(tune_dir) and _running(tune_dir, other_than=first.pid),
                       "the second worker never ran a trial once one had finished", deadline=deadline,
                       proc=first, interval=0.5)
    os.kill(child.user_attrs["worker"]["pid"], signal.SIGKILL)
    mine = wait_until(lambda: _running(tune_dir, pid=first.pid, after=child.number),
                      "the first worker never ran a trial after", deadline=deadline, proc=first, interval=0.5)
    first.send_signal(signal.SIGKILL)
    _, first_err = first.communicate(timeout=60)
    before = _finished(tune_dir)
    time.sleep(2)  # the killed runs' own ends (the kernel's SIGTERM on their worker's death)
    second = subprocess.run(command(root), cwd=root, capture_output=True, text=True, timeout=1200)
    return {"root": root, "dir": tune_dir, "child": child, "mine": mine, "first_err": first_err,
            "before": before, "second": second, "study": load(tune_dir)}


@pytest.mark.slow
def test_the_quality_tune_reports_the_chosen_trial_its_rerun_and_each_axis(tuned: dict[str, Any]) -> None:
    second, study = tuned["second"], tuned["study"]
    assert second.returncode == 0, second.stderr[-3000:]
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    best = min(complete, key=lambda t: t.value)
    md = (tuned["dir"] / "quality.md").read_text()
    assert f"**Chosen: trial {best.number}**, validation loss {best.value:.6f}" in md
    # The line to paste trains the chosen parameters at the training's own length
    line = (tuned["dir"] / "winner.txt").read_text().split()
    assert f"adapter.rank={best.params['adapter.rank']}" in line and "train.max_steps=8" in line
    assert f"optimizer.lr={best.params['optimizer.lr']}" in line and not any(o.startswith("tune.") for o in line)
    from ds_trainer.config import checks

    assert checks.check(make_cfg(*line)).ok
    preset = tuned["root"] / "outputs" / "presets" / "experiment" / "tuned.yaml"
    assert preset.read_text().startswith("# @package _global_") and f"trial {best.number}" in preset.read_text()
    # The chosen trial trained once more from scratch, side by side (the same seeds on one CPU: the same loss but
    # for the order of float sums another thread count takes)
    again = study.user_attrs["rerun"]
    assert again["trial"] == best.number and again["search_val_loss"] == best.value
    assert again["val_loss"] == pytest.approx(best.value, rel=1e-3)
    assert "trained again from scratch" in md and f"| {again['val_loss']:.6f} |" in md
    # Each axis's importance, the best loss per device-hour, every trial with its seeds
    assert "| optimizer.lr |" in md and "| adapter.rank |" in md and "## Best loss against device-hours" in md
    for t in study.trials:
        if "worker" in t.user_attrs:
            assert t.user_attrs["seeds"] == {"train.seed": 0, "validation.seed": 0}
    assert (tuned["dir"] / "quality.png").stat().st_size > 0
    csv_head = (tuned["dir"] / "quality.csv").read_text().splitlines()[0].split(",")
    assert csv_head[:4] == ["trial", "state", "optimizer.lr", "adapter.rank"] and "loss@4" in csv_head


@pytest.mark.slow
def test_trials_compare_at_rungs_of_images_seen_and_the_worse_are_pruned(tuned: dict[str, Any]) -> None:
    study = tuned["study"]
    reported = [t for t in study.trials if t.intermediate_values]
    # every trial reported at the same images seen (1 image a step here): its validations every 2 steps
    assert all(set(t.intermediate_values) <= {2, 4, 6, 8} for t in reported)
    pruned = [t for t in study.trials if t.state.name == "PRUNED" and "repeat_of" not in t.user_attrs]
    assert pruned, [(t.number, t.state.name) for t in study.trials]
    for t in study.trials:  # a trial drawn again is told its first run's result at no cost, run nowhere
        if "repeat_of" in t.user_attrs:
            first = study.trials[t.user_attrs["repeat_of"]]
            assert (t.state, t.value, t.intermediate_values) == (first.state, first.value, first.intermediate_values)
            assert "run_dir" not in t.user_attrs and t.params == first.params
    for t in pruned:  # stopped after the rung that pruned it: never to the end, its checkpoint gone
        assert max(t.intermediate_values) in (2, 4) and t.user_attrs["steps"] < 8
        assert not (Path(t.user_attrs["run_dir"]) / "checkpoints").exists()
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert summary["status"] == "interrupted" and "SIGTERM" in summary["message"]
        # at the rung that stopped it, another trial had done better (at the same images seen)
        rung = max(t.intermediate_values)
        others = [o.intermediate_values[rung] for o in study.trials if rung in o.intermediate_values
                  and o.params != t.params]
        assert others and min(others) < t.intermediate_values[rung]


@pytest.mark.slow
def test_a_killed_worker_s_trial_fails_and_runs_again_and_the_study_goes_on(tuned: dict[str, Any]) -> None:
    study, child = tuned["study"], tuned["child"]
    lost = study.trials[child.number]
    assert lost.state.name == "FAIL"
    assert f"its worker (pid {child.user_attrs['worker']['pid']}" in study.user_attrs[f"lost_{child.number}"]
    (retry,) = [t for t in study.trials if t.user_attrs.get("retry_of") == child.number]
    assert retry.params == lost.params and retry.state.name in ("COMPLETE", "PRUNED")
    # the whole tune was killed too: its trial failed, run again by the same command
    mine = study.trials[tuned["mine"].number]
    assert mine.state.name == "FAIL" and any(t.user_attrs.get("retry_of") == mine.number for t in study.trials)
    assert "done" in tuned["second"].stderr
    # ten trials were started in all, the killed ones among them (a second worker may start one more while the
    # first starts the tenth)
    assert 10 <= sum("worker" in t.user_attrs for t in study.trials) <= 11
    # no training run of the tune is left behind
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(tuned["dir"]) in _cmdline(p)]


@pytest.mark.slow
def test_the_same_command_continues_without_running_finished_trials_again(tuned: dict[str, Any]) -> None:
    before = tuned["before"]
    assert before, "no trial had finished before the kill"
    after = _finished(tuned["dir"])
    assert {n: after[n] for n in before} == before  # same state, value and run files: not run again
    assert not [line for line in tuned["second"].stderr.splitlines()
                if any(f"trial {n}: " in line and "running" in line for n in before)]


@pytest.mark.slow
def test_the_study_reaches_wandb_as_a_table(tuned: dict[str, Any], tmp_path: Path) -> None:
    from helpers import wandb_log
    from hydra import initialize_config_dir

    from ds_trainer import CONF_DIR
    from ds_trainer.tools.tune import axes, quality, quality_report

    argv = [*TRAINING, *AXES, *SEARCH, "logger=wandb", "logger.mode=offline",
            f"tune.dir={tuned['dir']}", f"paths.outputs={tmp_path}"]
    base, found, _ = axes.split([a for a in argv if a != "logger=none"])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        setup = quality.prepare(base, found)
    quality_report.to_wandb(tuned["study"], setup, tuned["dir"] / "quality.png")
    (wandb_file,) = tuned["dir"].glob("wandb/offline-run-*/run-*.wandb")

    def logged_rows() -> list[dict[str, Any]]:  # W&B's service may still be writing the file when finish returns
        return [{k.split(".", 1)[1]: v for k, v in r.items() if k.startswith("quality.")}
                for r in wandb_log.history(wandb_file) if "quality._type" in r]

    (logged,) = wait_until(logged_rows, "the table never reached the run file", deadline=time.time() + 60)
    assert logged["_type"] == "table-file" and logged["nrows"] == len(tuned["study"].trials)
    table = json.loads((wandb_file.parent / "files" / logged["path"]).read_text())
    assert table["columns"][:4] == ["trial", "state", "optimizer.lr", "adapter.rank"]


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from ds_trainer.tools import tune

    code = tune.main([*TRAINING, f"paths.outputs={tmp_path}", *argv])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert not (tmp_path / "tune").exists()  # nothing ran
    return err


def test_axes_a_quality_search_cannot_take_are_refused_on_one_screen(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, capsys, "tune.objective=quality", "tune.trials=4", "zero=stage2,stage3",
                   "validation.timesteps=2,4", "optimizer=interval(1,2)", "optimizer.lr=tag(log,interval(0,1e-3))",
                   "train.seed=0,1")
    assert "4 problems" not in err and "5 problems" in err
    assert "- zero=stage2,stage3" in err and "search it with tune.objective=speed" in err
    assert "- validation.timesteps=2,4" in err and "every trial is compared by one measure" in err
    assert "- optimizer=interval(1,2)" in err and "a group's options are names" in err
    assert "a log scale needs a positive low end" in err and "the best of several seeds is luck" in err


def test_a_budget_that_cannot_run_one_trial_or_a_search_without_an_end_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, capsys, "tune.objective=quality", *AXES, "tune.budget=5steps")
    assert "- tune.budget=5steps" in err and "cannot run one trial to its end (train.max_steps=8)" in err
    assert "fix: tune.budget=80steps" in err
    err = _refused(tmp_path, capsys, "tune.objective=quality", *AXES)
    assert "a search needs an end" in err and "tune.trials=30" in err
    err = _refused(tmp_path, capsys, "tune.objective=quality", *AXES, "tune.budget=eight hours")
    assert "a positive number and a unit" in err
    err = _refused(tmp_path, capsys, "tune.objective=quality", *AXES, "tune.sampler=grid")
    assert "- optimizer.lr=tag(log,interval(1e-3,3e-1))" in err and "every combination of choices" in err
    err = _refused(tmp_path, capsys, "tune.objective=quality", "tune.trials=3", "train.micro_batch_size=1,3")
    assert "- train.micro_batch_size=3" in err and "do not divide the 2 images between validations" in err
    # the first rung (8 steps / 2**3) before the first validation (every 2 steps)
    err = _refused(tmp_path, capsys, "tune.objective=quality", *AXES, "tune.trials=3", "tune.rungs=3")
    assert "- tune.rungs=3" in err and "comes before the first validation" in err
    assert "fix: validation.every=1, or tune.rungs=2" in err
    # a sweep in a speed tune says which tune takes it
    err = _refused(tmp_path, capsys, "adapter.rank=1,4")
    assert "- adapter.rank=1,4" in err and "fix: tune.objective=quality" in err


def test_a_trial_the_checks_or_the_planner_refuse_is_never_started(tmp_path: Path) -> None:
    from hydra import initialize_config_dir

    from ds_trainer import CONF_DIR
    from ds_trainer.tools.tune import axes, quality

    argv = [*TRAINING, "tune.objective=quality", "tune.trials=2", "optimizer=adamw,adamw8bit", "precision=bf16_pure",
            f"paths.outputs={tmp_path}"]
    base, found, _ = axes.split(argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        setup = quality.prepare(base, found)
        job = quality.plan(setup, {"optimizer": "adamw"})
        refused = quality.plan(setup, {"optimizer": "adamw8bit"})
        setup.vram = 0.01 * 2**30
        over = quality.plan(setup, {"optimizer": "adamw"})
    assert not isinstance(job, str) and job.max_steps == 8 and job.every == 2
    assert "validation.every=2" in job.overrides and "train.final_checkpoint=false" in job.overrides
    assert isinstance(refused, str) and "adamw8bit's state has no bf16 form" in refused
    assert isinstance(over, str) and over.startswith("planner:") and "> budget 0.01 GiB" in over
    # a step's images count the data groups: four ranks in context pairs are two groups
    context = make_cfg("train.micro_batch_size=2", "parallel.context=2")
    assert quality.images_per_step(context, 4) == 4
    assert quality.images_per_step(make_cfg("train.micro_batch_size=2"), 4) == 8


def test_a_running_trial_whose_worker_is_gone_is_failed_and_run_again_once(tmp_path: Path) -> None:
    """Through a real journal file: a trial claimed by a process that has ended (on this host) and one whose worker
    on another host has been silent for 4 heartbeats are failed, their parameters queued once; a live one stays."""
    import optuna
    from omegaconf import OmegaConf

    from ds_trainer.tools.tune import study as shared

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    claim = {"host": shared.me()["host"], "pid": gone.pid, "start": shared.me()["start"]}
    gone.wait()
    t = OmegaConf.create({"storage": None, "sampler": "random", "seed": 0, "pruner": "none", "reduction": 3,
                          "name": "s"})
    t = OmegaConf.merge(make_cfg().tune, t)
    study = shared.open_study(t, tmp_path, {"a": 1}, [], 1, 9)
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for worker in (claim, {"host": "elsewhere", "pid": 1, "start": 1}, shared.me()):
        trial = study.ask(dist)
        trial.set_user_attr("worker", worker)
        trial.set_user_attr("alive", time.time() - (100 if worker["host"] == "elsewhere" else 0))
    said = shared.fail_lost(study, heartbeat_s=5)
    assert [s.split(":")[0] for s in said] == ["trial 0 failed", "trial 1 failed"]
    assert "ended" in said[0] and "no word from its worker on elsewhere" in said[1]
    states = [t.state.name for t in study.get_trials()]
    assert states == ["FAIL", "FAIL", "RUNNING", "WAITING", "WAITING"]
    assert [t.user_attrs.get("retry_of") for t in study.get_trials()][3:] == [0, 1]
    assert shared.fail_lost(study, heartbeat_s=5) == []  # once
    # the same study under another search is refused, not mixed into it
    from ds_trainer.tools.tune.space import BadInput

    with pytest.raises(BadInput, match="searched with another a"):
        shared.open_study(t, tmp_path, {"a": 2}, [], 1, 9)


def test_a_step_budget_is_never_passed(tmp_path: Path) -> None:
    """Through a real journal: a trial starts only if its steps fit beside those spent and those the
    running trials may still take; a worker waits on a running trial that may be pruned short of its end,
    and the search ends when no trial fits."""
    import optuna
    from omegaconf import OmegaConf

    from ds_trainer.tools.tune import study as shared

    t = OmegaConf.merge(make_cfg().tune, {"sampler": "random", "pruner": "none", "name": "b"})
    study = shared.open_study(t, tmp_path, {"a": 1}, [], 1, 10)
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    for steps in (20, 3):  # one trial done at its end, one running at its third step
        trial = study.ask(dist)
        for key, value in (("worker", shared.me()), ("max_steps", 10), ("steps", steps)):
            trial.set_user_attr(key, value)
    shared.tell(study, 0, 1.0)
    limit = shared.Budget(None, 39, None)
    # 23 spent, 7 more the running trial may take: a trial of 10 waits (40 > 39), the search goes on
    assert shared.waits(study, limit, 10) and shared.over(study, limit, 10) is None
    shared.tell(study, 1, state=optuna.trial.TrialState.PRUNED)  # stopped at its third step
    assert not shared.waits(study, limit, 10) and shared.over(study, limit, 10) is None
    trial = study.ask(dist)
    for key, value in (("worker", shared.me()), ("max_steps", 10), ("steps", 10)):
        trial.set_user_attr(key, value)
    shared.tell(study, trial, 0.5)
    assert shared.over(study, limit, 10) == "budget spent: 33 of 39 steps (a trial takes up to 10)"


def test_workers_check_the_budget_and_ask_one_at_a_time(tmp_path: Path) -> None:
    """Two workers that checked the budget at once each saw room for the last trial and both ran
    it (a budget of 323 steps passed by 34, two workers, rungs at steps 4 and 12). A worker checks
    and asks under the tune's start lock, and a trial asked but not yet planned holds a whole
    trial's steps: here the other worker holds the lock, asks the last trial that fits, and ours,
    let in after, waits on it; once that trial is pruned short, ours gets one."""
    import threading
    from types import SimpleNamespace

    import optuna
    from omegaconf import OmegaConf

    from ds_trainer.tools.tune import quality
    from ds_trainer.tools.tune import study as shared

    t = OmegaConf.merge(make_cfg().tune, {"sampler": "random", "pruner": "none", "name": "lock"})
    study = shared.open_study(t, tmp_path, {"a": 1}, [], 1, 10)
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    setup = SimpleNamespace(tune_dir=tmp_path, limit=shared.Budget(None, 25, None), trial_steps=10,
                            distributions=dist)
    done = study.ask(dist)
    for key, value in (("worker", shared.me()), ("max_steps", 10), ("steps", 10)):
        done.set_user_attr(key, value)
    shared.tell(study, done, 1.0)
    got: list[tuple[Any, Any]] = []
    with shared.starting(tmp_path):  # the other worker checks: room for one trial (10 + 10 <= 25)
        ours = threading.Thread(target=lambda: got.append(quality.claim(study, setup, 0)))
        ours.start()
        ours.join(1.0)
        assert ours.is_alive() and not got  # ours waits for the lock
        other = study.ask(dist)  # the other's trial, asked, its plan not yet made
    ours.join(30)
    assert got == [(None, None)]  # 10 spent + 10 the other may take + 10 > 25: ours waits
    other.set_user_attr("steps", 2)
    shared.tell(study, other, state=optuna.trial.TrialState.PRUNED)
    why, trial = quality.claim(study, setup, 0)  # 12 spent: room again
    assert why is None and trial is not None and trial.number == 2
    assert not (tmp_path / "starting.lock").exists()  # the lock is let go
    # a study in a database (tune.storage): its tune folder is not made before the first trial
    rdb = OmegaConf.merge(t, {"storage": f"sqlite:///{tmp_path / 'study.db'}", "name": "rdb"})
    folder = tmp_path / "rdb"
    setup.tune_dir = folder
    why, trial = quality.claim(shared.open_study(rdb, folder, {"a": 1}, [], 1, 10), setup, 0)
    assert why is None and trial.number == 0 and not (folder / "starting.lock").exists()


def test_workers_side_by_side_draw_other_random_trials(tmp_path: Path) -> None:
    """Each worker seeds its sampler with tune.seed + its index: two workers of one study drew
    the same first random trial (one seed), twice the steps for one result."""
    import optuna
    from omegaconf import OmegaConf

    from ds_trainer.tools.tune import study as shared

    t = OmegaConf.merge(make_cfg().tune, {"pruner": "none", "name": "w"})
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}
    drawn = []
    for worker in (0, 1):
        study = shared.open_study(t, tmp_path, {"a": 1}, [], 1, 9, startup=4, worker=worker)
        drawn.append(study.ask(dist).params["x"])
    assert drawn[0] != drawn[1]
    again = shared.open_study(t, tmp_path / "again", {"a": 1}, [], 1, 9, startup=4)
    assert again.ask(dist).params["x"] == drawn[0]  # worker 0 draws as before: the same seed


def test_a_run_s_rows_are_read_whole_lines_only(tmp_path: Path) -> None:
    from ds_trainer.tools.tune.trial import Follower

    path = tmp_path / "metrics.jsonl"
    follower = Follower(path)
    assert follower.read() == []
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 1, "val_loss": 0.5, "val_s": 0.1}\n{"step": 2, "lo')
    assert [r["val_loss"] for r in follower.read()] == [0.5] and follower.step == 1
    with path.open("a") as f:
        f.write('ss": 0.9}\n{"step": 2, "val_loss": 0.4}\n')
    assert [r["val_loss"] for r in follower.read()] == [0.4] and follower.step == 2


def test_a_trial_at_a_rung_is_ruled_on_beside_the_trials_running_with_it(tmp_path: Path) -> None:
    """Through a real journal and the runs' metrics files: the first of two trials side by side to reach a rung
    (Optuna's own halving promotes the first it rules on: it has nothing to compare) trains on, its later
    validations held back, until the other reaches the rung. The second, worse, is compared with the first (by
    Optuna's halving: with none, as the first is not yet ruled on) and pruned; the first then goes on. The worse
    of two, pruned after its wait, reports nothing past the rung. A trial waits at most as many steps again as it
    took to reach the rung, and a run that has trained its last step is never pruned."""
    import optuna
    from omegaconf import OmegaConf

    from ds_trainer.tools.tune import quality
    from ds_trainer.tools.tune import study as shared
    from ds_trainer.tools.tune.trial import Follower, Plan, Watch

    t = OmegaConf.merge(make_cfg().tune, {"sampler": "random", "pruner": "halving", "reduction": 2})
    dist = {"x": optuna.distributions.FloatDistribution(0, 1)}

    def side_by_side(name: str, n: int) -> tuple[Any, list[Any]]:
        study = shared.open_study(OmegaConf.merge(t, {"name": name}), tmp_path / name, {"a": 1}, [], 4, 16)
        runs = []
        for i in range(n):  # validations every 2 steps to 16 (its end), 1 image a step; rungs at 4 and 8
            trial = study.ask(dist)
            trial.set_user_attr("worker", shared.me())
            watch = Watch(trial, Plan([], 1, 16, 2, 1), 60.0, quality._gate(study, trial.number))
            runs.append((trial, watch, Follower(tmp_path / name / f"{i}.jsonl")))
        return study, runs

    def validate(run: Any, step: int | None = None, loss: float = 0.0, final: bool = False) -> bool:
        trial, watch, follower = run
        if step is not None:
            with follower.path.open("a") as f:
                f.write(json.dumps({"step": step, "val_loss": loss}) + "\n")
        return watch.progress(follower, final)

    def reported(run: Any) -> dict[int, float]:
        return run[0].study.trials[run[0].number].intermediate_values

    pair, (first, second) = side_by_side("pair", 2)
    assert not validate(first, 4, 0.5) and not validate(first, 6, 0.8)  # on, held at the rung
    assert reported(first) == {4: 0.5}
    assert validate(second, 4, 0.9)  # the worse, ruled beside the first that waits there: pruned at once
    pair.tell(second[0], state=optuna.trial.TrialState.PRUNED)
    assert not validate(first)  # the first, ruled now: on, its held validation reported
    assert reported(first) == {4: 0.5, 6: 0.8} and not first[1].queue
    _, (worse, better) = side_by_side("held", 2)
    assert not validate(worse, 4, 0.9) and not validate(worse, 6, 0.8)
    assert not validate(better, 4, 0.5) and validate(worse)  # pruned at the rung it waited at
    assert not validate(worse, 8, 0.7, final=True) and reported(worse) == {4: 0.9}  # past the rung: not reported
    assert [point[0] for point in worse[1].curve] == [4, 6, 8]  # but drawn
    _, (late, other) = side_by_side("end", 2)
    assert not validate(late, 4, 0.9) and not validate(other, 4, 0.5)
    assert not validate(late, 16, 0.8) and reported(late) == {4: 0.9, 16: 0.8}  # trained to its end: not pruned
    own = optuna.create_study(pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2))
    alone = own.ask(dist)
    alone.report(0.9, 2)
    assert not alone.should_prune()  # why: Optuna's halving lets the first at a rung go on, however it did
    _, (quick, slow) = side_by_side("bound", 2)
    assert not validate(quick, 4, 0.7) and not validate(quick, 6, 0.65)  # held while the slow one is on its way
    assert not validate(quick, 8, 0.6)  # as many steps again as it took to reach the rung: ruled, on
    assert reported(quick) == {4: 0.7, 6: 0.65, 8: 0.6} and quick[1].queue  # held at the next rung
    assert not validate(quick, 16, 0.5, final=True)  # its end: never pruned
    assert reported(quick) == {4: 0.7, 6: 0.65, 8: 0.6, 16: 0.5}


def _plant(root: Path, n: int = 24) -> Path:
    """A folder of one picture (a red field over a blue one) whose yellow square moves, with
    captions (6 held out for validation by their names' hash): a structure the LoRA learns in a
    few dozen steps, so the validation loss falls far (from 1.05 to 0.27) at the right learning
    rate and rank."""
    from PIL import Image

    root.mkdir(parents=True)
    for i in range(n):
        image = Image.new("RGB", (32, 32), (200, 60, 40))
        image.paste((30, 90, 220), (0, 16, 32, 32))
        x = 4 + (i * 5) % 12
        image.paste((250, 240, 30), (x, 6, x + 8, 14))
        image.save(root / f"img{i:03d}.png")
        (root / f"img{i:03d}.txt").write_text(f"picture number {i}")
    return root


def _tune(root: Path, name: str, argv: list[str]) -> Any:
    run = subprocess.run([sys.executable, "-m", "ds_trainer.tune", *argv, "tune.objective=quality", f"tune.name={name}",
                          f"paths.outputs={root / 'outputs'}"], cwd=root, capture_output=True, text=True, timeout=5400)
    assert run.returncode == 0, run.stderr[-3000:]
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal = root / "outputs" / "tune" / name / "study.journal"
    return optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(journal))))


def _steps(study: Any) -> int:
    return sum(int(t.user_attrs.get("steps", 0)) for t in study.trials)


@pytest.mark.slow
@pytest.mark.long
def test_the_search_finds_the_grid_s_best_in_a_third_of_its_steps_on_one_or_two_workers(tmp_path: Path) -> None:
    """The full grid (9 learning rates, half a decade apart from 1e-4 to 1, x 3 ranks, each to its
    end) against the search over the same ranges (the learning rate continuous on a log scale) with
    a budget of a third of the grid's steps (never passed): the search's chosen trial is within the
    noise of the grid's best cell in less than a third of the grid's steps, on one worker and on
    two. The noise: how far the best cell's loss moves when its learning rate moves by 3% either
    way, a change that should not matter (another train.seed is another tiny model: its random
    initial weights come from the seed). The best rate is inside the range: those above it
    overshoot, 0.3 and 1 blow up. The search has two rungs (steps 4 and 12: tune.rungs=2, the
    docs' choice for a wide space): a search's odds rest on its trials, and a rung at a ninth of
    the run fits about 20 in a third of the grid's steps where one rung fits 13, a coin flip
    (benchmarks/cpu-tiny-quality-tune/replay.md)."""
    data = _plant(tmp_path / "data")
    training = ["model=sdxl_tiny", "resolution.width=32", "resolution.height=32", "logger=none", "data=folder",
                f"data.path={data}", "data.buckets=false", "validation=on", "validation.split=6", "adapter=lora",
                "adapter.alpha=16", "scheduler=constant", "train.micro_batch_size=6",
                "train.max_steps=36", "validation.every=4",  # rungs at steps 4 and 12
                "adapter.targets=[to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,"
                "ff.net.2,conv1,conv2,conv_in,conv_out]"]
    grid = _tune(tmp_path, "grid", [*training, "tune.sampler=grid", "tune.pruner=none", "tune.rerun=false",
                                    "optimizer.lr=1e-4,3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1",
                                    "adapter.rank=1,4,16"])
    cells = [t for t in grid.trials if t.state.name == "COMPLETE"]
    assert len(cells) == 27
    best = min(cells, key=lambda t: t.value)
    grid_steps = sum(int(t.user_attrs["steps"]) for t in cells)
    losses = [best.value]
    for scale in (0.97, 1.03):
        folder = tmp_path / f"lr{scale}"
        line = [*training, f"adapter.rank={best.params['adapter.rank']}",
                f"optimizer.lr={best.params['optimizer.lr'] * scale}", "train.export=false", f"hydra.run.dir={folder}"]
        subprocess.run([sys.executable, "-m", "ds_trainer", *line], cwd=tmp_path, capture_output=True, timeout=900,
                       check=True)
        losses.append(json.loads((folder / "summary.json").read_text())["val_loss"])
    noise = max(losses) - min(losses)
    # the planted data has one clear best: the best cell beats the best of every other learning rate by more
    others = [t.value for t in cells if t.params["optimizer.lr"] != best.params["optimizer.lr"]]
    assert min(others) - best.value > noise, (best.params, best.value, min(others), losses)
    budget = (grid_steps - 1) // 3  # less than a third: a step budget is never passed
    search = {}
    for workers in (1, 2):
        study = _tune(tmp_path, f"search{workers}", [*training, f"tune.budget={budget}steps",
                                                      f"tune.workers={workers}", "tune.rungs=2",
                                                      "optimizer.lr=tag(log,interval(1e-4,1))",
                                                      "adapter.rank=1,4,16"])
        chosen = study.best_trial
        search[workers] = (chosen.value, chosen.params, _steps(study))
        print(f"grid: {grid_steps} steps, best {best.value:.6f} {best.params}; noise {noise:.6f} ({losses}); "
              f"search on {workers} worker(s): {_steps(study)} steps, chosen {chosen.value:.6f} {chosen.params}")
        assert _steps(study) < grid_steps / 3
        assert chosen.value <= best.value + 2 * noise
    # two workers give the same answer: the same rank, a learning rate within the grid's step of it
    (_, one, _), (_, two, _) = search[1], search[2]
    assert one["adapter.rank"] == two["adapter.rank"]
    assert abs(math.log10(one["optimizer.lr"]) - math.log10(two["optimizer.lr"])) < 1


def test_a_grid_ends_when_its_last_cell_is_told(tmp_path: Path) -> None:
    """Optuna's grid sampler calls study.stop once its grid is done, which raises outside study.optimize: the tune's
    tell takes that as the grid's end (the last cell of a grid tune crashed the tune before)."""
    import optuna
    from omegaconf import OmegaConf

    from ds_trainer.tools.tune import study as shared
    from ds_trainer.tools.tune.axes import Axis

    t = OmegaConf.merge(make_cfg().tune, {"sampler": "grid", "pruner": "none", "name": "g"})
    axis = Axis("adapter.rank", "1,4", optuna.distributions.CategoricalDistribution([1, 4]))
    study = shared.open_study(t, tmp_path, {"a": 1}, [axis], 1, 9)
    for _ in range(2):
        trial = study.ask({"adapter.rank": axis.distribution})
        trial.set_user_attr("worker", shared.me())
        shared.tell(study, trial, 1.0)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "COMPLETE"]
    assert shared.over(study, shared.Budget(None, None, None)) == "every cell of the grid has run"
    assert sorted(t.params["adapter.rank"] for t in study.get_trials()) == [1, 4]
