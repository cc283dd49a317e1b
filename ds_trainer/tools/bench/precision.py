"""`python -m ds_trainer.bench --precisions bf16 bf16_pure`: what a precision costs in quality, measured as the
training loss of the same run under each precision (same seed, data, timesteps and noise: the curves differ by
the precision alone).

For each `--lrs` learning rate, one run per precision (`python -m ds_trainer`, `--zeros`' first option, the
model's own architecture at random init, `--samples` synthetic images seen in the same order). The table gives the
mean loss over each tenth of the run, and the precision's mean paired difference from the first precision's (the
same steps' losses, so the timestep noise cancels). Results: `<out>/precision.csv` (every step's loss of every run)
and `<out>/precision.md`.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

WINDOWS = 10


def run(precision: str, lr: float, args: argparse.Namespace, out: Path) -> list[float]:
    """Train one run; its per-step losses (empty if it failed: the error is printed)."""
    folder = out / "runs" / f"{precision}-lr{lr:g}"
    cmd = [sys.executable, "-m", "ds_trainer", f"model={args.model}", f"zero={args.zeros[0]}", f"precision={precision}",
           f"optimizer.lr={lr}", f"resolution.width={args.resolutions[0]}", f"resolution.height={args.resolutions[0]}",
           f"train.micro_batch_size={args.batches[0]}", f"train.max_steps={args.steps}",
           f"data.num_samples={args.samples}", "scheduler=constant", "logger=none", "train.export=false",
           "train.final_checkpoint=false", "train.checkpoint_every=0", "train.checkpoint_every_minutes=0",
           "train.log_every=1", f"hydra.run.dir={folder}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s * 20)
    rows = folder / "metrics.jsonl"
    losses = [float(json.loads(line)["loss"]) for line in rows.read_text().splitlines()] if rows.exists() else []
    if proc.returncode or len(losses) != args.steps:
        print(f"{precision} lr {lr:g}: failed: {proc.stderr.strip().splitlines()[-1:] or '?'}", flush=True)
        return []
    return losses


def windows(losses: list[float]) -> list[float]:
    """The mean loss of each tenth of the run (fewer when the run is shorter)."""
    n = min(WINDOWS, len(losses))
    size = len(losses) / n
    return [statistics.fmean(losses[round(i * size):round((i + 1) * size)]) for i in range(n)]


def table(curves: dict[tuple[float, str], list[float]], precisions: list[str], command: str) -> str:
    """precision.md: the mean loss over each tenth of each run, and each precision against the first."""
    lines = ["# Training loss by precision, the same run otherwise", "", f"Command: `{command}`", "",
             "Mean loss over each tenth of the run; `vs` is the mean paired difference from the first precision's "
             "losses at the same steps (the same timesteps and noise), relative to its mean.", ""]
    for lr in dict.fromkeys(lr for lr, _ in curves):
        first = curves.get((lr, precisions[0]))
        done = [p for p in precisions if curves.get((lr, p))]
        n = len(windows(curves[lr, done[0]])) if done else 0
        lines += [f"## lr {lr:g}", "", "| precision | " + " | ".join(f"tenth {i + 1}" for i in range(n)) +
                  " | last tenth vs first precision |", "|---|" + "---|" * (n + 1)]
        for p in precisions:
            losses = curves.get((lr, p))
            if not losses:
                lines.append(f"| {p} | failed |")
                continue
            vs = ""
            if first and p != precisions[0]:
                tail = len(losses) - max(1, len(losses) // WINDOWS)
                pairs = [a - b for a, b in zip(losses[tail:], first[tail:], strict=True)]
                vs = f"{statistics.fmean(pairs) / statistics.fmean(first[tail:]):+.2%}"
            lines.append(f"| {p} | " + " | ".join(f"{w:.4f}" for w in windows(losses)) + f" | {vs} |")
        lines.append("")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`--precisions`: one run per precision at each learning rate; precision.csv and precision.md."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[tuple[float, str], list[float]] = {}
    for lr in args.lrs:
        for precision in args.precisions:
            curves[lr, precision] = run(precision, lr, args, out)
            if curves[lr, precision]:
                print(f"{precision} lr {lr:g}: loss {' '.join(f'{w:.4f}' for w in windows(curves[lr, precision]))}",
                      flush=True)
    with (out / "precision.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["lr", "precision", "step", "loss"])
        for (lr, precision), losses in curves.items():
            writer.writerows([lr, precision, step, loss] for step, loss in enumerate(losses, start=1))
    command = " ".join(["python -m ds_trainer.bench", *args.argv])
    (out / "precision.md").write_text(table(curves, list(args.precisions), command) + "\n")
    print(f"results: {out / 'precision.md'}")
    return 0 if all(curves.values()) else 1
