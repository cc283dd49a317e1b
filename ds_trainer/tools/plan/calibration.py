"""The planner learns from measurements: records of predicted against measured memory, and the correction.

`python -m ds_trainer.tune` appends one record per measured cell to `plan.calibration` (a JSON-lines
file). The planner reads the records of the same model, device kind and precision and scales its
activation estimate by the least-squares factor `f = sum(m*p) / sum(p*p)` (p: predicted activation
bytes, m: measured), which can only lower the squared error over those cells.

What "measured activation" means depends on where the cell ran:
- GPU (`measure: gpu_allocated`): the training loop's peak allocated bytes minus the planner's model
  states and buffers (those follow DeepSpeed's own accounting and are not corrected).
- CPU (`measure: host_rss_loop`): the host RSS the training loop added over the set-up model (the
  kernel's peak RSS is reset at the loop's start). That covers activations and also the gradients and
  temporaries the steps allocate, so on a CPU only the activation part is calibrated, and with an
  upper bound of it; model states, buffers and GPU fragmentation are not calibrated without a GPU.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 2**20


@dataclass
class Calibration:
    """The activation factor for one model x device kind x precision, from `cells` measured cells."""

    factor: float = 1.0
    cells: int = 0
    error: float | None = None  # median relative error of the calibrated activation estimate
    error_before: float | None = None  # the same, uncalibrated
    device: str = ""

    def describe(self) -> str:
        """One line: the factor and from how many cells, or that there are none."""
        if not self.cells:
            return (f"not calibrated: no measured cells for this model on {self.device} "
                    "(python -m ds_trainer.tune records them)")
        return (f"activations calibrated from {self.cells} measured cell(s) on {self.device}: x{self.factor:.2f}, "
                f"remaining error {100 * (self.error or 0):.0f}% (uncalibrated {100 * (self.error_before or 0):.0f}%)")


def device_kind(info: Any) -> str:
    """`cpu`, or `cuda:<GPU name>`: records from one kind of device only calibrate that kind."""
    return f"{info.kind}:{info.gpu_name}" if info.gpu_name else str(info.kind)


def key(cfg: Any, device: str) -> dict[str, str]:
    """The fields a record must share with `cfg` on `device` to calibrate it."""
    return {"model": str(cfg.model.name), "device": device, "precision": str(cfg.precision.name.value)}


def read(path: str | Path, match: dict[str, str]) -> list[dict[str, Any]]:
    """The records in `path` whose model, device and precision equal `match`."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by an interrupted write
        if all(record.get(k) == v for k, v in match.items()) and record.get("predicted_activation_bytes"):
            out.append(record)
    return out


def append(path: str | Path, record: dict[str, Any]) -> None:
    """Add one record to the JSON-lines file at `path`."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _errors(records: list[dict[str, Any]], factor: float) -> float:
    return statistics.median(abs(factor * r["predicted_activation_bytes"] - r["measured_activation_bytes"])
                             / max(r["measured_activation_bytes"], 1) for r in records)


def fit(records: list[dict[str, Any]], device: str = "") -> Calibration:
    """The least-squares activation factor over `records` (1.0 without any)."""
    usable = [r for r in records if r.get("measured_activation_bytes", 0) > 0]
    if not usable:
        return Calibration(device=device)
    p = [float(r["predicted_activation_bytes"]) for r in usable]
    m = [float(r["measured_activation_bytes"]) for r in usable]
    factor = sum(a * b for a, b in zip(p, m, strict=True)) / sum(a * a for a in p)
    return Calibration(factor, len(usable), _errors(usable, factor), _errors(usable, 1.0), device)


def for_config(cfg: Any, info: Any) -> Calibration:
    """The calibration the planner applies to `cfg` on this machine's device kind."""
    device = device_kind(info)
    return fit(read(str(cfg.plan.calibration), key(cfg, device)), device)


def measured_activation(summary: dict[str, Any], predicted: Any) -> tuple[int | None, str]:
    """(bytes, measure) a cell's summary shows for the activation part; None when it shows nothing usable."""
    if summary.get("gpu_mem_peak_allocated_mib"):
        states = predicted.gpu - predicted.activations
        return int(summary["gpu_mem_peak_allocated_mib"] * MIB) - states, "gpu_allocated"
    start, peak = summary.get("host_rss_loop_start_mib"), summary.get("host_rss_loop_peak_mib")
    if start is None or peak is None:
        return None, "none"
    return int((peak - start) * MIB), "host_rss_loop"
