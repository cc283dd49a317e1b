"""The cell matrix (`python -m ds_trainer.bench` without --precisions or --startup-pairs): each cell a real run,
the overhead cell paired with the raw loop, the peak matrix-multiply rate measured for MFU."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ds_trainer.tools.bench.cells import Cell, run_cell, run_raw
from ds_trainer.tools.bench.results import append, read, write_markdown

COMBOS = (("ddp", "none"), ("stage2", "none"), ("stage2", "cpu"), ("stage3", "none"), ("stage3", "cpu"),
          ("stage3", "nvme"), ("fsdp_shard_grad_op", "none"), ("fsdp_full_shard", "none"), ("fsdp_full_shard", "cpu"))


def target_cells(res: int, small: int, big: int) -> list[Cell]:
    """The cells the targets are measured on, in the order they are run (each once: with one batch size
    the first and third are the same cell)."""
    cells = [Cell("stage2", "cpu", res, small, True), Cell("stage3", "cpu", res, small, True),
             Cell("stage2", "cpu", res, big, True), Cell("stage2", "none", res, big, False),
             Cell("ddp", "none", res, big, False), Cell("stage2", "none", res, big, False, 16),
             Cell("stage2", "cpu", res, big, False, 16)]
    return list(dict.fromkeys(cells))


def all_cells(resolutions: list[int], batches: list[int]) -> list[Cell]:
    """The target cells first, then every other cell of the matrix."""
    targets = target_cells(resolutions[0], batches[0], batches[-1])
    full = [Cell(z, o, r, b, gc) for r in resolutions for b in batches for z, o in COMBOS for gc in (True, False)]
    return targets + [c for c in full if c not in targets]


def peak_tflops() -> float:
    """Dense matrix-multiply rate of this device in TFLOP/s, measured in a process of its own: the bench's parent
    stays alive while its cells run, and a CUDA context and cached blocks of its own would take 0.5-1 GB from
    every cell (moving where cells run out of memory)."""
    code = "from ds_trainer.tools.bench.matrix import measure_peak_tflops; print(measure_peak_tflops())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def measure_peak_tflops() -> float:
    """Dense matrix-multiply rate of this device in TFLOP/s: bf16 8192^3 on a GPU (fp32 512^3 on a CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    device = "cuda" if cuda else "cpu"
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(4):
        iters = 50 if cuda else 5
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            a @ b
        if cuda:
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def overhead_of(cell: Cell, row: dict[str, Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The framework's s/it over the raw loop's: the median ratio of `--overhead-pairs` back-to-back pairs."""
    pairs: list[tuple[float, float]] = []
    for k in range(args.overhead_pairs):
        folder = out / "cells" / cell.name if k == 0 else out / "overhead_pairs" / f"{k}"
        framework = row["median_s_per_it"] if k == 0 else run_cell(cell, args, out, folder)["median_s_per_it"]
        raw = run_raw(cell, args, out, folder) if framework else None
        if framework and raw:
            pairs.append((float(framework), raw[1]))
    if not pairs:
        return {}
    return {"raw_median_s_per_it": round(statistics.median(r for _, r in pairs), 4),
            "overhead": round(statistics.median(f / r for f, r in pairs), 4),
            "overhead_pairs": " ".join(f"{f:.4f}/{r:.4f}" for f, r in pairs)}


def run(args: argparse.Namespace) -> int:
    """Run the cells not yet in `<out>/results.csv` (within `--budget-min`), then write the report and results.md."""
    start = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.csv"
    done = {r["cell"] for r in read(results)}
    todo = [c for c in (target_cells(args.resolutions[0], args.batches[0], args.batches[-1]) if args.cells == "targets"
                        else all_cells(args.resolutions, args.batches)) if c.name not in done]
    args.peak = peak_tflops()
    print(f"matrix multiply rate: {args.peak:.1f} TFLOP/s; {len(todo)} cell(s) to run", flush=True)
    overhead_cell = Cell("stage2", "none", args.resolutions[0], args.batches[-1], False)
    for i, cell in enumerate(todo):
        if args.budget_min is not None and time.time() - start > args.budget_min * 60:
            print(f"budget of {args.budget_min} min spent: {len(todo) - i} cell(s) left; run again to continue")
            break
        row = run_cell(cell, args, out)
        if cell == overhead_cell and row["status"] == "ok":
            row.update(overhead_of(cell, row, args, out))
        append(results, row)
        print(f"{cell.name}: {row['status']} {row.get('gpu_alloc_peak_gib')} GiB alloc, "
              f"{row.get('median_s_per_it')} s/it, MFU {row.get('mfu')}", flush=True)
    rows = read(results)
    from ds_trainer.launch import report

    if (out / "cells").is_dir():
        report.write(out / "cells", use_wandb=False)
    print(f"results: {write_markdown(out, rows, args)}")
    return 0
