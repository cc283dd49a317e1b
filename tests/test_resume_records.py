"""After a run dies between its last checkpoint and later steps, the resume trains those steps again:
metrics.jsonl and the W&B history show each step once, with the resumed values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import wandb_log
from conftest import run_cli, run_dirs
from test_train import metrics

pytest.importorskip("torch")
ARGS = ["train.max_steps=4", "train.checkpoint_every=2", "data.num_samples=8", "train.export=false"]


@pytest.mark.slow
def test_steps_after_the_checkpoint_are_recorded_once_after_a_requeue(workdir: Path) -> None:
    first = run_cli(*ARGS, cwd=workdir)  # logger=wandb, offline: the defaults
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = run_dirs(workdir)
    # What a kill -9 after step 4 but before its save leaves: steps 1-4 logged, the newest checkpoint 2.
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 0.')  # and a line cut short by the kill
    logged_before = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()[:4])}
    # Slurm's requeue runs the job again in its own run directory.
    again = run_cli(*ARGS, f"hydra.run.dir={run}", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing from" in again.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["s_per_it"] != logged_before[3]["s_per_it"]  # the resumed values stand
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2
    assert wandb_log.run_info(files[1]).branch_point.value == 2
    assert [h["_step"] for h in wandb_log.history(files[1])] == [3, 4]
    merged = wandb_log.rewound_history(files)
    assert [h["_step"] for h in merged] == [1, 2, 3, 4]
    assert [h["loss"] for h in merged] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
