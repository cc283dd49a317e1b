"""One tune cell: a short real training in a process of its own, under a hard time limit, alone on the machine.

The cell runs as `python -m ds_trainer <overrides>` (a plain local process, like a local sweep cell), or
as a one-cell multirun through a Hydra launcher (`tune.launcher`: local_2proc, slurm_gpu, ...), so it
goes through the same launchers as sweeps. A cell still running at its time limit is stopped (its whole
process group) and counts as a hang. Cells never overlap: a machine-wide lock is held while one runs
(two training processes sharing 2 cores were measured at 11 s/it against 0.11 s/it alone). What else
used the CPU meanwhile (load average, the busiest other processes, those that started or ended
during the cell included) is recorded with the cell.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOCK = Path(tempfile.gettempdir()) / "ds_trainer-tune.lock"


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """Held while a cell runs, so cells of two tunes on one machine do not overlap either."""
    with LOCK.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tune: waiting for another tune's cell to finish ({LOCK})", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _processes() -> dict[tuple[int, int], tuple[int, str, int]]:
    """{(pid, start tick): (utime + stime ticks, command name, session)} of every process; the
    start tick tells a pid the kernel reused from the process that held it before."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        ticks = int(fields[11]) + int(fields[12])
        out[int(entry.name), int(fields[19])] = (ticks, name, int(fields[3]))
    return out


class Others:
    """What other processes used of the CPU while a cell ran: /proc read every `every` seconds,
    so a process that started during the cell counts all its time and one that ended counts what
    it used up to the last reading (two readings, one at each end, saw neither)."""

    def __init__(self, exclude_session: int | None = None, every: float = 0.5) -> None:
        self.exclude_session, self.every = exclude_session, every
        self.first: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], tuple[int, str, int]] = {}
        self._began = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> None:
        for key, value in _processes().items():
            self.last[key] = value
            # a process first seen after the start began during the cell: all its time is the cell's
            self.first.setdefault(key, 0 if self._began else value[0])

    def _watch(self) -> None:
        while not self._done.wait(self.every):
            self._read()

    def __enter__(self) -> Others:
        self._read()
        self.start, self._began = time.time(), True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._read()
        self.elapsed = time.time() - self.start

    def busiest(self, limit: int = 8) -> list[str]:
        """The other processes that used more than 5% of a core during the cell, busiest first."""
        hz, ours = os.sysconf("SC_CLK_TCK"), os.getpid()
        busy = []
        for (pid, started), (ticks, name, session) in self.last.items():
            if pid == ours or session in (self.exclude_session, ours):
                continue
            share = (ticks - self.first[pid, started]) / hz / max(self.elapsed, 1e-6)
            if share > 0.05:
                busy.append((share, f"{name}[{pid}] {100 * share:.0f}%"))
        return [text for _, text in sorted(busy, reverse=True)[:limit]]


def command(overrides: list[str], cell_dir: Path, launcher: str | None) -> tuple[list[str], Path]:
    """The cell's command and the folder its run writes `summary.json` into."""
    base = [sys.executable, "-m", "ds_trainer"]
    if launcher is None:
        return [*base, *overrides, "hydra.mode=RUN", f"hydra.run.dir={cell_dir}"], cell_dir
    # --multirun before the overrides: Hydra reads one run of positional overrides
    return [*base, "--multirun", *overrides, f"hydra/launcher={launcher}", f"hydra.sweep.dir={cell_dir}",
            "hydra.sweep.subdir=run"], cell_dir / "run"


_STOPPED: list[int] = []  # the signal that stopped the tune, once one did


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the tune, so a running cell (in a session of its own) is stopped too. The signal
    is also remembered: one that lands in a finalizer (a `__del__`, a garbage collector's callback) has its
    SystemExit printed as "Exception ignored" and dropped by Python, and `raise_if_stopped` raises it again at the
    tune's next step."""
    def handler(signum: int, frame: Any) -> None:  # noqa: ARG001 - signal's handler signature
        _STOPPED.append(signum)
        raise SystemExit(128 + signum)

    _STOPPED.clear()
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
        raise_if_stopped()
    finally:
        signal.signal(signal.SIGTERM, previous)


def raise_if_stopped() -> None:
    """SystemExit if a SIGTERM reached the tune (even one whose own SystemExit Python dropped)."""
    if _STOPPED:
        raise SystemExit(128 + _STOPPED[0])


def stop(proc: subprocess.Popen[bytes], launcher: str | None) -> None:
    """Stop the cell: SIGINT first when a launcher runs it (a launcher's Ctrl-C cancels the jobs it
    submitted, which run outside this process group, on Slurm's nodes), then SIGTERM to the cell's process
    group, then SIGKILL to what is left."""
    steps = ((signal.SIGINT, 30.0),) if launcher is not None else ()
    for sig, wait in (*steps, (signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait(proc: subprocess.Popen[bytes], launcher: str | None, time_limit: float) -> bool:
    """Wait for the cell to end; True when it was still running at its time limit (then stopped)."""
    try:
        proc.wait(timeout=time_limit)
        return False
    except subprocess.TimeoutExpired:
        stop(proc, launcher)
        return True
    except BaseException:  # the tune is stopped (Ctrl-C, SIGTERM): its cell must not run on alone
        stop(proc, launcher)
        raise


def timed(run_dir: Path, warmup: int) -> tuple[float | None, float | None]:
    """Median s/it and images/s of the steps after `warmup` (wall clock: data loading and optimizer included)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None, None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) > warmup and "s_per_it" in r]
    if not rows:
        return None, None
    return statistics.median(r["s_per_it"] for r in rows), statistics.median(r["images_per_s"] for r in rows)


def run(overrides: list[str], cell_dir: Path, launcher: str | None, time_limit: float, warmup: int) -> dict[str, Any]:
    """Run one cell to its end or its time limit; returns its status, speed, memory and what else ran."""
    cmd, run_dir = command(overrides, cell_dir, launcher)
    cell_dir.mkdir(parents=True, exist_ok=True)
    with machine_lock(), (cell_dir / "cell.log").open("wb") as log:
        load_before, watch = os.getloadavg()[0], Others()
        with watch:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            watch.exclude_session = proc.pid  # the cell's own processes (a session of their own)
            hung = _wait(proc, launcher, time_limit)
        load_after = os.getloadavg()[0]
    result: dict[str, Any] = {"elapsed_s": round(watch.elapsed, 1), "load_before": load_before,
                              "load_after": load_after, "others": watch.busiest()}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() and not hung else {}
    if hung:
        result.update(status="timeout", message=f"no result within tune.time_limit_s={time_limit:g} s "
                      "(a hang counts as a failure); the cell's processes were stopped")
    elif not summary:
        tail = (cell_dir / "cell.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        result.update(status="error", message=f"exit status {proc.returncode}, no summary.json: {tail[0][:300]}")
    else:
        result.update(status=summary.get("status", "error"), message=summary.get("message"))
    s_per_it, images_per_s = timed(run_dir, warmup) if result["status"] == "ok" else (None, None)
    result.update(summary=summary, s_per_it=s_per_it, images_per_s=images_per_s, run_dir=str(run_dir))
    return result
