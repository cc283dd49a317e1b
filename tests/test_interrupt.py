"""Ctrl-C keeps the work: the first one finishes the step and saves, a second one stops at once, and a
checkpoint by wall time bounds what no signal handler can save.

Each run is started as a terminal starts a foreground job: SIGINT at its default disposition (a shell's
background job has it ignored, and Python then installs no KeyboardInterrupt handler), in a process group of its
own, and Ctrl-C is sent to that whole group, as the terminal does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import run_cli, run_dirs
from helpers.procs import sigint_at_default, wait_until
from helpers.ranks import torchrun

pytestmark = [pytest.mark.slow]


def _terminal_job(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_at_default, start_new_session=True)


def _ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps_done(cwd: Path) -> int:
    dirs = run_dirs(cwd)
    rows = _rows(dirs[0]) if dirs else []
    return rows[-1]["step"] if rows else 0


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _complete(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/COMPLETE"))


ARGS = ["logger=none", "data.num_samples=8", "train.max_steps=400", "train.export=false", "scheduler.warmup_steps=5"]


def test_ctrl_c_saves_the_step_and_resume_latest_finishes_with_checkpoints_by_wall_time_meanwhile(
        tmp_path: Path) -> None:
    # 0.02 minutes: a checkpoint every 1.2 s of wall time, so a few land before Ctrl-C (checkpoint_every is 0).
    cmd = [sys.executable, "-m", "ds_trainer", "zero=stage3", *ARGS, "train.max_steps=40",
           "train.checkpoint_every_minutes=0.02"]
    proc = _terminal_job(cmd, tmp_path)
    wait_until(lambda: _steps_done(tmp_path) >= 6 and len(_complete(run_dirs(tmp_path)[0])) >= 2,
               "no time-based checkpoints before the run ended", proc=proc, deadline=time.time() + 300,
               interval=0.05)
    _ctrl_c(proc)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "Ctrl-C: stopping after this step with a checkpoint" in err
    (run_dir,) = run_dirs(tmp_path)
    stopped = _summary(run_dir)
    steps = stopped["steps"]
    assert stopped["status"] == "interrupted" and 6 <= steps < 40
    saved = run_dir / "checkpoints" / f"step_{steps:08d}"
    assert (saved / "COMPLETE").is_file()  # the step in flight finished and was saved
    assert f"stopped by Ctrl-C after step {steps}; checkpoint {saved}. resume=latest continues from it" in err
    by_time = _complete(run_dir)[:-1]  # checkpoints_to_keep=2: the newest time-based one is kept beside it
    assert by_time and by_time[-1] < steps  # written by the clock (checkpoint_every is 0)
    resumed = run_cli("zero=stage3", *ARGS, "train.max_steps=40", "resume=latest", "train.checkpoint_every_minutes=0",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    second = run_dirs(tmp_path)[1]
    assert [r["step"] for r in _rows(second)] == list(range(steps + 1, 41))  # on to max_steps, nothing lost
    assert _summary(second)["status"] == "ok"


@pytest.mark.long  # CI budget: the first Ctrl-C's save and resume run by default
def test_a_second_ctrl_c_stops_at_once_and_leaves_no_checkpoint_that_looks_complete(tmp_path: Path) -> None:
    # Steps of seconds (512 px, micro batch 8, two micro-batches), no checkpoint before Ctrl-C's. In fp32: a CPU
    # without bf16 kernels (AVX2 only) took 150 s a step in bf16; a second Ctrl-C waits for the backward in flight.
    cmd = [sys.executable, "-m", "ds_trainer", "zero=stage2", *ARGS, "resolution=px512", "train.micro_batch_size=8",
           "train.gradient_accumulation_steps=2", "train.checkpoint_every_minutes=0", "precision=fp32"]
    proc = _terminal_job(cmd, tmp_path)
    wait_until(lambda: _steps_done(tmp_path) >= 2, "the run ended early", proc=proc, deadline=time.time() + 300,
               interval=0.02)
    _ctrl_c(proc)  # just after step 2 ended: step 3 is in flight
    time.sleep(1.2)  # a person's second press (torchrun's echo of the first comes within milliseconds)
    _ctrl_c(proc)
    _, err = proc.communicate(timeout=120)
    (run_dir,) = run_dirs(tmp_path)
    rows = _rows(run_dir)
    assert rows[-1]["s_per_it"] > 1.5, "steps too short for a second Ctrl-C inside one"
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stopped = _summary(run_dir)
    assert stopped["status"] == "interrupted" and stopped["steps"] == 2
    assert stopped["message"].startswith("stopped at once by Ctrl-C during step 3: no checkpoint was written for "
                                          "this step; resume=latest continues from the start"), stopped["message"]
    assert not list((run_dir / "checkpoints").glob("step_*"))  # nothing that looks like a checkpoint


@pytest.mark.multiproc
def test_ctrl_c_on_a_two_rank_torchrun_stops_both_ranks_after_the_same_step_with_one_checkpoint(
        tmp_path: Path) -> None:
    cmd = [*torchrun(2), "-m", "ds_trainer", "zero=stage2", *ARGS, "train.checkpoint_every_minutes=0"]
    proc = _terminal_job(cmd, tmp_path)
    wait_until(lambda: _steps_done(tmp_path) >= 3, "the run ended early", proc=proc, deadline=time.time() + 300,
               interval=0.05)
    _ctrl_c(proc)  # the terminal's Ctrl-C reaches torchrun and both ranks; torchrun passes it on again
    _, err = proc.communicate(timeout=300)  # no hang
    (run_dir,) = run_dirs(tmp_path)
    stopped = _summary(run_dir)
    steps = stopped["steps"]
    assert stopped["status"] == "interrupted" and stopped["world_size"] == 2, err[-3000:]
    assert _complete(run_dir) == [steps]  # one checkpoint, of the step both ranks stopped after
    meta = json.loads((run_dir / "checkpoints" / f"step_{steps:08d}" / "portable" / "meta.json").read_text())
    assert meta["step"] == steps and meta["layout"]["world_size"] == 2
    # Our ranks print no traceback (torchrun itself reports that it was interrupted, in its own words).
    ours = [line for line in err.splitlines() if "ds_trainer" in line and "Traceback" in line]
    assert not ours, err[-3000:]
    assert err.count("stopped by Ctrl-C after step") >= 1
