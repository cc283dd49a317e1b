"""What the planner tells: the table, the recommendation, and the lines a training run logs at its start."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import buckets
from ds_trainer.tools.plan import samples
from ds_trainer.tools.plan.cells import GIB, Estimate, estimate


def describe(e: Estimate) -> str:
    """One line for the training log."""
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in (
        ("params", e.params), ("grads", e.grads), ("optimizer", e.optimizer), ("activations", e.activations),
        ("buffers", e.buffers)))
    return f"about {e.gpu / GIB:.2f} GiB GPU per rank ({parts} GiB), host {e.host / GIB:.2f} GiB"


def recommend(estimates: list[Estimate], budget: float) -> Estimate | None:
    """The cheapest cell that fits: CELLS is ordered from fastest to slowest."""
    return next((e for e in estimates if max(e.gpu, e.sampling or 0) <= budget), None)


def table(estimates: list[Estimate], budget: float | None) -> str:
    """The cells as a text table in GiB per rank, with whether each fits `budget` (bytes) when one is known."""
    head = ("zero", "offload", "GPU/rank", "params", "grads", "optim", "activ", "buffers", "host RAM", "NVMe",
            "fits")
    rows: list[tuple[str, ...]] = [head]
    for e in estimates:
        fits = "" if budget is None else ("yes" if e.gpu <= budget else "no")
        rows.append((e.zero, e.offload, *(f"{v / GIB:.2f}" for v in (e.gpu, e.params, e.grads, e.optimizer,
                                                                     e.activations, e.buffers, e.host, e.nvme)),
                     fits))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def log_for_run(cfg: DictConfig, info: Any, world: int) -> None:
    """Log this run's estimate at its start (training calls it on rank 0); warn when it exceeds the GPU."""
    from ds_trainer.config import ds_config

    log = logging.getLogger("ds_trainer")
    zero = ds_config.zero_option(cfg)
    # The effective offload: below stage 3 an NVMe request runs as cpu.
    offload = "none" if cfg.resolved.optimizer_state_on == "gpu" else (
        cfg.offload.device.value if zero == "stage3" else "cpu")
    try:
        from ds_trainer.tools.plan import calibration

        calibrated = calibration.for_config(cfg, info)
        result = estimate(cfg, zero, offload, world, calibrated.factor)
    except Exception as exc:  # noqa: BLE001 - a plan is advice; training goes on without it
        log.warning("no memory plan for this model (%s)", exc)
        return
    at = f" at the largest bucket {buckets.name(buckets.largest(cfg))}" if buckets.enabled(cfg) else ""
    log.info("memory plan (python -m ds_trainer.plan)%s: %s; %s", at, describe(result), calibrated.describe())
    if result.sampling is not None:
        log.info("memory plan: %s", samples.describe(result.sampling, result.gpu))
    total = (info.gpu_memory_mib or 0) * 2**20
    if info.kind == "cuda" and total and result.gpu > total:
        log.warning("the memory plan (%.1f GiB per rank) exceeds this GPU's %.1f GiB: expect out of memory; "
                    "`python -m ds_trainer.plan` with the same overrides shows what fits",
                    result.gpu / 2**30, total / 2**30)
    elif info.kind == "cuda" and total and (result.sampling or 0) > total:
        log.warning("training fits this GPU's %.1f GiB but sampling or validating (samples=on, validation=on) "
                    "needs about %.1f GiB per rank: expect out of memory at the first sample or validation step",
                    total / 2**30, (result.sampling or 0) / 2**30)
