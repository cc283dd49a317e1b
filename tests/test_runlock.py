"""One training process per run directory: a second run stops at once naming the first; a lock left by
a dead process is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import run_cli
from helpers.procs import wait_until
from helpers.ranks import free_port
from test_train import metrics, summary

from ds_trainer.config import runlock


def _dead_pid() -> int:
    proc = subprocess.Popen(["sleep", "60"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.pid


def _write_lock(folder: Path, **fields: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / runlock.LOCK).write_text(json.dumps(fields))


def test_a_live_holder_is_named_and_a_dead_one_is_taken_over(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        host = socket.gethostname()
        _write_lock(tmp_path / "live", pid=sleeper.pid, host=host, start=runlock._proc_start(sleeper.pid), since=0)
        with pytest.raises(runlock.Busy, match=f"process {sleeper.pid} on host {host}"):
            runlock.acquire(tmp_path / "live")
    finally:
        sleeper.kill()
        sleeper.wait()
    _write_lock(tmp_path / "dead", pid=_dead_pid(), host=socket.gethostname(), start="1", since=0)
    runlock.acquire(tmp_path / "dead")  # the pid is gone: stale
    assert json.loads((tmp_path / "dead" / runlock.LOCK).read_text())["pid"] == os.getpid()


def test_other_hosts_are_judged_by_their_heartbeat_and_a_requeued_slurm_job_by_its_restart_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_lock(tmp_path / "fresh", pid=1, host="node-elsewhere", since=0)
    with pytest.raises(runlock.Busy, match="on host node-elsewhere"):
        runlock.acquire(tmp_path / "fresh")
    _write_lock(tmp_path / "old", pid=1, host="node-elsewhere", since=0)
    old = time.time() - runlock.STALE_S - 5
    os.utime(tmp_path / "old" / runlock.LOCK, (old, old))
    runlock.acquire(tmp_path / "old")  # no heartbeat for longer than STALE_S: the node died
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    _write_lock(tmp_path / "requeued", pid=1, host="node-elsewhere", slurm_job_id="77", restart_count=1, since=0)
    runlock.acquire(tmp_path / "requeued")  # the same job's previous run, at once (no heartbeat wait)
    _write_lock(tmp_path / "other_job", pid=1, host="node-elsewhere", slurm_job_id="78", restart_count=0, since=0)
    with pytest.raises(runlock.Busy, match="Slurm job 78"):
        runlock.acquire(tmp_path / "other_job")


@pytest.mark.slow
@pytest.mark.long  # CI budget: the lock's heartbeat rules run by default
def test_a_second_run_on_a_busy_run_directory_stops_at_once_and_the_first_finishes_untouched(
        tmp_path: Path) -> None:
    folder = tmp_path / "outputs" / "the_run"
    args = ["logger=none", "train.max_steps=80", "train.checkpoint_every=8", "data.num_samples=8",
            "train.export=false", f"hydra.run.dir={folder}"]
    first = subprocess.Popen([sys.executable, "-m", "ds_trainer", *args], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (folder / "metrics.jsonl").exists() and (folder / "metrics.jsonl").read_text().strip(),
               "the first run ended before its first step", proc=first, deadline=time.time() + 400)
    config_before = (folder / "config.yaml").stat().st_mtime_ns
    records = {p: p.read_bytes() for p in (folder / ".hydra").iterdir()}  # Hydra's own, of the run that trains
    second = run_cli(*args, "resume=latest", "train.lr=0.5", cwd=tmp_path)
    assert first.poll() is None, "the first run ended before the second started: nothing was tested"
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert f"process {first.pid} on host {socket.gethostname()}" in second.stderr
    # Two ranks started the way srun starts them (nothing stops rank 1 when rank 0 exits): rank 1 does not
    # wait for the refused rank 0 in the process group, it stops with the same message.
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "ds_trainer", *args, "resume=latest"], cwd=tmp_path,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outcomes = [(p.communicate(timeout=180)[1], p.returncode) for p in ranks]
    assert first.poll() is None, "the first run ended before the two-rank launch: nothing was tested"
    for err_r, code in outcomes:
        assert code == 2 and "another run is training in this folder" in err_r, err_r[-3000:]
    assert (folder / "config.yaml").stat().st_mtime_ns == config_before
    assert {p: p.read_bytes() for p in (folder / ".hydra").iterdir()} == records  # the refused ones wrote none
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert [r["step"] for r in metrics(folder)] == list(range(1, 81)) and summary(folder)["status"] == "ok"
    assert not (folder / runlock.LOCK).exists()  # released at the end
    # What a kill -9 leaves: the lock of a process that is gone. A new run takes it over.
    _write_lock(folder, pid=_dead_pid(), host=socket.gethostname(), start="1", since=0)
    again = run_cli(*[a for a in args if not a.startswith("train.max_steps")], "train.max_steps=82", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in metrics(folder)][-2:] == [81, 82]


def test_other_ranks_follow_rank_0_into_the_lock_or_out_with_its_refusal(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        busy = tmp_path / "busy"
        _write_lock(busy, pid=sleeper.pid, host=socket.gethostname(), start=runlock._proc_start(sleeper.pid),
                    since=0, launch="another launch")
        with pytest.raises(runlock.Busy):
            runlock.acquire(busy)  # rank 0, refused
        start = time.time()
        with pytest.raises(runlock.Busy, match=f"process {sleeper.pid} on host"):
            runlock.follow(busy)  # rank 1 of the same launch: out at once with rank 0's reason
        assert time.time() - start < 5
        monkeypatch.setenv("MASTER_PORT", "29998")  # another launch: that refusal is not its own
        start = time.time()
        runlock.follow(busy, timeout_s=1)  # nothing for it: it gives up waiting and carries on
        assert 1 <= time.time() - start < 5
    finally:
        sleeper.kill()
        sleeper.wait()
    free = tmp_path / "free"
    runlock.acquire(free)  # rank 0 of this launch takes it ...
    start = time.time()
    runlock.follow(free)  # ... and its other ranks see it held by their launch at once
    assert time.time() - start < 5
