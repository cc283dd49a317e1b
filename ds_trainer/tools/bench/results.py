"""The cell matrix's results: `results.csv` appended as cells finish, and `results.md` with the benchmark issue's
targets as measured and every cell."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import Any

from ds_trainer.tools.bench.cells import Cell

FIELDS = ("cell", "zero", "offload", "resolution", "micro_batch", "grad_ckpt", "accum", "status",
          "gpu_alloc_peak_gib", "gpu_reserved_peak_gib", "host_rss_peak_gib", "first_step_s", "median_s_per_it",
          "images_per_s",
          "s_per_image", "tflop_per_image", "mfu", "raw_median_s_per_it", "overhead", "overhead_pairs", "peak_tflops",
          "message")


def read(path: Path) -> list[dict[str, Any]]:
    """The rows of results.csv so far (none before the first cell)."""
    return list(csv.DictReader(path.open())) if path.exists() else []


def append(path: Path, row: dict[str, Any]) -> None:
    """Add one cell's row to results.csv, writing the header first when the file is new."""
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def _num(row: dict[str, Any] | None, key: str) -> float | None:
    value = (row or {}).get(key)
    return float(value) if value not in (None, "") else None


def targets(rows: list[dict[str, Any]], res: int, small: int, big: int) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each target of the benchmark issue."""
    by = {r["cell"]: r for r in rows}

    def cell(*key: Any) -> dict[str, Any] | None:
        return by.get(Cell(*key).name)

    def verdict(value: float | None, limit: float, at_most: bool = True) -> str:
        if value is None:
            return "not measured"
        return "met" if (value <= limit if at_most else value >= limit) else "missed"

    def memory(row: dict[str, Any] | None, value: float | None) -> str:
        if value is not None:
            return f"{value} GiB"
        if row is None:
            return "not run"
        return "no GPU figures (not a CUDA run)" if row.get("status") == "ok" else str(row.get("status"))

    out = []
    for zero, limit in (("stage2", 7.0), ("stage3", 4.0)):
        row = cell(zero, "cpu", res, small, True)
        value = _num(row, "gpu_alloc_peak_gib")
        out.append((f"{res}px, batch {small}, grad ckpt, {zero} + offload=cpu: peak allocated <= {limit} GiB",
                    memory(row, value), verdict(value, limit)))
    row = cell("stage2", "cpu", res, big, True)
    value = _num(row, "gpu_reserved_peak_gib")
    out.append((f"{res}px, batch {big}, stage2 + offload=cpu: peak reserved <= 12 GiB (SimpleTuner: 12.8 GiB, RTX "
                "4090)", memory(row, value), verdict(value, 12.0)))
    best = max((_num(r, "mfu") or 0.0 for r in rows if r.get("offload") == "none" and r.get("accum") in ("1", 1)
                and r.get("resolution") == f"{res}x{res}" and str(r.get("micro_batch")) == str(big)), default=None)
    out.append((f"no offload, batch {big}, {res}px: MFU >= 40%", f"{best:.1%}" if best else "not measured",
                verdict(best or None, 0.40, at_most=False)))
    row = cell("stage2", "none", res, big, False)
    overhead = _num(row, "overhead")
    pairs = len(str(row.get("overhead_pairs") or "").split()) if row else 0
    shown = f"{overhead:.3f}" + (f" (median of {pairs} alternating pairs)" if pairs > 1 else "") if overhead else None
    out.append(("framework s/it over the raw DeepSpeed loop <= 1.02", shown or "not measured", verdict(overhead, 1.02)))
    none, cpu = cell("stage2", "none", res, big, False, 16), cell("stage2", "cpu", res, big, False, 16)
    a, b = _num(none, "s_per_image"), _num(cpu, "s_per_image")
    ratio = b / a if a and b else None
    out.append(("gradient accumulation 16: offload=cpu time per image <= 1.5x no offload",
                f"{ratio:.2f}x" if ratio else "not measured", verdict(ratio, 1.5)))
    return out


def write_markdown(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    """results.md: the command, the measured matrix-multiply rate, the targets, every cell, and the failures."""
    command = " ".join(["python -m ds_trainer.bench", *args.argv])
    lines = [f"# SDXL UNet benchmark ({args.model})", "", f"Command: `{command}`", "",
             f"Dense matrix-multiply rate measured for MFU: {args.peak:.1f} TFLOP/s", "",
             "## Targets", "", "| target | measured | |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in targets(rows, args.resolutions[0], args.batches[0],
                                                              args.batches[-1])]
    lines += ["", "## Cells", "", "| " + " | ".join(FIELDS[:-1]) + " |", "|" + "---|" * (len(FIELDS) - 1)]
    lines += ["| " + " | ".join(str(r.get(k, "") or "") for k in FIELDS[:-1]) + " |" for r in rows]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["", "## Cells that did not finish", ""] + [f"- {r['cell']}: {r['status']}: {r.get('message')}"
                                                             for r in failed]
    path = out / "results.md"
    path.write_text("\n".join(lines) + "\n")
    return path
