"""The quality tune against the full grid, on this machine (issue #67).

    .venv/bin/python benchmarks/cpu-tiny-quality-tune/compare.py --model sdxl_tiny
    .venv/bin/python benchmarks/cpu-tiny-quality-tune/compare.py --model flux_tiny

For one model: the full grid (every learning rate x LoRA rank of GRID, each trained to its end: tune.sampler=grid
tune.pruner=none), then the search over the same ranges (the learning rate on a log scale between the grid's ends,
the rank a choice; TPE and successive halving) with a budget of a third of the grid's steps. Both through
`python -m ds_trainer.tune tune.objective=quality`; their reports (quality.md, quality.png, quality.csv) are copied
here under <model>-grid/ and <model>-search/, and <model>.md says the figures: the steps each spent, the best cell of
the grid and the search's chosen trial, with the chosen trial trained again from scratch.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINING = ["resolution.width=32", "resolution.height=32", "logger=none", "data.num_samples=32", "validation=on",
            "validation.split=8", "adapter=lora", "adapter.alpha=16", "scheduler=constant"]
# LoRA on the attention and feed-forward layers each model has
TARGETS = {"sdxl_tiny": "[to_q,to_k,to_v,to_out.0,proj_in,proj_out,ff.net.0.proj,ff.net.2]",
           "flux_tiny": "[to_q,to_k,to_v,to_out.0,proj_out,proj_mlp,ff.net.0.proj,ff.net.2]"}


def tune(training: list[str], name: str, work: Path, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "ds_trainer.tune", *training, "tune.objective=quality",
           f"tune.name={name}", f"paths.outputs={work}", *extra]
    run = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    (work / f"{name}.log").write_text(run.stderr)
    if run.returncode != 0:
        raise SystemExit(f"{name} failed:\n{run.stderr[-3000:]}")
    return work / "tune" / name


def rows(tune_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((tune_dir / "quality.csv").open()))


def device_h(table: list[dict[str, str]]) -> float:
    return sum(float(r["device_h"] or 0) for r in table)


def keep(tune_dir: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for name in ("quality.md", "quality.png", "quality.csv"):
        shutil.copyfile(tune_dir / name, into / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sdxl_tiny")
    parser.add_argument("--work", type=Path, default=Path("/tmp/quality-tune-bench"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--lrs", nargs="+", default=["1e-4", "1e-3", "1e-2", "1e-1"])
    parser.add_argument("--ranks", nargs="+", default=["1", "4", "16"])
    parser.add_argument("--steps", type=int, default=54, help="a trial's steps; rungs at 1/9, 1/3 and all of them")
    args = parser.parse_args()
    lrs, ranks, steps = args.lrs, args.ranks, args.steps
    training = [f"model={args.model}", *TRAINING, f"adapter.targets={TARGETS[args.model]}",
                f"train.max_steps={steps}", f"validation.every={steps // 9}"]
    work = args.work / args.model
    work.mkdir(parents=True, exist_ok=True)
    grid_dir = tune(training, "grid", work, "tune.sampler=grid", "tune.pruner=none", "tune.rerun=false",
                            f"optimizer.lr={','.join(lrs)}", f"adapter.rank={','.join(ranks)}")
    grid = [r for r in rows(grid_dir) if r["state"] == "complete"]
    grid_steps = sum(int(r["steps"]) for r in grid)  # the cells' (a cell cut short by a restart ran again)
    best = min(grid, key=lambda r: float(r["val_loss"]))
    # a trial started before the budget is spent runs on: a third of the grid less one trial's steps
    budget = grid_steps // 3 - steps
    search_dir = tune(training, "search", work, f"tune.budget={budget}steps",
                                f"tune.workers={args.workers}", f"optimizer.lr=tag(log,interval({lrs[0]},{lrs[-1]}))",
                                f"adapter.rank={','.join(ranks)}")
    search = rows(search_dir)
    search_steps = sum(int(r["steps"] or 0) for r in search)
    chosen = min((r for r in search if r["state"] == "complete"), key=lambda r: float(r["val_loss"]))
    keep(grid_dir, HERE / f"{args.model}-grid")
    keep(search_dir, HERE / f"{args.model}-search")
    rerun = [line for line in (search_dir / "quality.md").read_text().splitlines() if "from scratch |" in line]
    lines = [f"# {args.model}: the quality tune against the full grid", "",
             "| | cells / trials | steps | device-hours | best validation loss | its settings |",
             "|---|---|---|---|---|---|",
             f"| full grid | {len(grid)} | {grid_steps} | {device_h(grid):.3f} | "
             f"{float(best['val_loss']):.6f} | "
             f"lr {best['optimizer.lr']}, rank {best['adapter.rank']} |",
             f"| search (budget {budget} steps) | {len(search)} ({sum(r['state'] == 'pruned' for r in search)}"
             f" pruned) | {search_steps} | {device_h(search):.3f} | {float(chosen['val_loss']):.6f} | "
             f"lr {float(chosen['optimizer.lr']):.4g}, rank {chosen['adapter.rank']} |", "",
             f"The search spent {search_steps / grid_steps:.0%} of the grid's steps; its chosen trial's loss is "
             f"{(float(chosen['val_loss']) - float(best['val_loss'])) / float(best['val_loss']):+.2%} from the "
             "grid's best.", "", *(f"Rerun: {line}" for line in rerun), ""]
    (HERE / f"{args.model}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
