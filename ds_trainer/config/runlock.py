"""One training process per run directory: `run.lock`, taken by rank 0 before any run file is written.

A second run on the same folder (a user resubmitting by hand while Slurm requeues the job, two
terminals) stops at once naming the process and host that hold it. A lock left by a process that died
is stale and taken over:
- on the same host: its pid no longer runs (or runs another program: the start time differs);
- the same Slurm job (SLURM_JOB_ID) on its next requeue (SLURM_RESTART_COUNT higher): the holder was
  an earlier incarnation, whatever node it ran on;
- on another host: its heartbeat (the file's mtime, touched every HEARTBEAT_S) is older than STALE_S;
  pids mean nothing across hosts, and a shared file system is all the nodes have in common.
The other ranks of the launch wait to see rank 0 hold the lock (`follow`); when rank 0 was refused they
stop with its message (from `run.lock.refused.<launch>`) rather than wait for it in the process group.
Torch-free.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

LOCK = "run.lock"
HEARTBEAT_S = 15.0
STALE_S = 90.0
FOLLOW_S = 120.0
REFUSAL_FRESH_S = 300.0


class Busy(Exception):
    """Another live process trains in this run directory; the message names it."""


def _proc_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def launch_id() -> str:
    """What every rank of one launch shares (and another launch does not): the master's address and port,
    torchrun's run id, Slurm's job and restart count."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")
    return "/".join(os.environ.get(key, "") for key in keys)


def _refusal(run_dir: Path) -> Path:
    return run_dir / f"{LOCK}.refused.{hashlib.sha1(launch_id().encode()).hexdigest()[:12]}"


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()), "launch": launch_id(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0), "since": time.time()}


def holder(run_dir: Path) -> dict[str, Any] | None:
    """The live holder of the run directory's lock, or None (no lock, or a stale one)."""
    path = run_dir / LOCK
    try:
        held: dict[str, Any] = json.loads(path.read_text())
        age = time.time() - path.stat().st_mtime
    except (OSError, ValueError):
        return None
    me = _me()
    if held.get("pid") == me["pid"] and held.get("host") == me["host"]:
        return None  # ours (a second call in the same process)
    if held.get("slurm_job_id") and held["slurm_job_id"] == me["slurm_job_id"] \
            and int(held.get("restart_count", 0)) < me["restart_count"]:
        return None  # an earlier run of this requeued Slurm job
    if held.get("host") == me["host"]:
        pid = int(held.get("pid", 0))
        alive = pid > 0 and _proc_start(pid) is not None
        return held if alive and _proc_start(pid) == held.get("start") else None
    return held if age < STALE_S else None


def describe(held: dict[str, Any]) -> str:
    job = f", Slurm job {held['slurm_job_id']}" if held.get("slurm_job_id") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(held.get("since", 0))))
    return f"process {held.get('pid')} on host {held.get('host')}{job}, running since {started}"


def acquire(run_dir: Path) -> None:
    """Take the lock (rank 0 only), or raise Busy naming the live holder (and leave the refusal where this
    launch's other ranks look: `follow`). Released at exit; a heartbeat thread keeps it fresh for processes
    on other hosts."""
    try:
        _acquire(run_dir)
    except Busy as busy:
        with contextlib.suppress(OSError):
            _refusal(run_dir).write_text(str(busy))
        raise


def follow(run_dir: Path, timeout_s: float = FOLLOW_S) -> None:
    """Every rank but 0: wait until rank 0 of this launch holds the lock; raise Busy with rank 0's reason
    when it was refused (a rank left waiting for a rank 0 that has gone would hang in the process group).
    After `timeout_s` without either (rank 0 slow to start, or on a node that does not see this folder),
    carry on: the process group setup decides."""
    deadline = time.time() + timeout_s
    me, refused = launch_id(), _refusal(run_dir)
    while time.time() < deadline:
        try:  # written by this launch's rank 0 moments ago (an old one of a launch with the same id: ignored)
            if time.time() - refused.stat().st_mtime < REFUSAL_FRESH_S:
                raise Busy(refused.read_text())
        except FileNotFoundError:
            pass
        try:
            if json.loads((run_dir / LOCK).read_text()).get("launch") == me:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)


def _acquire(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = holder(run_dir)
            if held is not None:
                raise Busy(describe(held)) from None
            stale = path.with_name(f"{LOCK}.stale.{os.getpid()}")
            try:
                os.replace(path, stale)  # atomic: of two processes taking over, one gets it
                stale.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
        with contextlib.suppress(OSError):
            _refusal(run_dir).unlink()  # an earlier launch's with the same id
        _keep(path)
        return
    raise Busy(f"the lock {path} keeps changing hands")


def _keep(path: Path) -> None:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(path)
            except OSError:
                return

    threading.Thread(target=beat, name="ds_trainer-run-lock", daemon=True).start()

    def release() -> None:
        stop.set()
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass

    atexit.register(release)
