"""GPU benchmark: the full-size SDXL UNet per ZeRO stage, offload, resolution, micro batch and gradient
checkpointing; peak memory, speed, MFU, and our overhead over a hand-written DeepSpeed loop.

    python -m ds_trainer.bench --out benchmarks/h200                 # the target cells, then the rest
    python -m ds_trainer.bench --out benchmarks/h200 --cells targets --budget-min 9

Every cell is a real `python -m ds_trainer` run in a process of its own (model=sdxl_base: the real
architecture, random init, synthetic data, no logger). Its summary gives peak GPU memory allocated and
reserved (training steps only), median s/it and images/s after two warm-up steps, and the host RSS peak;
out of memory is a result (`oom`). MFU is the UNet's model FLOPs per image (forward and backward,
counted by torch's FlopCounterMode on the meta device: 20.2 TFLOP at 1024x1024, 4.7 at 512x512; the
recomputation of gradient checkpointing is not counted) times images/s, over the bf16 matrix rate
measured on the same GPU by this invocation. The raw loop runs the same DeepSpeed JSON and model through
`deepspeed.initialize` with tensors already on the GPU: the framework's s/it over the loop's is our
overhead. With `--overhead-pairs N` that cell and the raw loop run alternately N times and the overhead is
the median of the N ratios (each pair measured back to back, so a noisy machine's drift cancels).

Results are appended to `<out>/results.csv` as cells finish; a rerun skips the cells already there, so
a time-limited machine can continue the benchmark over several calls (`--budget-min`). `results.md`
holds the table and each target as measured; `cells/report.png` is the sweep report's chart.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ds_trainer.tools.bench_cells import Cell, raw_loop, run_cell, run_raw

COMBOS = (("ddp", "none"), ("stage2", "none"), ("stage2", "cpu"), ("stage3", "none"), ("stage3", "cpu"),
          ("stage3", "nvme"), ("fsdp_shard_grad_op", "none"), ("fsdp_full_shard", "none"), ("fsdp_full_shard", "cpu"))
FIELDS = ("cell", "zero", "offload", "resolution", "micro_batch", "grad_ckpt", "accum", "status",
          "gpu_alloc_peak_gib", "gpu_reserved_peak_gib", "host_rss_peak_gib", "first_step_s", "median_s_per_it",
          "images_per_s",
          "s_per_image", "tflop_per_image", "mfu", "raw_median_s_per_it", "overhead", "overhead_pairs", "peak_tflops",
          "message")


def target_cells(res: int, small: int, big: int) -> list[Cell]:
    """The cells the targets are measured on, in the order they are run (each once: with one batch size
    the first and third are the same cell)."""
    cells = [Cell("stage2", "cpu", res, small, True), Cell("stage3", "cpu", res, small, True),
             Cell("stage2", "cpu", res, big, True), Cell("stage2", "none", res, big, False),
             Cell("ddp", "none", res, big, False), Cell("stage2", "none", res, big, False, 16),
             Cell("stage2", "cpu", res, big, False, 16)]
    return list(dict.fromkeys(cells))


def all_cells(resolutions: list[int], batches: list[int]) -> list[Cell]:
    targets = target_cells(resolutions[0], batches[0], batches[-1])
    full = [Cell(z, o, r, b, gc) for r in resolutions for b in batches for z, o in COMBOS for gc in (True, False)]
    return targets + [c for c in full if c not in targets]


def peak_tflops() -> float:
    """Dense matrix-multiply rate of this device in TFLOP/s, measured in a process of its own: the bench's parent
    stays alive while its cells run, and a CUDA context and cached blocks of its own would take 0.5-1 GB from
    every cell (moving where cells run out of memory)."""
    code = "from ds_trainer.tools.bench import measure_peak_tflops; print(measure_peak_tflops())"
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


def _read(path: Path) -> list[dict[str, Any]]:
    return list(csv.DictReader(path.open())) if path.exists() else []


def _append(path: Path, row: dict[str, Any]) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/run"))
    parser.add_argument("--model", default="sdxl_base")
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 512])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cells", choices=("targets", "all"), default="all")
    parser.add_argument("--steps", type=int, default=12, help="steps per cell (half with accumulation); 2 warm up")
    parser.add_argument("--budget-min", type=float, default=None, help="start no cell after this many minutes")
    parser.add_argument("--cell-timeout-s", type=int, default=900)
    parser.add_argument("--nvme-path", default="/tmp/ds_trainer_bench_swap")
    parser.add_argument("--adapter", choices=("none", "lora", "lora_wide"), default="none",
                        help="what every cell trains: the whole UNet, or LoRA (use its own --out)")
    parser.add_argument("--overhead-pairs", type=int, default=1,
                        help="run the overhead cell and the raw loop alternately this many times (median ratio)")
    parser.add_argument("--startup-pairs", type=int, default=0,
                        help="instead of the cells: time to the first step and s/it of each --zeros option against "
                             "the raw loop, this many alternating pairs each (see tools/bench_startup.py)")
    parser.add_argument("--zeros", nargs="+", default=["ddp", "stage2", "stage3"],
                        help="the zero options --startup-pairs measures")
    parser.add_argument("--peer-script", type=Path, default=None,
                        help="with --startup-pairs: the path of diffusers' examples/text_to_image/"
                             "train_text_to_image_sdxl.py, timed in each pair on the same weights, images, batch and "
                             "steps as the run (see tools/bench_peer.py); needs the datasets and torchvision packages "
                             "in --peer-python (pip install -e '.[bench]', and the torchvision built for your torch)")
    parser.add_argument("--peer-python", default=sys.executable,
                        help="the Python that runs --peer-script (default: this one)")
    parser.add_argument("--precisions", nargs="+", default=None,
                        help="instead of the cells: the training loss of the same run under each of these precisions "
                             "(see tools/bench_precision.py), at each --lrs, for --steps steps")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-4], help="the learning rates --precisions runs at")
    parser.add_argument("--samples", type=int, default=64, help="synthetic images --precisions trains on")
    parser.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.peer_script is not None and not args.startup_pairs:
        parser.error("--peer-script is timed beside the runs of --startup-pairs N: add --startup-pairs")
    if args.peer_script is not None and not args.peer_script.is_file():
        parser.error(f"--peer-script {args.peer_script}: no such file")
    if args.raw is not None:
        first, median = raw_loop(args.raw, args.steps)
        print(f"raw_first_step_at={first}\nraw_median_s_per_it={median}", flush=True)
        return 0
    if args.precisions:
        from ds_trainer.tools import bench_precision

        return bench_precision.main(args)
    if args.startup_pairs:
        from ds_trainer.tools import bench_startup

        return bench_startup.main(args)
    start = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.csv"
    done = {r["cell"] for r in _read(results)}
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
        _append(results, row)
        print(f"{cell.name}: {row['status']} {row.get('gpu_alloc_peak_gib')} GiB alloc, "
              f"{row.get('median_s_per_it')} s/it, MFU {row.get('mfu')}", flush=True)
    rows = _read(results)
    from ds_trainer.launch import report

    if (out / "cells").is_dir():
        report.write(out / "cells", use_wandb=False)
    print(f"results: {write_markdown(out, rows, args)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
