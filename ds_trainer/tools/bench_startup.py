"""`python -m ds_trainer.bench --startup-pairs N`: how long a user waits for the first step, and how fast the
steps then go, under each backend, against the raw loop of the same model, batch and optimizer.

For each `--zeros` option a run (`python -m ds_trainer`) and the raw loop (`--raw`, a minimal loop that loads
nothing but the model: no Hydra, no data, no frozen encoders, no checkpoint) alternate N times; each pair is
measured back to back, so a noisy machine's drift cancels in the ratio. Both times to the first step are taken
from outside, from the moment the process is started, imports included. Results: `<out>/startup.csv` (every
pair) and `<out>/startup.md` (medians and median ratios per option).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path
from typing import Any

from ds_trainer.tools.bench_cells import Cell, run_cell, run_raw

FIELDS = ("zero", "pair", "first_step_s", "raw_first_step_s", "s_per_it", "raw_s_per_it", "status")


def pairs(zero: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """N alternating (run, raw loop) pairs of one zero option."""
    cell = Cell(zero, "none", args.resolutions[0], args.batches[-1], False)
    rows = []
    for k in range(args.startup_pairs):
        folder = out / "startup_cells" / f"{zero}-{k}"
        row = run_cell(cell, args, out, folder)
        raw = run_raw(cell, args, out, folder) if row["status"] == "ok" else None
        rows.append({"zero": zero, "pair": k, "first_step_s": row.get("first_step_s"),
                     "raw_first_step_s": round(raw[0], 3) if raw else None, "s_per_it": row.get("median_s_per_it"),
                     "raw_s_per_it": round(raw[1], 4) if raw else None,
                     "status": row["status"] if raw or row["status"] != "ok" else "raw loop failed"})
        print(f"{zero} pair {k}: first step {rows[-1]['first_step_s']} s (raw {rows[-1]['raw_first_step_s']} s), "
              f"{rows[-1]['s_per_it']} s/it (raw {rows[-1]['raw_s_per_it']})", flush=True)
    return rows


def _median_ratio(rows: list[dict[str, Any]], ours: str, raw: str) -> float | None:
    ratios = [float(r[ours]) / float(r[raw]) for r in rows if r.get(ours) and r.get(raw)]
    return statistics.median(ratios) if ratios else None


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key)]
    return statistics.median(values) if values else None


def table(rows: list[dict[str, Any]], command: str) -> str:
    """startup.md: one line per zero option."""
    lines = ["# Time to the first step and s/it against the raw loop", "", f"Command: `{command}`", "",
             "Medians over the alternating pairs; a ratio is the median of the pairs' ratios (run / raw loop).", "",
             "| zero | pairs | first step (s) | raw loop (s) | ratio | s/it | raw s/it | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for zero in dict.fromkeys(r["zero"] for r in rows):
        mine = [r for r in rows if r["zero"] == zero and r["status"] == "ok"]
        cells = [_median(mine, "first_step_s"), _median(mine, "raw_first_step_s"),
                 _median_ratio(mine, "first_step_s", "raw_first_step_s"), _median(mine, "s_per_it"),
                 _median(mine, "raw_s_per_it"), _median_ratio(mine, "s_per_it", "raw_s_per_it")]
        shown = ["" if v is None else f"{v:.3f}" if i in (2, 5) else f"{v:.2f}" if i < 2 else f"{v:.4f}"
                 for i, v in enumerate(cells)]
        lines.append(f"| {zero} | {len(mine)} | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for zero in args.zeros for row in pairs(zero, args, out)]
    with (out / "startup.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "startup.md").write_text(table(rows, " ".join(["python -m ds_trainer.bench", *args.argv])))
    print(f"results: {out / 'startup.md'}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1
