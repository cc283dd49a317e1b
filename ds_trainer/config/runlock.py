"""One training process per run directory: `run.lock`, taken by rank 0 before any run file is written.

A second run on the same folder (a user resubmitting by hand while Slurm requeues the job, two
terminals) stops at once naming the process and host that hold it. A lock left by a process that died
is stale and taken over:
- on the same host: its pid no longer runs (or runs another program: the start time differs);
- the same Slurm job (SLURM_JOB_ID) on its next requeue (SLURM_RESTART_COUNT higher): the holder was
  an earlier incarnation, whatever node it ran on;
- on another host: its heartbeat (the file's mtime, touched every HEARTBEAT_S) is older than STALE_S;
  pids mean nothing across hosts, and a shared file system is all the nodes have in common.
Torch-free.
"""

from __future__ import annotations

import atexit
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


class Busy(Exception):
    """Another live process trains in this run directory; the message names it."""


def _proc_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _proc_start(os.getpid()),
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
    """Take the lock (rank 0 only), or raise Busy naming the live holder. Released at exit; a heartbeat
    thread keeps it fresh for processes on other hosts."""
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
