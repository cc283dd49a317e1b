"""What a tune leaves in its folder: tune.md, tune.csv, tune.png, winner.txt, ds_config.json, the preset."""

from __future__ import annotations

import csv
import io
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from ds_trainer.tools.plan.calibration import Calibration
from ds_trainer.tools.tune.space import GIB, LEVERS, Cell, override_key

COLUMNS = ("cell", "zero", "offload", "micro_batch_size", "gradient_accumulation_steps",
           "gradient_checkpointing", "optimizer", "adapter", "quantize", "compile", "context", "status",
           "predicted_peak_gib", "measured_peak_gib", "measure", "s_per_it", "images_per_s", "compile_s",
           "val_loss", "load_before", "load_after", "others", "message")


def columns(cells: list[Cell]) -> tuple[str, ...]:
    """The table's columns: `val_loss` only when cells ran to the end with `validation=on` (a tune's cells are
    short; with validation off, or cells stopped at their time limit, there is no value to show, and none is made
    up); `adapter`, `quantize` and `compile` only when the tune searched them, `compile_s` (the seconds a cell
    compiled, not in its s/it) with `compile`."""
    searched = {lever for cell in cells for lever, _ in cell.levers}
    return tuple(c for c in COLUMNS if (c != "val_loss" or any(row(cell)["val_loss"] is not None for cell in cells))
                 and (c not in LEVERS or c in searched) and (c != "compile_s" or "compile" in searched))


@dataclass
class Context:
    """What every output of a tune is written from."""

    cfg: DictConfig
    base: list[str]
    budget: float | None
    ranks: int
    calibration: Calibration
    tune_dir: Path
    info: Any


def measured_gib(cell: Cell) -> tuple[float | None, str]:
    """The measured peak per rank: the GPU's allocated peak, or on a CPU what the training loop added."""
    summary = cell.result.get("summary", {})
    if summary.get("gpu_mem_peak_allocated_mib"):
        return summary["gpu_mem_peak_allocated_mib"] / 1024, "gpu allocated"
    if summary.get("host_rss_loop_peak_mib") is not None and summary.get("host_rss_loop_start_mib") is not None:
        return (summary["host_rss_loop_peak_mib"] - summary["host_rss_loop_start_mib"]) / 1024, "host RSS of the loop"
    return None, ""


def row(cell: Cell) -> dict[str, Any]:
    """The cell's row of tune.csv and tune.md."""
    peak, measure = measured_gib(cell)
    r = cell.result
    return {"cell": cell.label, "zero": cell.zero, "offload": cell.offload, "micro_batch_size": cell.micro,
            "gradient_accumulation_steps": cell.accum, "gradient_checkpointing": cell.ckpt,
            "optimizer": cell.optimizer or "", **{g: dict(cell.levers).get(g, "") for g in LEVERS},
            "status": cell.status,
            "predicted_peak_gib": cell.predicted_gib, "measured_peak_gib": peak, "measure": measure,
            "s_per_it": r.get("s_per_it"), "images_per_s": r.get("images_per_s"),
            "compile_s": r.get("summary", {}).get("compile_s"),
            "val_loss": r.get("summary", {}).get("val_loss") if cell.status == "ok" else None,
            "load_before": r.get("load_before"), "load_after": r.get("load_after"),
            "others": "; ".join(r.get("others") or []), "message": cell.message}


def winning_line(ctx: Context, best: Cell) -> list[str]:
    """The training overrides of the winner, as a user runs them."""
    return [o for o in ctx.base if not override_key(o).startswith("hydra.")] + best.overrides()


def preset(ctx: Context, best: Cell, line: list[str]) -> str:
    """The winner as an experiment preset: group choices in its defaults list, the rest as values."""
    speed = best.result.get("images_per_s") or 0
    head = f"the fastest cell that fit, {best.label}, {speed:.2f} images/s measured on {ctx.info.kind}"
    return preset_text(ctx.cfg, line, head)


def preset_text(cfg: DictConfig, line: list[str], what: str) -> str:
    """A training line as a preset: group choices in its defaults list, the rest as values."""
    from omegaconf import OmegaConf

    from ds_trainer import CONF_DIR

    defaults, values = [], OmegaConf.create({})
    for override in line:
        key, value = override.split("=", 1)
        name = key.lstrip("+")
        if "." not in name and (CONF_DIR / name).is_dir():
            defaults.append({f"override /{name}" if not key.startswith("+") else f"/{name}": value})
        elif not key.startswith("~"):
            OmegaConf.update(values, name, yaml.safe_load(value), force_add=True)
    head = (f"# @package _global_\n# Written by python -m ds_trainer.tune: {what}.\n"
            f"# Apply: {apply_line(cfg)}\n")
    rest = OmegaConf.to_container(values)
    assert isinstance(rest, dict)
    body = {"defaults": defaults, **rest} if defaults else rest
    return head + yaml.safe_dump(body, sort_keys=False)


def preset_path(cfg: DictConfig) -> tuple[Path, list[str]]:
    """Where the preset goes and the extra overrides that make Hydra find it there: by default with the outputs
    (`<paths.outputs>/presets`, on conf/config.yaml's search path), never in the source checkout."""
    from ds_trainer.config import rundir

    default = rundir.presets_dir(str(cfg.paths.outputs), argv=[])
    root = Path(str(cfg.tune.preset_dir)).expanduser().absolute() if cfg.tune.preset_dir else default
    outputs = str(cfg.paths.outputs)
    extra = [f"hydra.searchpath=[file://{root}]"] if root != default else [] if outputs == "outputs" else \
        [f"paths.outputs={outputs}"]
    return root / "experiment" / f"{cfg.tune.name}.yaml", extra


def write_preset(cfg: DictConfig, text: str, tune_dir: Path) -> Path:
    """The preset where `+experiment=<tune.name>` finds it, and a copy in the tune folder."""
    path, _ = preset_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    (tune_dir / f"{cfg.tune.name}.yaml").write_text(text)
    return path


def apply_line(cfg: DictConfig) -> str:
    """The command that trains with the preset."""
    extra = preset_path(cfg)[1]
    return f"python -m ds_trainer {' '.join([*extra, f'+experiment={cfg.tune.name}'])}"


def chart(ctx: Context, cells: list[Cell], best: Cell | None, path: Path) -> None:
    """tune.png: each cell's memory against its images/s, the winner marked."""
    from ds_trainer.launch.report import memory_speed

    points = []
    for c in cells:
        peak, _ = measured_gib(c)
        points.append({"label": c.label, "status": c.status, "images_per_s": c.result.get("images_per_s"),
                       "memory": peak if peak is not None else c.predicted_gib, "winner": c is best})
    measured = any(measured_gib(c)[1] == "gpu allocated" for c in cells)
    xlabel = "peak GPU memory per rank (GiB, measured)" if measured else \
        "memory per rank (GiB): host RSS the loop added (CPU), else the planner's prediction"
    memory_speed(points, path, xlabel, ctx.budget / GIB if ctx.budget and measured else None,
                 f"tune {ctx.cfg.model.name} {ctx.cfg.resolution.width}x{ctx.cfg.resolution.height}")


def markdown(ctx: Context, cells: list[Cell], best: Cell | None) -> str:
    """tune.md: the overrides, budget, winner and every cell."""
    from ds_trainer.launch.report import fmt

    budget = f"{ctx.budget / GIB:.2f} GiB per rank" if ctx.budget else "none (no GPU; nothing pruned)"
    lines = [f"# Tune {ctx.cfg.tune.name}", "", f"Training overrides: `{' '.join(ctx.base) or '(none)'}`; "
             f"{ctx.ranks} rank(s); budget {budget}; global batch "
             f"{ctx.cfg.tune.global_batch if ctx.cfg.tune.global_batch is not None else 'free'}.",
             f"Planner: {ctx.calibration.describe()}.", ""]
    if best is not None:
        lines += [f"**Winner: {best.label}**, {best.result['images_per_s']:.2f} images/s, "
                  f"{best.result['s_per_it']:.3f} s/it.", "", "```", "python -m ds_trainer "
                  + " ".join(winning_line(ctx, best)), "```", ""]
    table, shown = [row(c) for c in cells], columns(cells)
    lines += ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in shown) + " |" for r in table]
    lines += ["", "![memory against images/s](tune.png)", ""]
    return "\n".join(lines)


def to_wandb(ctx: Context, cells: list[Cell]) -> None:
    """The cells as a W&B table, when the logger is W&B."""
    logger = ctx.cfg.logger
    if logger.name.value != "wandb" or logger.mode.value == "disabled":
        return
    import wandb

    run = wandb.init(project=logger.project, entity=logger.entity, mode=logger.mode.value,
                     group=f"tune-{ctx.cfg.tune.name}", name=f"tune {ctx.cfg.tune.name}", job_type="tune",
                     dir=str(ctx.tune_dir))
    shown = columns(cells)
    run.log({"tune": wandb.Table(columns=list(shown), data=[[row(c)[k] for k in shown] for c in cells])})
    run.finish()


def write(ctx: Context, cells: list[Cell], best: Cell | None, final: bool = False) -> dict[str, Path]:
    """Write (again) every output; the winner's line, ds_config.json and preset once there is one."""
    d = ctx.tune_dir
    out = {"md": d / "tune.md", "csv": d / "tune.csv", "png": d / "tune.png", "winner": d / "winner.txt"}
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(cells), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(row(c) for c in cells)
    out["csv"].write_text(buf.getvalue())
    chart(ctx, cells, best, out["png"])
    out["md"].write_text(markdown(ctx, cells, best))
    if best is None:
        return out
    line = winning_line(ctx, best)
    out["winner"].write_text(" ".join(line) + "\n")
    ds_json = Path(best.result.get("run_dir", "")) / "ds_config.json"
    if ds_json.is_file():
        shutil.copyfile(ds_json, d / "ds_config.json")
    if final:
        out["preset"] = write_preset(ctx.cfg, preset(ctx, best, line), d)
        to_wandb(ctx, cells)
    return out


def announce(ctx: Context, best: Cell, out: dict[str, Path]) -> str:
    """What the user reads at the end: the winner, the line to paste, the preset command."""
    return "\n".join([
        f"tune: winner {best.label}: {best.result['images_per_s']:.2f} images/s, {best.result['s_per_it']:.3f} s/it",
        "  python -m ds_trainer " + " ".join(winning_line(ctx, best)),
        f"  or: {apply_line(ctx.cfg)}",
        f"  report: {out['md']} (ds_config.json, tune.csv, tune.png beside it); preset: {out.get('preset')}"])
