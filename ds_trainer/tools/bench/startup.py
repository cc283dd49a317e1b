"""`python -m ds_trainer.bench --startup-pairs N`: how long a user waits for the first step, and how fast the
steps then go, under each backend, against the raw loop of the same model, batch and optimizer.

For each `--zeros` option a run (`python -m ds_trainer`) and the raw loop (`--raw`, a minimal loop that loads
nothing but the model: no Hydra, no data, no frozen encoders, no checkpoint) alternate N times; each pair is
measured back to back, so a noisy machine's drift cancels in the ratio. Both times to the first step are taken
from outside, from the moment the process is started, imports included. Results: `<out>/startup.csv` (every
pair) and `<out>/startup.md` (medians and median ratios per option).

With `--peer-script <train_text_to_image_sdxl.py>` diffusers' example script runs third in each pair, on the same
pretrained folder and images as the run, which then trains from them too (peer.py); startup.md gets a
second table, run / script, and the commands.
"""

from __future__ import annotations

import argparse
import csv
import shlex
import statistics
from pathlib import Path
from typing import Any

from ds_trainer.tools.bench.cells import Cell, cell_command, run_cell, run_raw
from ds_trainer.tools.bench.peer import Peer, prepare

FIELDS = ("zero", "pair", "first_step_s", "raw_first_step_s", "s_per_it", "raw_s_per_it", "status")
PEER_FIELDS = ("peer_first_step_s", "peer_s_per_it", "peer_status", "peer_backend")


def _cell(zero: str, args: argparse.Namespace) -> Cell:
    return Cell(zero, "none", args.resolutions[0], args.batches[-1], False)


def _folder(out: Path, zero: str, k: int) -> Path:
    return out / "startup_cells" / f"{zero}-{k}"


def pairs(zero: str, args: argparse.Namespace, out: Path, peer: Peer | None = None) -> list[dict[str, Any]]:
    """N alternating (run, raw loop) pairs of one zero option; (run, raw loop, script) with `peer`."""
    cell = _cell(zero, args)
    rows = []
    for k in range(args.startup_pairs):
        folder = _folder(out, zero, k)
        row = run_cell(cell, args, out, folder, peer.overrides(folder) if peer else None)
        raw = run_raw(cell, args, out, folder) if row["status"] == "ok" else None
        rows.append({"zero": zero, "pair": k, "first_step_s": row.get("first_step_s"),
                     "raw_first_step_s": round(raw[0], 3) if raw else None, "s_per_it": row.get("median_s_per_it"),
                     "raw_s_per_it": round(raw[1], 4) if raw else None,
                     "status": row["status"] if raw or row["status"] != "ok" else "raw loop failed"})
        if peer:
            rows[-1].update(peer.measure(folder, args.cell_timeout_s))
        shown = (f", script {rows[-1]['peer_first_step_s']} s, {rows[-1]['peer_s_per_it']} s/it "
                 f"({rows[-1]['peer_status']})" if peer else "")
        print(f"{zero} pair {k}: first step {rows[-1]['first_step_s']} s (raw {rows[-1]['raw_first_step_s']} s), "
              f"{rows[-1]['s_per_it']} s/it (raw {rows[-1]['raw_s_per_it']}){shown}", flush=True)
    return rows


def _median_ratio(rows: list[dict[str, Any]], ours: str, raw: str) -> float | None:
    ratios = [float(r[ours]) / float(r[raw]) for r in rows if r.get(ours) and r.get(raw)]
    return statistics.median(ratios) if ratios else None


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if r.get(key)]
    return statistics.median(values) if values else None


def _finished(row: dict[str, Any], other: str) -> bool:
    """Whether the run and `other` (`raw` or `peer`) both finished in this pair."""
    if other == "raw":
        return row["status"] == "ok"
    return row["status"] in ("ok", "raw loop failed") and row.get("peer_status") == "ok"


def _lines(rows: list[dict[str, Any]], other: str) -> list[str]:
    """One table line per zero option: the run against `other` (`raw` or `peer`) over the pairs both finished."""
    lines = []
    for zero in dict.fromkeys(r["zero"] for r in rows):
        mine = [r for r in rows if r["zero"] == zero and _finished(r, other)]
        cells = [_median(mine, "first_step_s"), _median(mine, f"{other}_first_step_s"),
                 _median_ratio(mine, "first_step_s", f"{other}_first_step_s"), _median(mine, "s_per_it"),
                 _median(mine, f"{other}_s_per_it"), _median_ratio(mine, "s_per_it", f"{other}_s_per_it")]
        shown = ["" if v is None else f"{v:.3f}" if i in (2, 5) else f"{v:.2f}" if i < 2 else f"{v:.4f}"
                 for i, v in enumerate(cells)]
        ran = [] if other == "raw" else [next((str(r.get("peer_backend")) for r in rows if r["zero"] == zero), "")]
        lines.append(f"| {zero} | {len(mine)} | " + " | ".join(shown + ran) + " |")
    return lines


def _failures(rows: list[dict[str, Any]]) -> list[str]:
    """The script's runs that did not finish, one line each (it has no first step there to compare)."""
    return [f"- {r['zero']} pair {r['pair']}, script under {r.get('peer_backend')}: {r['peer_status']}" for r in rows
            if r.get("peer_status") not in (None, "ok")]


def table(rows: list[dict[str, Any]], command: str, peer_commands: list[str] | None = None) -> str:
    """startup.md: one line per zero option; with the script, a second table against it and the commands."""
    lines = ["# Time to the first step and s/it against the raw loop", "", f"Command: `{command}`", "",
             "Medians over the alternating pairs; a ratio is the median of the pairs' ratios (run / raw loop).", "",
             "| zero | pairs | first step (s) | raw loop (s) | ratio | s/it | raw s/it | ratio |",
             "|---|---|---|---|---|---|---|---|", *_lines(rows, "raw")]
    if peer_commands:
        lines += ["", "## Against diffusers' train_text_to_image_sdxl.py", "",
                  "The same pretrained folder, images, batch, resolution, steps and AdamW; each side with a cold data "
                  "cache of its own, the script under the run's backend where Accelerate can give it that backend. A "
                  "ratio is the median of the pairs' ratios (run / script), over the pairs where both finished.", "",
                  "| zero | pairs | first step (s) | script (s) | ratio | s/it | script s/it | ratio | script ran as |",
                  "|---|---|---|---|---|---|---|---|---|", *_lines(rows, "peer"), "",
                  *([*_failures(rows), ""] if _failures(rows) else []),
                  "The run and the script of the first pair (the other pairs differ by their folders):", "",
                  *[f"    {c}" for c in peer_commands]]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """`--startup-pairs N`: the pairs of each --zeros option; startup.csv and startup.md."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    peer = prepare(args, out) if args.peer_script else None
    rows = [row for zero in args.zeros for row in pairs(zero, args, out, peer)]
    with (out / "startup.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS + (PEER_FIELDS if peer else ()))
        writer.writeheader()
        writer.writerows(rows)
    commands = None
    if peer and (first := _folder(out, args.zeros[0], 0)).joinpath("config.yaml").exists():
        commands = [shlex.join(cell_command(_cell(args.zeros[0], args), args, first, peer.overrides(first))),
                    shlex.join(peer.command(first))]
    (out / "startup.md").write_text(table(rows, " ".join(["python -m ds_trainer.bench", *args.argv]), commands))
    print(f"results: {out / 'startup.md'}")
    return 0 if all(r["status"] == "ok" and r.get("peer_status", "ok") == "ok" for r in rows) else 1
