"""What a tune searches and decides (the package docstring says how a tune goes): the cells of the space, the overrides
each runs with, the planner's verdict on each, and the winner. The tune's course (run.py) and its outputs
(outputs.py) build on these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config.problems import Problem, first_problem

GIB = 2**30
AXES = {"zero": "zero", "offload": "offload", "train.micro_batch_size": "micro_batch_size",
        "train.gradient_checkpointing": "gradient_checkpointing", "optimizer": "optimizer", "adapter": "adapter",
        "quantize": "quantize", "train.compile": "compile", "parallel.context": "context"}
# Levers searched beside the axes (tune.adapter, tune.quantize, tune.compile, tune.context), each with
# the override key it sets: a cell's choice of each, when the tune searches it.
LEVERS = {"adapter": "adapter", "quantize": "quantize", "compile": "train.compile",
          "context": "parallel.context"}
# Set for measuring only; the winning line leaves them out.
MEASURE_KEYS = ("train.max_steps", "train.export", "train.final_checkpoint", "train.checkpoint_every",
                "train.log_every", "resume", "dry_run", "hydra.")


@dataclass
class Cell:
    """One point of the search space and what became of it."""

    zero: str
    offload: str
    micro: int
    accum: int
    ckpt: bool
    optimizer: str | None = None  # None: the training's own (tune.optimizer empty)
    levers: tuple[tuple[str, str], ...] = ()  # (lever, option) of each searched lever (`LEVERS`)
    status: str = "planned"  # invalid | pruned | planned | ok | oom | error | timeout | over budget
    message: str | None = None
    predicted_gib: float | None = None
    predicted_activation: int | None = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The cell as the tables show it."""
        return (f"{self.zero}/{self.offload} b{self.micro}x{self.accum}" + (" ckpt" if self.ckpt else "")
                + (f" {self.optimizer}" if self.optimizer else "") + "".join(f" {g}={o}" for g, o in self.levers))

    @property
    def name(self) -> str:
        """The cell's folder name."""
        return (f"{self.zero}-{self.offload}-b{self.micro}-a{self.accum}-{'ckpt' if self.ckpt else 'nockpt'}"
                + (f"-{self.optimizer}" if self.optimizer else "") + "".join(f"-{g}-{o}" for g, o in self.levers))

    def overrides(self) -> list[str]:
        """The training overrides that make this cell."""
        return [f"zero={self.zero}", f"offload={self.offload}", f"train.micro_batch_size={self.micro}",
                f"train.gradient_accumulation_steps={self.accum}",
                f"train.gradient_checkpointing={str(self.ckpt).lower()}",
                *([f"optimizer={self.optimizer}"] if self.optimizer else []),
                *(f"{LEVERS[lever]}={option}" for lever, option in self.levers)]


class BadInput(Exception):
    """A tune that cannot start; the message is the one-screen report."""

    def __init__(self, problems: list[Problem]) -> None:
        n = len(problems)
        head = f"ds_trainer.tune: {n} problem{'s' if n != 1 else ''}, nothing was run:"
        super().__init__("\n".join([head, *(p.render() for p in problems)]))


def override_key(override: str) -> str:
    """`train.max_steps` of `train.max_steps=4` (also of `+key=...` and `~key`)."""
    return override.lstrip("+~").split("=", 1)[0]


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the training overrides, axes the user fixed); tune.* and plan.* configure this command only."""
    base = [o for o in argv if not override_key(o).startswith(("tune.", "plan."))]
    fixed = {AXES[override_key(o)]: o.split("=", 1)[1] for o in base if override_key(o) in AXES}
    base = [o for o in base if override_key(o) not in AXES and override_key(o) != "train.gradient_accumulation_steps"]
    return base, fixed


def space(t: DictConfig, fixed: dict[str, str], ranks: int, accumulation: int) -> list[Cell]:
    """Every cell of the space, the accumulation derived when the global batch is fixed."""
    zeros = [fixed["zero"]] if "zero" in fixed else list(t.zero)
    offloads = [fixed["offload"]] if "offload" in fixed else list(t.offload)
    micros = [int(fixed["micro_batch_size"])] if "micro_batch_size" in fixed else [int(m) for m in t.micro_batch_size]
    ckpts = ([fixed["gradient_checkpointing"].lower() == "true"] if "gradient_checkpointing" in fixed
             else [bool(c) for c in t.gradient_checkpointing])
    optimizers: list[str | None] = [fixed["optimizer"]] if "optimizer" in fixed else (
        [str(o) for o in t.optimizer] or [None])
    if t.global_batch is not None and int(t.global_batch) < 1:
        raise BadInput([Problem("tune.global_batch", t.global_batch, "must be at least 1 image per optimizer step",
                                "tune.global_batch=16, or tune.global_batch=null (free)")])
    levers: list[tuple[tuple[str, str], ...]] = [()]
    for group in LEVERS:
        options = [fixed[group]] if group in fixed else [str(o) for o in t[group]]
        levers = [(*chosen, (group, option)) for chosen in levers for option in options] if options else levers
    cells = []
    for lev in levers:
        # A cell's data groups: the ranks over its context size (each group one sample stream)
        data = max(1, ranks // max(1, int(dict(lev).get("context", 1))))
        cells += [Cell(z, o, m, a, c, opt, lev) for z in zeros for o in offloads
                  for m, a in _pairs(t, micros, data, accumulation) for c in ckpts for opt in optimizers]
    if not cells:
        makeable = sorted({m * ranks * a for m in micros for a in (1, 2, 4, 8)})
        nearest = min(makeable, key=lambda g: abs(g - int(t.global_batch)))
        raise BadInput([Problem("tune.global_batch", t.global_batch,
                                f"no micro batch of {micros} x accumulation x {ranks} rank(s) makes it (each "
                                f"micro batch x {ranks} must divide it)",
                                f"tune.global_batch={nearest} (or one of {makeable}), or tune.global_batch=null")])
    from ds_trainer.tools.plan import CELLS, FSDP_CELLS

    order = CELLS + FSDP_CELLS  # fastest first; FSDP's cells after DeepSpeed's

    def rung(c: Cell) -> int:
        return order.index((c.zero, c.offload)) if (c.zero, c.offload) in order else len(order)
    return sorted(cells, key=lambda c: (c.ckpt, rung(c), -c.micro))


def _pairs(t: DictConfig, micros: list[int], data: int, accumulation: int) -> list[tuple[int, int]]:
    """(micro batch, accumulation) of each micro batch that makes tune.global_batch on `data`
    data groups (every micro batch, at the training's accumulation, when it is free)."""
    if t.global_batch is None:
        return [(m, accumulation) for m in micros]
    images = int(t.global_batch)
    return [(m, images // (m * data)) for m in micros if images % (m * data) == 0]


def measure_overrides(t: DictConfig, logger: str, name: str) -> list[str]:
    """The overrides every cell runs with: a short run, no checkpoints, every step logged."""
    out = [f"train.max_steps={int(t.warmup_steps) + int(t.timed_steps)}", "train.export=false",
           "train.final_checkpoint=false", "train.checkpoint_every=0", "train.log_every=1", "resume=null"]
    return out + ([f"logger.group=tune-{name}"] if logger == "wandb" else [])


def vram_budget(t: DictConfig, info: Any) -> float | None:
    """Bytes per GPU a cell or trial may use: tune.vram_gib, else the detected GPU's memory less
    tune.margin; None without a GPU (nothing is pruned)."""
    if t.vram_gib is not None:
        if float(t.vram_gib) <= 0:
            raise BadInput([Problem("tune.vram_gib", t.vram_gib, "must be > 0 GiB",
                                    "tune.vram_gib=24")])
        return float(t.vram_gib) * GIB
    if info.gpu_memory_mib:
        return float(info.gpu_memory_mib * 2**20 * (1 - float(t.margin)))
    return None


def predict(cfg: DictConfig, factor: float) -> Any:
    """The planner's estimate of a checked config's peak per rank (its `gpu` bytes)."""
    from ds_trainer.config import ds_config
    from ds_trainer.tools import plan

    zero = ds_config.zero_option(cfg)
    offload = "none" if cfg.resolved.optimizer_state_on == "gpu" else (
        cfg.offload.device.value if zero == "stage3" else "cpu")
    return plan.estimate(cfg, zero, offload, int(cfg.resolved.world_size), factor)


def plan_cells(cells: list[Cell], compose: Any, base: list[str], budget: float | None, info: Any,
               factor: float) -> None:
    """Drop the invalid cells, predict the others' peak per rank, prune those above the budget."""
    from ds_trainer.config import checks

    for cell in cells:
        report = checks.check(compose(base + cell.overrides()), info)
        if not report.ok:
            cell.status, cell.message = "invalid", first_problem(report.render())
            continue
        e = predict(report.cfg, factor)
        cell.predicted_gib, cell.predicted_activation = e.gpu / GIB, e.activations
        cell.result["estimate"] = e
        if budget is not None and e.gpu > budget:
            cell.status = "pruned"
            cell.message = f"planner: {e.gpu / GIB:.2f} GiB per rank > budget {budget / GIB:.2f} GiB"


def nothing_fits(cells: list[Cell], budget: float) -> BadInput:
    """The error when the planner prunes every cell: the closest one and what it needs."""
    closest = min((c for c in cells if c.predicted_gib is not None), key=lambda c: c.predicted_gib or 0.0)
    need = closest.predicted_gib or 0.0
    return BadInput([Problem("tune.vram_gib", round(budget / GIB, 2),
                             f"no cell fits: the closest, {closest.label} ({' '.join(closest.overrides())}), needs "
                             f"about {need:.2f} GiB per rank", f"tune.vram_gib={need * 1.1:.2f}, or a smaller "
                             "resolution, or more ranks (world_size)")])


def winner(cells: list[Cell], budget: float | None) -> Cell | None:
    """The most images/s among the cells that trained and fit (a measured GPU peak above the budget does not)."""
    for c in cells:
        peak = c.result.get("summary", {}).get("gpu_mem_peak_allocated_mib")
        if c.status == "ok" and budget is not None and peak and peak * 2**20 > budget:
            c.status, c.message = "over budget", f"measured {peak / 1024:.2f} GiB > budget {budget / GIB:.2f} GiB"
    ok = [c for c in cells if c.status == "ok" and c.result.get("images_per_s")]
    return max(ok, key=lambda c: c.result["images_per_s"]) if ok else None
