"""Metrics: per-step values to `metrics.jsonl` and W&B (main process only), `summary.json` at the end.

GPU fields come from torch's CUDA peak counters, reset per logging window; on a machine without a GPU
they are absent, never zero.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import ds_config
from ds_trainer.train.observe import startup

log = logging.getLogger(__name__)

# Overrides that do not define a run (its name and W&B name leave them out).
_NOT_DEFINING = ("train.seed", "hydra", "logger", "resume", "dry_run", "paths", "world_size", "platform", "+sweep",
                 "sweep", "train.checkpoint", "train.log_every")
WANDB_ID_FILE = "wandb_id.txt"


def run_name(overrides: list[str]) -> str:
    """`zero=stage2,offload=nvme` from the overrides that define the run; `default` without any."""
    kept = [o.lstrip("+~") for o in overrides if not o.lstrip("+~").startswith(_NOT_DEFINING)]
    return ",".join(sorted(kept)) or "default"


_SETUP_PEAK_MIB = 0.0  # the process's peak before `loop_start` reset the kernel's high-water mark


def host_rss_peak_mib() -> float:
    """The process's peak RSS since it started (a reset at the loop's start does not lower it)."""
    return max(_SETUP_PEAK_MIB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


def _status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def loop_start_rss() -> float | None:
    """Current RSS (MiB), then reset the kernel's peak RSS so that VmHWM from here on is the training loop's
    (like `torch.cuda.reset_peak_memory_stats` for a GPU). None where /proc has no such counters."""
    global _SETUP_PEAK_MIB
    _SETUP_PEAK_MIB = host_rss_peak_mib()
    now = _status_mib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: high-water mark := current RSS
    except OSError:
        return None
    return now


def gpu_memory(device: Any) -> dict[str, float]:
    """Peak allocated/reserved MiB since the last call (then reset), and the device total."""
    import torch

    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return {}
    out = {"gpu_mem_peak_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
           "gpu_mem_peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
           "gpu_mem_total_mib": torch.cuda.get_device_properties(device).total_memory / 2**20}
    torch.cuda.reset_peak_memory_stats(device)
    return out


class Tracker:
    """Writes metrics on the main process; W&B through Accelerate's tracker API."""

    def __init__(self, accelerator: Any, cfg: DictConfig, run_dir: Path, ds: dict[str, Any] | None,
                 name: str, resumed: Any = None) -> None:
        """`resumed`: what the run continues from (train/state/resume.py's Resume: its W&B id,
        its step and checkpoint), or None."""
        wandb_id = resumed.wandb_id if resumed is not None else None
        resume_step = resumed.step if resumed is not None else None
        resumed_from = resumed.path if resumed is not None else None
        self.accelerator, self.cfg, self.run_dir = accelerator, cfg, run_dir
        self.main = accelerator.is_main_process
        self.rows: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}  # facts about the run found during setup (e.g. buckets), for summary.json
        self.loop_rss_mib: float | None = None
        self.wandb_id: str | None = None
        self.wandb_broken = False
        # Validation rows (`val_loss`...), kept apart from the step rows; those of the run's earlier lives too.
        self.validations: list[dict[str, Any]] = []
        # Resumed from another run folder's checkpoint: that folder's validations up to it (the
        # best carries over).
        self.earlier: list[dict[str, Any]] = []
        self.postfix: dict[str, str] = {}  # shown on the progress bar beside the step's values
        if not self.main:
            return
        if resume_step is not None:
            drop_after(run_dir / "metrics.jsonl", resume_step)  # the resumed steps' values replace them
            self.validations = [row for row in read_rows(run_dir / "metrics.jsonl") if "val_loss" in row]
            source = resumed_from.parent.parent if resumed_from is not None else run_dir
            if source.resolve() != run_dir.resolve():
                self.earlier = [row for row in read_rows(source / "metrics.jsonl")
                                if "val_loss" in row and int(row.get("step", 0)) <= resume_step]
        self.file = (run_dir / "metrics.jsonl").open("a")
        if cfg.logger.name.value == "wandb" and cfg.logger.mode.value != "disabled":
            self.wandb_id = wandb_id or _read_id(run_dir) or _new_id()
            (run_dir / WANDB_ID_FILE).write_text(self.wandb_id)
            config = {"config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "ds_config": ds}
            init = {"mode": cfg.logger.mode.value, "dir": str(run_dir), "name": name, "id": self.wandb_id,
                    "group": cfg.logger.group, "tags": list(cfg.logger.tags), "entity": cfg.logger.entity,
                    **wandb_resume(self.wandb_id if wandb_id else None, resume_step)}
            if cfg.logger.mode.value == "offline":  # its 25-line history on the terminal repeats metrics.jsonl;
                init["settings"] = {"quiet": True}  # the run's last lines say how to upload it (print_summary)
            accelerator.init_trackers(cfg.logger.project, config=config,
                                      init_kwargs={"wandb": {k: v for k, v in init.items() if v is not None}})

    def loop_start(self) -> None:
        """Called right before the training loop: host memory from here on is the steps' own."""
        if self.main:
            self.loop_rss_mib = loop_start_rss()

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.main:
            return
        loop_peak = _status_mib("VmHWM") if self.loop_rss_mib is not None else None
        if loop_peak is not None:  # what the steps added over the set-up model (the tuner's CPU measure)
            values = {**values, "host_rss_loop_start_mib": self.loop_rss_mib, "host_rss_loop_peak_mib": loop_peak}
        row = {"step": step, **values}
        if not self.rows:
            startup.first_step()  # logs where the time to the first step went
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb_id and not self.wandb_broken:
            try:
                self.accelerator.log(values, step=step)
            except Exception as exc:  # noqa: BLE001 - W&B going away must not stop training
                self.wandb_broken = True
                log.warning("W&B logging failed (%s); metrics continue in metrics.jsonl only", exc)

    def log_validation(self, step: int, values: dict[str, Any]) -> None:
        """A validation's values: a row of their own in metrics.jsonl, W&B's `val/` panel (at the step's row)."""
        if not self.main:
            return
        row = {"step": step, **values}
        self.validations.append(row)
        self.postfix["val"] = f"{values['val_loss']:.4f}"
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb_id and not self.wandb_broken:
            try:
                self.accelerator.log({"val/" + ("seconds" if key == "val_s" else key.removeprefix("val_")): value
                                      for key, value in values.items()}, step=step)
            except Exception as exc:  # noqa: BLE001 - W&B going away must not stop training
                self.wandb_broken = True
                log.warning("W&B logging failed (%s); metrics continue in metrics.jsonl only", exc)

    def add_facts(self, values: dict[str, Any]) -> None:
        """Facts found during setup: kept for summary.json and added to the W&B run's config."""
        if not self.main:
            return
        self.facts.update(values)
        for tracker in self.accelerator.trackers if self.wandb_id and not self.wandb_broken else []:
            try:
                tracker.tracker.config.update(values, allow_val_change=True)
            except Exception as exc:  # noqa: BLE001 - W&B going away must not stop training
                log.warning("W&B config update failed: %s", exc)

    def close(self) -> None:
        """Close the metrics file and finish the W&B run (flushed even when a preempted job exits)."""
        if not self.main:
            return
        self.file.close()
        for tracker in self.accelerator.trackers:
            try:
                tracker.finish()
            except Exception as exc:  # noqa: BLE001 - closing must not mask the run's own outcome
                log.warning("W&B did not finish cleanly: %s", exc)
        if self.accelerator.trackers:
            # Stop W&B's service process now, not in its atexit hook: a requeued Slurm job is sent SIGTERM as
            # it exits, the service dies first, and the hook then prints a traceback ("Connection lost").
            try:
                import wandb

                wandb.teardown()
            except Exception as exc:  # noqa: BLE001
                log.warning("W&B did not shut down cleanly: %s", exc)


def drop_after(path: Path, step: int) -> None:
    """Rewrite `path` (metrics.jsonl) without the rows after `step`: a run killed after its last
    checkpoint logged steps that the resume trains again; each step is then recorded once."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines(keepends=True)
            if line.strip() and _step_of(line) is not None and int(_step_of(line) or 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (a line cut short by a kill is left out)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def validation_summary(validations: list[dict[str, Any]],
                       earlier: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """summary.json's validation fields: the last and the best value of each loss with their steps, and the time
    all evaluations took (apart from s/it); `earlier`: the validations of the run folder this one
    resumed from, which the best is taken over too."""
    out: dict[str, Any] = {}
    for key in ("val_loss", "val_loss_ema"):
        rows = [row for row in validations if key in row]
        if rows:
            before = [row for row in earlier or [] if key in row]
            best = min([*before, *rows], key=lambda row: row[key])
            out.update({key: rows[-1][key], f"{key}_step": rows[-1]["step"], f"{key}_best": best[key],
                        f"{key}_best_step": best["step"]})
    if validations:
        out["validation_s"] = sum(float(row.get("val_s", 0.0)) for row in validations)
        out["validations"] = len(validations)
    return out


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by the kill


def wandb_resume(resumed_id: str | None, step: int | None) -> dict[str, str]:
    """wandb.init arguments: a resumed run rewinds its W&B history to the checkpoint's step
    (`resume_from="<id>?_step=N"`, recorded as the run's branch point, offline too), so the steps
    trained again replace those logged after the checkpoint instead of appearing twice."""
    if resumed_id is not None and step is not None:
        return {"resume_from": f"{resumed_id}?_step={step}"}
    return {"resume": "allow"}


def _read_id(run_dir: Path) -> str | None:
    path = run_dir / WANDB_ID_FILE
    return path.read_text().strip() if path.exists() else None


def _new_id() -> str:
    return os.urandom(4).hex()


# Steps left out of the speed figures: the first steps' allocations and compilations are not the run's pace.
WARMUP_STEPS = 2


def summarize(cfg: DictConfig, rows: list[dict[str, Any]], status: str, message: str | None,
              world_size: int, nodes: list[str] | None = None,
              validation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's `summary.json`: status, speed and memory, quality (the validation loss), what defines the run,
    and the node of each rank."""
    timed = [r for r in rows if r.get("step", 0) > WARMUP_STEPS] or rows
    def peak(key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return max(values) if values else None
    summary = {
        "status": status, "message": message, "steps": rows[-1]["step"] if rows else 0,
        "median_s_per_it": statistics.median(r["s_per_it"] for r in timed) if timed else None,
        "images_per_s": statistics.median(r["images_per_s"] for r in timed) if timed else None,
        "gpu_mem_peak_allocated_mib": peak("gpu_mem_peak_allocated_mib"),
        "gpu_mem_peak_reserved_mib": peak("gpu_mem_peak_reserved_mib"),
        "host_rss_peak_mib": peak("host_rss_peak_mib"),
        "host_rss_loop_start_mib": peak("host_rss_loop_start_mib"),
        "host_rss_loop_peak_mib": peak("host_rss_loop_peak_mib"),
        "final_loss": rows[-1]["loss"] if rows else None,
        **(validation or {}),
        "world_size": world_size, "nodes": nodes, "num_nodes": len(set(nodes)) if nodes else None,
        "zero": ds_config.zero_option(cfg),
        "offload": cfg.offload.device.value,
        "resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
        "micro_batch_size": int(cfg.train.micro_batch_size),
        "gradient_accumulation_steps": int(cfg.train.gradient_accumulation_steps),
        "precision": cfg.precision.name.value, "model": cfg.model.name, "optimizer": cfg.resolved.optimizer,
        "gradient_checkpointing": bool(cfg.train.gradient_checkpointing), "platform": cfg.resolved.platform,
        "method": cfg.adapter.method.value, "trainable_params": cfg.resolved.trainable_params,
    }
    return {k: v for k, v in summary.items() if v is not None or k == "message"}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Best effort: on a full disk the summary cannot be written, and the run's message says why."""
    from ds_trainer.config.rundir import write_json

    try:
        write_json(run_dir / "summary.json", summary)
    except OSError as exc:
        log.error("could not write %s: %s", run_dir / "summary.json", exc)


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    lines = [f"ds_trainer: {summary['status']} after {summary.get('steps', 0)} steps"]
    if "cache" in summary:  # cache_only=true
        cache = summary["cache"]
        lines[0] = f"ds_trainer: {summary['status']}: the latent cache is built, nothing trained"
        lines.append(f"  {cache['samples']} samples in {cache['files']} files, {cache['bytes'] / 2**20:.1f} MiB: "
                     f"{cache['dir']}")
    if "median_s_per_it" in summary:
        lines.append(f"  median {summary['median_s_per_it']:.3f} s/it, {summary['images_per_s']:.2f} images/s")
    if "compile_s" in summary:
        lines.append(f"  torch.compile: {summary['compile_s']:.1f} s in {summary['compilations']} compilations "
                     "(not in s/it)")
    if "gpu_mem_peak_allocated_mib" in summary:
        lines.append(f"  peak GPU memory {summary['gpu_mem_peak_allocated_mib']:.0f} MiB allocated, "
                     f"{summary['gpu_mem_peak_reserved_mib']:.0f} MiB reserved")
    if "host_rss_peak_mib" in summary:
        lines.append(f"  peak host RSS {summary['host_rss_peak_mib']:.0f} MiB")
    if "val_loss" in summary:
        ema = f", EMA {summary['val_loss_ema']:.6f}" if "val_loss_ema" in summary else ""
        lines.append(f"  validation loss {summary['val_loss']:.6f}{ema} at step {summary['val_loss_step']} (best "
                     f"{summary['val_loss_best']:.6f} at step {summary['val_loss_best_step']}; "
                     f"{summary['validation_s']:.1f}s in {summary['validations']} evaluations, not in s/it)")
    if summary.get("message"):
        lines.append(f"  {summary['message']}")
    lines.append(f"  outputs: {run_dir}")
    offline = sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    if offline:
        lines.append(f"  W&B offline: `wandb sync {offline[-1]}` uploads it")
    print("\n".join(lines), file=sys.stderr, flush=True)
