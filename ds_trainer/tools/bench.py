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
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

COMBOS = (("ddp", "none"), ("stage2", "none"), ("stage2", "cpu"), ("stage3", "none"), ("stage3", "cpu"),
          ("stage3", "nvme"))
FIELDS = ("cell", "zero", "offload", "resolution", "micro_batch", "grad_ckpt", "accum", "status",
          "gpu_alloc_peak_gib", "gpu_reserved_peak_gib", "host_rss_peak_gib", "median_s_per_it", "images_per_s",
          "s_per_image", "tflop_per_image", "mfu", "raw_median_s_per_it", "overhead", "overhead_pairs", "peak_tflops",
          "message")


@dataclass(frozen=True)
class Cell:
    zero: str
    offload: str
    res: int
    batch: int
    gc: bool
    accum: int = 1

    @property
    def name(self) -> str:
        return f"{self.zero}-{self.offload}-px{self.res}-b{self.batch}-gc{int(self.gc)}-acc{self.accum}"

    def overrides(self, model: str, steps: int, nvme_path: str) -> list[str]:
        out = [f"model={model}", f"zero={self.zero}", f"offload={self.offload}", f"resolution.width={self.res}",
               f"resolution.height={self.res}", f"train.micro_batch_size={self.batch}",
               f"train.gradient_checkpointing={str(self.gc).lower()}",
               f"train.gradient_accumulation_steps={self.accum}", f"train.max_steps={steps}",
               f"data.num_samples={self.batch * self.accum}", "logger=none", "train.export=false",
               "train.final_checkpoint=false", "train.checkpoint_every=0"]
        if self.offload == "nvme":
            out.append(f"offload.nvme_path={nvme_path}")
        return out


def target_cells(res: int, small: int, big: int) -> list[Cell]:
    """The cells the targets are measured on, in the order they are run."""
    return [Cell("stage2", "cpu", res, small, True), Cell("stage3", "cpu", res, small, True),
            Cell("stage2", "cpu", res, big, True), Cell("stage2", "none", res, big, False),
            Cell("ddp", "none", res, big, False), Cell("stage2", "none", res, big, False, 16),
            Cell("stage2", "cpu", res, big, False, 16)]


def all_cells(resolutions: list[int], batches: list[int]) -> list[Cell]:
    targets = target_cells(resolutions[0], batches[0], batches[-1])
    full = [Cell(z, o, r, b, gc) for r in resolutions for b in batches for z, o in COMBOS for gc in (True, False)]
    return targets + [c for c in full if c not in targets]


@cache
def tflop_per_image(model: str, res: int) -> float:
    """Model FLOPs of one image through the UNet, forward and backward, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_trainer import ASSETS_DIR
    from ds_trainer.tools import plan

    unet = plan._meta_unet(str(ASSETS_DIR / model))  # shared and cached: the planner may have cast it to bf16
    latents, t, embeds, cond = plan.unet_inputs(unet.config, 1, res, res, unet.dtype, "meta")
    with FlopCounterMode(display=False) as counter:
        unet(latents, t, embeds, added_cond_kwargs=cond).sample.sum().backward()
    unet.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()) / 1e12


def peak_tflops() -> float:
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


def _gib(mib: Any) -> float | None:
    return round(float(mib) / 1024, 2) if mib is not None else None


def _round(value: Any, digits: int) -> float | None:
    return round(float(value), digits) if value is not None else None


def run_cell(cell: Cell, args: argparse.Namespace, out: Path, folder: Path | None = None) -> dict[str, Any]:
    """Train the cell in its own process; its row of the results."""
    folder = folder or out / "cells" / cell.name
    cmd = [sys.executable, "-m", "ds_trainer", *cell.overrides(args.model, _steps(cell, args), args.nvme_path),
           f"adapter={args.adapter}", f"hydra.run.dir={folder}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s)
        tail = proc.stderr.strip().splitlines()[-1:] if proc.returncode else []
    except subprocess.TimeoutExpired:
        tail = [f"no result within {args.cell_timeout_s} s"]
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    row: dict[str, Any] = {"cell": cell.name, "zero": cell.zero, "offload": cell.offload,
                           "resolution": f"{cell.res}x{cell.res}", "micro_batch": cell.batch, "grad_ckpt": cell.gc,
                           "accum": cell.accum, "status": summary.get("status", "error"),
                           "gpu_alloc_peak_gib": _gib(summary.get("gpu_mem_peak_allocated_mib")),
                           "gpu_reserved_peak_gib": _gib(summary.get("gpu_mem_peak_reserved_mib")),
                           "host_rss_peak_gib": _gib(summary.get("host_rss_peak_mib")),
                           "median_s_per_it": _round(summary.get("median_s_per_it"), 4),
                           "images_per_s": _round(summary.get("images_per_s"), 3),
                           "message": summary.get("message") or (tail[0] if tail else None)}
    if row["status"] == "ok" and row["images_per_s"]:
        flops = tflop_per_image(args.model, cell.res)
        world = int(summary.get("world_size", 1))
        row.update(s_per_image=round(1 / row["images_per_s"], 5), tflop_per_image=round(flops, 3),
                   mfu=round(flops * row["images_per_s"] / world / args.peak, 4), peak_tflops=round(args.peak, 1))
    return row


def _steps(cell: Cell, args: argparse.Namespace) -> int:
    return max(4, args.steps // 2) if cell.accum > 1 else int(args.steps)


def raw_loop(folder: Path, steps: int, warmup: int = 2) -> float:
    """Median s/it of a minimal DeepSpeed loop with the cell's JSON and model (run in its own process)."""
    import deepspeed
    import torch
    from omegaconf import DictConfig, OmegaConf

    from ds_trainer.tools import plan
    from ds_trainer.train import models
    from ds_trainer.train import recipe as train

    cfg = OmegaConf.load(folder / "config.yaml")
    assert isinstance(cfg, DictConfig)
    ds = json.loads((folder / "ds_config.json").read_text())
    train._single_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    unet = models.load_unet(cfg)
    engine, _, _, _ = deepspeed.initialize(model=unet, model_parameters=unet.parameters(), config=ds)
    micro, accum = int(cfg.train.micro_batch_size), int(cfg.train.gradient_accumulation_steps)
    dtype = torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float32
    latents, t, embeds, cond = plan.unet_inputs(unet.config, micro, int(cfg.resolution.height),
                                                int(cfg.resolution.width), dtype, engine.device)
    noise = torch.randn_like(latents)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(accum):
            loss = torch.nn.functional.mse_loss(engine(latents, t, embeds, added_cond_kwargs=cond).sample.float(),
                                                noise.float())
            engine.backward(loss)
            engine.step()
        loss.item()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def run_raw(cell: Cell, args: argparse.Namespace, out: Path, folder: Path | None = None) -> float | None:
    folder = folder or out / "cells" / cell.name
    cmd = [sys.executable, "-m", "ds_trainer.bench", "--raw", str(folder), "--steps", str(_steps(cell, args))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s)
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("raw_median_s_per_it=")]
    return float(lines[-1].split("=")[1]) if proc.returncode == 0 and lines else None


def overhead_of(cell: Cell, row: dict[str, Any], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The framework's s/it over the raw loop's: the median ratio of `--overhead-pairs` back-to-back pairs."""
    pairs: list[tuple[float, float]] = []
    for k in range(args.overhead_pairs):
        folder = out / "cells" / cell.name if k == 0 else out / "overhead_pairs" / f"{k}"
        framework = row["median_s_per_it"] if k == 0 else run_cell(cell, args, out, folder)["median_s_per_it"]
        raw = run_raw(cell, args, out, folder) if framework else None
        if framework and raw:
            pairs.append((float(framework), raw))
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
    parser.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.raw is not None:
        print(f"raw_median_s_per_it={raw_loop(args.raw, args.steps)}", flush=True)
        return 0
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
