"""One benchmark cell: a real `python -m ds_trainer` run in a process of its own, and the raw loop that runs the
same model, batch and optimizer with nothing else around it (`python -m ds_trainer.bench --raw <run folder>`).

Both are timed from outside, from the moment their process is started: the time to the end of the first step
(for a run, the time of its `start-up:` log line) is what a user waits for, imports and all.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Cell:
    """One benchmark cell: the zero option, offload, resolution, micro batch, checkpointing and accumulation."""

    zero: str
    offload: str
    res: int
    batch: int
    gc: bool
    accum: int = 1

    @property
    def name(self) -> str:
        """The cell's folder and row name."""
        return f"{self.zero}-{self.offload}-px{self.res}-b{self.batch}-gc{int(self.gc)}-acc{self.accum}"

    def overrides(self, model: str, steps: int, nvme_path: str) -> list[str]:
        """The training overrides of the cell: synthetic data, no logger, no checkpoints."""
        out = [f"model={model}", f"zero={self.zero}", f"offload={self.offload}", f"resolution.width={self.res}",
               f"resolution.height={self.res}", f"train.micro_batch_size={self.batch}",
               f"train.gradient_checkpointing={str(self.gc).lower()}",
               f"train.gradient_accumulation_steps={self.accum}", f"train.max_steps={steps}",
               f"data.num_samples={self.batch * self.accum}", "logger=none", "train.export=false",
               "train.final_checkpoint=false", "train.checkpoint_every=0"]
        if self.offload == "nvme":
            out.append(f"offload.nvme_path={nvme_path}")
        return out


@cache
def tflop_per_image(model: str, res: int) -> float:
    """Model FLOPs of one image through the UNet, forward and backward, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    from ds_trainer import ASSETS_DIR
    from ds_trainer.tools.plan.unet import meta_unet, unet_inputs

    unet = meta_unet(str(ASSETS_DIR / model))  # shared and cached: the planner may have cast it to bf16
    latents, t, embeds, cond = unet_inputs(unet.config, 1, res, res, unet.dtype, "meta")
    with FlopCounterMode(display=False) as counter:
        unet(latents, t, embeds, added_cond_kwargs=cond).sample.sum().backward()
    unet.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()) / 1e12


def _gib(mib: Any) -> float | None:
    return round(float(mib) / 1024, 2) if mib is not None else None


def _round(value: Any, digits: int) -> float | None:
    return round(float(value), digits) if value is not None else None


def cell_command(cell: Cell, args: argparse.Namespace, folder: Path, extra: list[str] | None = None) -> list[str]:
    """The `python -m ds_trainer` command of the cell, run in `folder`, with `extra` overrides last."""
    return [sys.executable, "-m", "ds_trainer", *cell.overrides(args.model, _steps(cell, args), args.nvme_path),
            f"adapter={args.adapter}", f"hydra.run.dir={folder}", *(extra or [])]


def run_cell(cell: Cell, args: argparse.Namespace, out: Path, folder: Path | None = None,
             extra: list[str] | None = None) -> dict[str, Any]:
    """Train the cell in its own process (with `extra` overrides); its row of the results."""
    folder = folder or out / "cells" / cell.name
    cmd = cell_command(cell, args, folder, extra)
    launched = time.time()
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
                           "first_step_s": _round(ended - launched, 3) if (ended := _first_step_end(folder)) else None,
                           "message": summary.get("message") or (tail[0] if tail else None)}
    if row["status"] == "ok" and row["images_per_s"] and getattr(args, "peak", None):
        flops = tflop_per_image(args.model, cell.res)
        world = int(summary.get("world_size", 1))
        row.update(s_per_image=round(1 / row["images_per_s"], 5), tflop_per_image=round(flops, 3),
                   mfu=round(flops * row["images_per_s"] / world / args.peak, 4), peak_tflops=round(args.peak, 1))
    return row


def _first_step_end(folder: Path) -> float | None:
    """When the run's first step ended (the time of its `start-up:` log line), as a time.time() value."""
    log = folder / "ds_trainer.log"
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        if "] - start-up: " in line and line.startswith("["):  # [2026-11-24 09:40:14,038][ds_trainer][INFO] - ...
            stamp, millis = line[1:24].split(",")
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
    return None


def _steps(cell: Cell, args: argparse.Namespace) -> int:
    return max(4, args.steps // 2) if cell.accum > 1 else int(args.steps)


def raw_loop(folder: Path, steps: int, warmup: int = 2) -> tuple[float, float]:
    """A minimal loop with the cell's model, batch and optimizer, run in its own process: DeepSpeed's engine
    from the cell's JSON, FSDP2 as the cell configures it, or (zero=ddp, one rank) torch's AdamW under the same
    autocast Accelerate uses.
    Returns (when its first step ended as a time.time() value, median s/it after `warmup` steps)."""
    import torch
    from omegaconf import DictConfig, OmegaConf

    from ds_trainer.tools.plan.unet import unet_inputs
    from ds_trainer.train import recipe as train
    from ds_trainer.train.families import sdxl

    cfg = OmegaConf.load(folder / "config.yaml")
    assert isinstance(cfg, DictConfig)
    train.single_process_env()
    unet = sdxl.load_unet(cfg)
    micro, accum = int(cfg.train.micro_batch_size), int(cfg.train.gradient_accumulation_steps)
    bf16 = cfg.precision.name in ("bf16", "bf16_pure")
    if (folder / "ds_config.json").exists():
        import deepspeed

        from ds_trainer.config import op_cache

        op_cache.prepare()
        ds = json.loads((folder / "ds_config.json").read_text())
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        engine, _, _, _ = deepspeed.initialize(model=unet, model_parameters=unet.parameters(), config=ds)
        model, device = engine, engine.device
        autocast: Any = contextlib.nullcontext
        dtype = next(engine.module.parameters()).dtype  # the engine's own: bf16, fp16 or fp32

        def update(loss: Any) -> None:
            engine.backward(loss)
            engine.step()
    elif cfg.zero.backend == "fsdp":
        model, device, dtype, autocast, update = _raw_fsdp(cfg, unet)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, dtype = unet.to(device), torch.float32
        # The run's own optimizer (torch's fused AdamW) and clipping: the ratio is then the run's overhead alone.
        update = _torch_update(cfg, unet, fused=True)
        autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16)
    latents, t, embeds, cond = unet_inputs(unet.config, micro, int(cfg.resolution.height),
                                                int(cfg.resolution.width), dtype, device)
    noise = torch.randn_like(latents)
    times, first = [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        for _ in range(accum):
            with autocast():
                out = model(latents, t, embeds, added_cond_kwargs=cond).sample
            update(torch.nn.functional.mse_loss(out.float(), noise.float()))
        float(out.sum())
        times.append(time.perf_counter() - start)
        first = first or time.time()
    return first, statistics.median(times[warmup:])


def _raw_fsdp(cfg: Any, unet: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The cell's FSDP2 with nothing around it: `fully_shard` on the same units and the root, the same resharding,
    mixed precision and offload, torch's AdamW over the DTensor shards (unfused, as the run's), the same clipping."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    meaning = cfg.resolved.fsdp
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(meaning.compute_dtype, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype={"bf16": torch.bfloat16}.get(
        meaning.reduce_dtype, torch.float32), output_dtype=compute, cast_forward_inputs=True)
    offload = CPUOffloadPolicy(pin_memory=cuda) if cfg.offload.device == "cpu" else OffloadPolicy()
    unet = unet.to(torch.bfloat16 if cfg.precision.name == "bf16_pure" else torch.float32)
    if cfg.offload.device != "cpu":
        unet = unet.to(device)
    units = set(meaning.units)
    for module in unet.modules():
        if type(module).__name__ in units:
            fully_shard(module, reshard_after_forward=bool(meaning.reshard_after_forward), mp_policy=policy,
                        offload_policy=offload)
    fully_shard(unet, reshard_after_forward=bool(meaning.reshard_after_forward), mp_policy=policy,
                offload_policy=offload)
    return unet, device, compute, contextlib.nullcontext, _torch_update(cfg, unet)


def _torch_update(cfg: Any, unet: Any, **kwargs: Any) -> Any:
    """One backward and optimizer step as the run takes it without DeepSpeed: torch's AdamW with the config's
    hyperparameters (`kwargs`: e.g. fused=True) and its gradient clipping."""
    import torch

    o, clip = cfg.optimizer, float(cfg.train.gradient_clipping)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=float(o.lr), betas=tuple(o.betas), eps=float(o.eps),
                                  weight_decay=float(o.weight_decay), **kwargs)

    def update(loss: Any) -> None:
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(unet.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return update


def run_raw(cell: Cell, args: argparse.Namespace, out: Path, folder: Path | None = None,
            ) -> tuple[float, float] | None:
    """The raw loop on the cell's run folder in a process of its own: (s to its first step, median s/it)."""
    folder = folder or out / "cells" / cell.name
    cmd = [sys.executable, "-m", "ds_trainer.bench", "--raw", str(folder), "--steps", str(_steps(cell, args))]
    launched = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cell_timeout_s)
    except subprocess.TimeoutExpired:
        return None
    lines = dict(line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith("raw_"))
    if proc.returncode or "raw_median_s_per_it" not in lines:
        return None
    return float(lines["raw_first_step_at"]) - launched, float(lines["raw_median_s_per_it"])
