"""Run one step in a process of its own under its timeout, and read what it left into a row of the results.

A step is started in a session of its own, so a timeout stops it and everything it started (DeepSpeed's op
builds, data workers). The host RSS peak comes from the kernel's accounting of the finished process (wait4), so
it covers every step kind, probes included; a training run's own figures (summary.json, metrics.jsonl, its log's
memory plan line) are read where it wrote them, also when it was stopped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ds_trainer.gpucheck.builds import Build
from ds_trainer.gpucheck.steps import BUILDERS, Step

MIB = 2**20
GRACE_S = 3.0  # SIGTERM to SIGKILL: a run stopped at its timeout may not write a checkpoint on the budget's time
KILL_WAIT_S = 10.0  # SIGKILL to its end: freeing a large host memory (Flux's) takes seconds
# The line a run logs at its start (tools/plan.py: log_for_run / describe): the planner's estimate of this run.
PLAN = re.compile(r"memory plan \(python -m ds_trainer\.plan\)[^:]*: about ([\d.]+) GiB GPU per rank \(params "
                  r"([\d.]+), grads ([\d.]+), optimizer ([\d.]+), activations ([\d.]+), buffers ([\d.]+) GiB\), "
                  r"host ([\d.]+) GiB")
ERROR = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt|Exit)\b:?|^error:|^ds_trainer: |CUDA error", re.I)


def command(step: Step, out: Path, runs: dict[str, Path] | None = None) -> list[str]:
    """The step's command line (a resume from the run an earlier step left, in `runs` when an
    earlier call ran it)."""
    if step.kind == "probe":
        return [sys.executable, "-m", "ds_trainer.gpucheck.probes", *step.args]
    if step.kind == "cli":
        return [sys.executable, "-m", *step.args]
    folder = out / "runs" / step.name
    extra = [f"hydra.run.dir={folder}", f"plan.calibration={out / 'runs' / 'uncalibrated.jsonl'}"]
    if step.resume_from is not None:
        source = (runs or {}).get(step.resume_from, out / "runs" / step.resume_from)
        extra.append(f"resume={last_checkpoint(source)}")
    if step.tagged_images:
        extra += ["data=folder", f"data.path={out / 'data' / step.name}"]
    if step.reference_image:
        extra.append(f"samples.images=[{out / 'data' / 'reference.png'}]")
    return [sys.executable, "-m", "ds_trainer", *step.args, *extra]


def write_tagged_images(folder: Path, n: int) -> None:
    """`n` images of noise at 128 px with tag captions (a trigger word, then tags), as a user's folder holds them."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tags = ["red", "blue", "cube", "sphere", "outdoors", "studio light", "close-up", "35mm"]
    for i in range(n):
        pixels = rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:03d}.png")
        chosen = [tags[(i + j) % len(tags)] for j in range(4)]
        (folder / f"img{i:03d}.txt").write_text(", ".join(["sks thing", *chosen]))


def write_reference(path: Path) -> None:
    """An editing model's sample reference: a red square on blue, 96 x 128 (not the sample's shape)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (96, 128), (40, 80, 220))
    image.paste((220, 40, 40), (20, 30, 70, 90))
    image.save(path)


def last_checkpoint(run: Path) -> Path:
    """The newest complete checkpoint of an earlier step's run (a missing one makes the resume fail, as a user's
    would, with ds_trainer's own message)."""
    found = sorted(run.glob("checkpoints/step_*/COMPLETE"), key=lambda p: int(p.parent.name.split("_")[-1]))
    return found[-1].parent if found else run / "checkpoints" / "none"


def missing_modules(step: Step) -> list[str]:
    return [name for name in step.needs if importlib.util.find_spec(name) is None]


def execute(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, float, float]:
    """Run `cmd` with its output in `log`; (exit status or None on timeout, seconds, peak RSS MiB of the process
    tree the kernel accounted to it)."""
    import subprocess

    start = time.monotonic()
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return proc.returncode, time.monotonic() - start, usage.ru_maxrss / 1024
            if time.monotonic() - start > timeout:
                break
            time.sleep(0.2)
        for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    return None, time.monotonic() - start, usage.ru_maxrss / 1024
                time.sleep(0.1)
    return None, time.monotonic() - start, 0.0


def error_line(log: Path, summary: dict[str, Any]) -> str | None:
    """The error's first line: the run's own message, else the last line of the output that names an error."""
    if summary.get("message") and summary.get("status") != "ok":
        return str(summary["message"]).strip().splitlines()[0][:300]
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    named = [i for i, line in enumerate(lines) if ERROR.search(line) and "Warning" not in line]
    at = named[-1] if named else len(lines) - 1
    if at < 0:
        return None
    pick = lines[at]
    if pick.endswith(":"):  # ds_trainer's "N problem(s) in the configuration:" names them on the next lines
        pick = " ".join(lines[at:at + 3])
    return pick[:300]


def last_line(path: Path) -> str | None:
    """The last line a process wrote (a progress bar's last redraw), cut to 300 characters."""
    if not path.exists():
        return None
    parts = [p.strip() for p in path.read_text(errors="replace").replace("\r", "\n").splitlines() if p.strip()]
    return parts[-1][:300] if parts else None


def _gib(mib: Any) -> float | None:
    return round(float(mib) / 1024, 3) if mib is not None else None


def planned(log: Path) -> dict[str, float] | None:
    """The planner's estimate this run logged at its start (GiB), if it did."""
    if not log.exists():
        return None
    match = PLAN.search(log.read_text(errors="replace"))
    if match is None:
        return None
    keys = ("gpu", "params", "grads", "optimizer", "activations", "buffers", "host")
    return dict(zip(keys, (float(v) for v in match.groups()), strict=True))


def from_metrics(run: Path, warmup: int = 2) -> dict[str, float | None]:
    """Median s/it and images/s after `warmup` steps, and the memory peaks, from metrics.jsonl: it is written step
    by step, so a run stopped at its timeout still has them (summary.json is written at the end)."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")] if (
        path.exists()) else []
    rows = [r for r in rows if "s_per_it" in r]
    late = [r for r in rows if r.get("step", 0) > warmup] or rows

    def peak(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return max(values) if values else None
    return {"s_per_it": statistics.median(r["s_per_it"] for r in late) if late else None,
            "images_per_s": statistics.median(r.get("images_per_s", 0) for r in late) if late else None,
            **{key: peak(key) for key in ("gpu_mem_peak_allocated_mib", "gpu_mem_peak_reserved_mib",
                                          "host_rss_peak_mib")}}


def train_row(step: Step, run: Path) -> dict[str, Any]:
    """What a training run left in its folder: status, speed, memory, the planner's estimate, samples written."""
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    measured = from_metrics(run)
    s_per_it = measured["s_per_it"]
    figures = {k: summary.get(k) if summary.get(k) is not None else measured[k] for k in (
        "gpu_mem_peak_allocated_mib", "gpu_mem_peak_reserved_mib", "host_rss_peak_mib")}
    plan = planned(run / "ds_trainer.log")
    alloc = _gib(figures["gpu_mem_peak_allocated_mib"])
    row: dict[str, Any] = {
        "run_status": summary.get("status"), "steps_done": summary.get("steps"), "run_summary": summary,
        "s_per_it": round(s_per_it, 4) if s_per_it else None, "images_per_s": measured["images_per_s"],
        "gpu_alloc_gib": alloc, "gpu_reserved_gib": _gib(figures["gpu_mem_peak_reserved_mib"]),
        "host_rss_gib": _gib(figures["host_rss_peak_mib"]), "plan": plan,
        "plan_gib": plan["gpu"] if plan else None,
        "measured_over_planned": round(alloc / plan["gpu"], 3) if alloc and plan and plan["gpu"] else None}
    notes = []
    if summary.get("final_loss") is not None:
        notes.append(f"final loss {summary['final_loss']:.4g}")
    if summary.get("val_loss") is not None:
        notes.append(f"val loss {summary['val_loss']:.4g}")
    if summary.get("compile_s") is not None:
        notes.append(f"torch.compile {summary['compile_s']:.1f} s in {summary['compilations']} compilations")
    images = list(run.glob("samples/**/*.png"))
    if "samples=on" in step.args:
        notes.append(f"{len(images)} sample image(s)")
    log = run / "ds_trainer.log"
    if step.resume_from and log.exists():  # what the resume carried, in the run's own words
        said = [line.split(" - ", 1)[-1] for line in log.read_text(errors="replace").splitlines() if "resum" in line]
        notes += said[:1]
    row["note"] = "; ".join(notes)
    return row


def probe_row(log: Path) -> dict[str, Any]:
    """A probe's `GPUCHECK {json}` line: its findings and figures."""
    from ds_trainer.gpucheck.probes import MARK

    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(MARK)]
    if not lines:
        return {}
    found = json.loads(lines[-1][len(MARK):])
    findings = found.get("findings", {})
    return {"findings": findings, "data": found.get("data", {}),
            "gpu_alloc_gib": _gib(found.get("gpu_mem_peak_allocated_mib")),
            "gpu_reserved_gib": _gib(found.get("gpu_mem_peak_reserved_mib")),
            "note": "; ".join(f"{k} {v}" for k, v in findings.items())}


def build_row(step: Step, build: Build | None, timeout: float) -> dict[str, Any]:
    """A build step's row: the background build of its op, waited for at most `timeout` (left
    running past it: the steps that load the op wait for it in their own time)."""
    op = step.args[0]
    row: dict[str, Any] = {"step": step.name, "group": step.group, "what": step.what,
                           "command": f"-m ds_trainer.tools.ops {BUILDERS[op]} (in the background)",
                           "timeout_s": round(timeout, 1)}
    if build is None:
        return {**row, "status": "skipped", "error": "no step of this call loads it"}
    status = build.wait(time.monotonic() + timeout)
    row.update(elapsed_s=build.seconds(), note=f"{build.said()} ({build.seconds():.0f} s since "
               "the check started it)")
    if status == "ok":
        return {**row, "status": "ok"}
    if status is None:
        return {**row, "status": "timeout", "error": f"still building after {build.seconds():.0f}"
                f" s; the steps that load {op} wait for it"}
    return {**row, "status": status, "error": build.said()}


def run_step(step: Step, out: Path, timeout: float,
             runs: dict[str, Path] | None = None) -> dict[str, Any]:
    """Run the step and return its row."""
    cmd = command(step, out, runs)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{step.name}.log"
    if step.tagged_images:
        write_tagged_images(out / "data" / step.name, step.tagged_images)
    if step.reference_image:
        write_reference(out / "data" / "reference.png")
    row: dict[str, Any] = {"step": step.name, "group": step.group, "what": step.what,
                           "command": " ".join(cmd[1:]), "timeout_s": round(timeout, 1)}
    status, elapsed, rss_mib = execute(cmd, log, timeout)
    row.update(elapsed_s=round(elapsed, 1), host_rss_gib=_gib(rss_mib) if rss_mib else None)
    extra = train_row(step, out / "runs" / step.name) if step.kind == "train" else (
        probe_row(log) if step.kind == "probe" else {})
    row.update({k: v for k, v in extra.items() if v is not None or k not in row})
    if status is None:  # what it was doing: its last line, or its run log's when it printed nothing
        run_log = out / "runs" / step.name / "ds_trainer.log"
        last = last_line(log) or last_line(run_log)
        row["status"] = "timeout"
        row["error"] = f"no result within {timeout:.0f} s; stopped (last output: {last or 'none'})"
    elif status == 0 and extra.get("run_status", "ok") == "ok":
        row["status"] = "ok"
    else:
        row["status"] = "oom" if extra.get("run_status") == "oom" else "failed"
        row["error"] = error_line(log, extra.get("run_summary", {})) or f"exit status {status}"
    if step.kind == "cli" and row["status"] == "ok":
        row["note"] = "; ".join(line.strip() for line in log.read_text(errors="replace").splitlines()
                                if re.match(r"\s+\w+: (ready|not available|FAILED)", line)) or row.get("note", "")
    return row
