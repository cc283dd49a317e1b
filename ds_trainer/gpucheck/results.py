"""The check's outputs, rewritten after every step: results.json (every row, whole), results.md
(the table to read), and plan_calibration.jsonl (the real-size cells in the form
`python -m ds_trainer.tune` appends, so the planner learns from them: copy its lines into a run's
`plan.calibration` file). With a mirror (the device tool's $OUT) the three and logs.tgz are copied
there after every step too, so a call killed at any moment brings back what it measured (review
3's K2).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

from ds_trainer.gpucheck.steps import Step

GIB = 2**30
COLUMNS = (("step", "step"), ("call", "call"), ("status", "status"), ("s_per_it", "s/it"),
           ("gpu_alloc_gib", "GPU alloc GiB"), ("gpu_reserved_gib", "GPU reserved GiB"),
           ("host_rss_gib", "host RSS GiB"), ("plan_gib", "plan GiB"),
           ("measured_over_planned", "alloc/plan"), ("mfu", "MFU"), ("elapsed_s", "s"),
           ("timeout_s", "timeout s"))


def _atomic(path: Path, text: str) -> None:
    """Written whole or not at all: a check killed mid-write keeps the previous version."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(header: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """results.md: the machine, the table, each step's error or note, and what each step ran."""
    machine = header.get("machine") or {}
    lines = [f"# ds_trainer GPU check ({'CPU form' if header['cpu'] else 'GPU'})", "",
             f"Command: `{header['command']}`", "",
             f"Started {header['started']}; {header['elapsed_s']:.0f} s of a {header['budget_s']:.0f} s budget; "
             f"{header['done']} of {header['total']} steps run; sequence timeouts sum to {header['timeouts_sum_s']} s.",
             ""]
    if machine:
        lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "tflop_per_image"), ""]
    lines += ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        values = [row.get(key) for key, _ in COLUMNS]
        if row.get("mfu") is not None:
            values[COLUMNS.index(("mfu", "MFU"))] = f"{100 * row['mfu']:.1f}%"
        lines.append("| " + " | ".join(_cell(v) for v in values) + " |")
    lines += ["", "## Errors and notes", ""]
    for row in rows:
        said = [f"**{row['error']}**" if row.get("error") else "", _cell(row.get("note"))]
        lines.append(f"- {row['step']} ({row['status']}): " + " ".join(s for s in said if s))
    lines += ["", "## What each step ran", ""]
    lines += [f"- {row['step']} ({row['group']}): {row['what']}. `{row.get('command', '')}`" for row in rows]
    return "\n".join(lines) + "\n"


def mfu(row: dict[str, Any], step: Step, machine: dict[str, Any]) -> float | None:
    """Model FLOPs per image (the bench's count) x images/s over the measured matrix rate; SDXL's UNet only."""
    res = step.overrides.get("resolution", "px128").removeprefix("px")
    flops = (machine.get("tflop_per_image") or {}).get(f"{step.overrides.get('model', 'sdxl_tiny')}@{res}")
    if not (flops and row.get("images_per_s") and machine.get("peak_tflops")):
        return None
    return round(flops * float(row["images_per_s"]) / float(machine["peak_tflops"]), 4)


def calibration_record(row: dict[str, Any], step: Step,
                       machine: dict[str, Any]) -> dict[str, Any] | None:
    """The tuner's calibration record of a measured real-size cell (tools/calibration.py reads these fields): on a
    GPU the peak allocated bytes less the planner's model states, on a CPU the host RSS the loop added."""
    plan, summary = row.get("plan"), row.get("run_summary") or {}
    if row.get("status") != "ok" or not plan or not plan.get("activations"):
        return None
    if summary.get("gpu_mem_peak_allocated_mib"):
        measured = int(summary["gpu_mem_peak_allocated_mib"] * 2**20 - (plan["gpu"] - plan["activations"]) * GIB)
        measure = "gpu_allocated"
    elif summary.get("host_rss_loop_peak_mib") is not None and summary.get("host_rss_loop_start_mib") is not None:
        measured = int((summary["host_rss_loop_peak_mib"] - summary["host_rss_loop_start_mib"]) * 2**20)
        measure = "host_rss_loop"
    else:
        return None
    o = step.overrides
    device = "cpu"
    if measure == "gpu_allocated":  # a GPU's figure is never labelled cpu (review 3's K5)
        if not machine.get("gpu_name"):
            return None  # no name to file it under: the machine step said none
        device = f"cuda:{machine['gpu_name']}"
    res = o.get("resolution", "px128").removeprefix("px")
    return {"model": o.get("model", "sdxl_tiny"), "device": device, "precision": o.get("precision", "bf16"),
            "cell": f"gpucheck-{step.name}", "resolution": f"{res}x{res}",
            "micro_batch_size": int(o.get("train.micro_batch_size", 1)),
            "gradient_checkpointing": o.get("train.gradient_checkpointing") == "true",
            "zero": o.get("zero", "stage2"), "offload": o.get("offload", "none"),
            "optimizer": o.get("optimizer", "adamw"), "adapter": o.get("adapter", "none"), "measure": measure,
            "predicted_activation_bytes": int(plan["activations"] * GIB), "measured_activation_bytes": measured,
            "predicted_peak_bytes": int(plan["gpu"] * GIB), "time": time.time(), "source": "gpucheck"}


def write(out: Path, header: dict[str, Any], rows: list[dict[str, Any]],
          records: list[dict[str, Any]]) -> None:
    """Rewrite results.json, results.md and plan_calibration.jsonl."""
    _atomic(out / "results.json", json.dumps({**header, "steps": rows}, indent=2, default=str) + "\n")
    _atomic(out / "results.md", markdown(header, rows))
    _atomic(out / "plan_calibration.jsonl", "".join(json.dumps(r) + "\n" for r in records))


RESULTS = ("results.json", "results.md", "plan_calibration.jsonl")
LOG_TAIL = 256 * 1024  # the last bytes kept of each log in logs.tgz: far under 16 MiB in all


def _logs(out: Path) -> list[Path]:
    """Every step's output and each run's log, summary and metrics."""
    names = ("ds_trainer.log", "summary.json", "metrics.jsonl")
    runs = sorted(p for n in names for p in out.glob(f"runs/*/{n}"))
    return sorted(out.glob("logs/*.log")) + runs


def logs_tarball(out: Path, path: Path) -> None:
    """logs.tgz: the logs under `out`, each cut to its last LOG_TAIL bytes, written whole or not at
    all."""
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for file in _logs(out):
            data = file.read_bytes()[-LOG_TAIL:]
            info = tarfile.TarInfo(str(file.relative_to(out)))
            info.size, info.mtime = len(data), int(file.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def mirror(out: Path, to: Path) -> None:
    """Copy the results and a fresh logs.tgz into `to`: four flat files."""
    to.mkdir(parents=True, exist_ok=True)
    for name in RESULTS:
        if (out / name).exists():
            shutil.copyfile(out / name, to / f"{name}.tmp")
            os.replace(to / f"{name}.tmp", to / name)
    logs_tarball(out, to / "logs.tgz")
