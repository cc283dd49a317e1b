"""After a run dies between its last checkpoint and later steps, the resume trains those steps again:
metrics.jsonl and the W&B history show each step once, with the resumed values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import wandb_log
from helpers.cli import run_cli, run_dirs
from test_train import metrics

pytest.importorskip("torch")
# A validation every 2 steps: at 2 and 4, again at 4 after the resume.
ARGS = ["train.max_steps=4", "train.checkpoint_every=2", "data.num_samples=8", "train.export=false", "validation=on",
        "validation.every=2"]


@pytest.mark.slow
def test_steps_after_the_checkpoint_are_recorded_once_after_a_requeue(workdir: Path) -> None:
    first = run_cli(*ARGS, cwd=workdir)  # logger=wandb, offline: the defaults
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = run_dirs(workdir)
    # What a kill -9 after step 4 but before its save leaves: steps 1-4 logged, the newest checkpoint 2.
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 0.')  # and a line cut short by the kill
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    logged_before = {r["step"]: r for r in before if "loss" in r}
    assert [(r["step"], r["val_loss"] < 10) for r in before if "val_loss" in r] == [(2, True), (4, True)]
    # Mark the step-2 validation the first life recorded: the resumed run's summary must read it from there.
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "val_loss": 0.001} if "val_loss" in r and r["step"] == 2
                                                          else r) + "\n" for r in before))
    # Slurm's requeue runs the job again in its own run directory.
    again = run_cli(*ARGS, f"hydra.run.dir={run}", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing from" in again.stderr
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # The validation schedule goes on from the checkpoint: step 4 scored again, step 2's score kept.
    scores = [r for r in metrics(run) if "val_loss" in r]
    assert [(r["step"], r["val_loss"]) for r in scores][0] == (2, 0.001) and [r["step"] for r in scores] == [2, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["val_loss_best"], summary["val_loss_best_step"]) == (0.001, 2)
    assert (summary["val_loss"], summary["val_loss_step"], summary["validations"]) == (scores[1]["val_loss"], 4, 2)
    assert "validation loss" in again.stderr and "not in s/it" in again.stderr
    resumed = summary["resumed_from"]  # what the run continued from
    assert (resumed["checkpoint"], resumed["step"], resumed["load"]) == (str(run / "checkpoints" / "step_00000002"),
                                                                          2, "native")
    assert resumed["layout"]["zero"] == "stage2" and resumed["run_dir"] == str(run)
    assert rows[2]["s_per_it"] != logged_before[3]["s_per_it"]  # the resumed values stand
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    assert wandb_log.run_info(files[1]).branch_point.value == 2
    assert [h["_step"] for h in wandb_log.history(files[1])] == [3, 4]
    merged = wandb_log.rewound_history(files)
    assert [h["_step"] for h in merged] == [1, 2, 3, 4]
    assert [h["loss"] for h in merged] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    # W&B: the validation in its own panel (`val/`), in the row of its step.
    val = {h["_step"]: h["val/loss"] for h in merged if "val/loss" in h}
    assert sorted(val) == [2, 4] and val[4] == pytest.approx(scores[1]["val_loss"], rel=1e-6)
    assert all("val/seconds" in h for h in merged if "val/loss" in h)


@pytest.mark.slow
def test_a_run_that_would_train_nothing_or_start_over_in_a_used_folder_is_refused(workdir: Path) -> None:
    """A finished folder run again with fewer steps (it trained 0 steps and overwrote the summary, card and
    config of step 4's weights), and a folder whose every checkpoint is damaged (it started over at step 0, each
    step then twice in metrics.jsonl): refused on one screen, the folder's records untouched."""
    first = run_cli(*ARGS, "logger=none", cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = run_dirs(workdir)
    # Another folder resumed from this one's step 2: the best validation loss carries over from where it came.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "val_loss": 0.001} if "val_loss" in r and r["step"] == 2
                                                          else r) + "\n" for r in rows))
    other = run_cli(*ARGS, "logger=none", f"resume={run / 'checkpoints' / 'step_00000002'}", cwd=workdir)
    assert other.returncode == 0, other.stderr[-3000:]
    (second,) = set(run_dirs(workdir)) - {run}
    carried = json.loads((second / "summary.json").read_text())
    assert (carried["val_loss_best"], carried["val_loss_best_step"]) == (0.001, 2), carried
    assert carried["val_loss_step"] == 4 and carried["resumed_from"]["run_dir"] == str(run)
    records = [run / "summary.json", run / "config.yaml", run / "metrics.jsonl", *(run / ".hydra").iterdir()]
    kept = {p: p.read_bytes() for p in records}
    fewer = run_cli(*ARGS, "logger=none", "train.max_steps=2", f"hydra.run.dir={run}", cwd=workdir)
    assert fewer.returncode == 2 and "Traceback" not in fewer.stderr, fewer.stderr[-3000:]
    assert "train.max_steps=2" in fewer.stderr and "nothing is left to train" in fewer.stderr
    assert "train.max_steps=8 (above 4)" in fewer.stderr
    assert {p: p.read_bytes() for p in records} == kept  # Hydra's .hydra/ files too
    for saved in (run / "checkpoints").glob("step_*"):
        largest = max((f for f in saved.rglob("*") if f.is_file() and f.name != "COMPLETE"),
                      key=lambda f: f.stat().st_size)
        largest.write_bytes(largest.read_bytes()[:100])
    again = run_cli(*ARGS, "logger=none", "train.max_steps=6", f"hydra.run.dir={run}", cwd=workdir)
    assert again.returncode == 2 and "every checkpoint of this run folder" in again.stderr, again.stderr[-3000:]
    assert {p: p.read_bytes() for p in records} == kept
