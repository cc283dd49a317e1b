"""The tune's course: compose, plan, measure each cell (or reuse its earlier result), record, write outputs."""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config.problems import Problem
from ds_trainer.tools.plan import calibration
from ds_trainer.tools.tune import cell as tune_cell
from ds_trainer.tools.tune import outputs as tune_out
from ds_trainer.tools.tune.space import MEASURE_KEYS, BadInput, Cell, override_key


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose

    return compose(config_name="config", overrides=overrides)


def _calibration(cfg: DictConfig, info: Any, base: list[str], state: Path) -> calibration.Calibration:
    """The planner's calibration at the tune's first start: a resumed tune keeps it, so the records its own
    first cells added do not change which cells it prunes half-way."""
    if state.exists():
        saved = json.loads(state.read_text())
        if saved.get("base") == base:
            return calibration.Calibration(**saved["calibration"])
    return calibration.for_config(cfg, info)


def _previous(cell_dir: Path, overrides: list[str]) -> dict[str, Any] | None:
    """The cell's earlier result, if it was measured with exactly these overrides."""
    path = cell_dir / "tune_cell.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record if record.get("overrides") == overrides else None


def _record(cfg: DictConfig, cell: Cell, device: str) -> dict[str, Any] | None:
    """The calibration record of a measured cell (None when the run shows no usable measure)."""
    estimate = cell.result.get("estimate")
    if cell.status != "ok" or estimate is None:
        return None
    measured, measure = calibration.measured_activation(cell.result.get("summary", {}), estimate)
    if measured is None:
        return None
    return {**calibration.key(cfg, device), "cell": cell.name, "resolution": f"{cfg.resolution.width}x"
            f"{cfg.resolution.height}", "micro_batch_size": cell.micro, "gradient_checkpointing": cell.ckpt,
            "zero": cell.zero, "offload": cell.offload, "optimizer": cell.optimizer or str(cfg.optimizer.name),
            "measure": measure,
            "predicted_activation_bytes": int(estimate.activations / max(cell.result.get("factor", 1.0), 1e-9)),
            "measured_activation_bytes": measured, "predicted_peak_bytes": estimate.gpu, "time": time.time()}


def _measure(cell: Cell, cfg: DictConfig, cmd: list[str], tune_dir: Path, device: str) -> None:
    tune_cell.raise_if_stopped()  # a stop that fell in a finalizer: no next cell
    t = cfg.tune
    cell_dir = tune_dir / "cells" / cell.name
    earlier = _previous(cell_dir, cmd)
    if earlier is not None:
        cell.status, cell.message = earlier["status"], earlier.get("message")
        cell.result.update({k: v for k, v in earlier.items() if k not in ("status", "message")})
        print(f"tune: {cell.label}: {cell.status} (measured before, not run again)", file=sys.stderr, flush=True)
        return
    if cell_dir.exists():  # a cell cut short (the tune was killed) starts again from an empty folder
        shutil.rmtree(cell_dir)
    print(f"tune: {cell.label}: running (predicted {cell.predicted_gib or 0:.2f} GiB per rank)", file=sys.stderr,
          flush=True)
    result = tune_cell.run(cmd, cell_dir, t.launcher, float(t.time_limit_s), int(t.warmup_steps))
    cell.status, cell.message = result.pop("status"), result.pop("message")
    cell.result.update(result)
    record = _record(cfg, cell, device)
    if record is not None:
        calibration.append(str(cfg.plan.calibration), record)
        cell.result["measured_activation_bytes"] = record["measured_activation_bytes"]
        cell.result["measure"] = record["measure"]
    saved = {k: v for k, v in cell.result.items() if k != "estimate"}
    (cell_dir / "tune_cell.json").write_text(json.dumps({"overrides": cmd, "status": cell.status,
                                                         "message": cell.message, **saved}, indent=2))
    speed = f", {cell.result['images_per_s']:.2f} images/s" if cell.result.get("images_per_s") else ""
    print(f"tune: {cell.label}: {cell.status}{speed}" + (f" ({cell.message})" if cell.message else ""),
          file=sys.stderr, flush=True)


def tune(argv: list[str], doc: str | None = None) -> int:
    """The whole tune; the package docstring says how it goes (quality.py's, with
    tune.objective=quality)."""
    from hydra import initialize_config_dir

    from ds_trainer import CONF_DIR
    from ds_trainer.config import overrides, rundir, schema
    from ds_trainer.tools.tune import axes, quality

    schema.register()
    rundir.register_resolvers()
    base, found, refused = axes.split(argv)
    # A mistake in the overrides (Hydra's own included): the one screen, exit 2.
    cfg = overrides.compose_checked(base, doc)
    quality_tune = cfg.tune.objective.value == "quality"
    if not quality_tune and (found or refused):
        key, value = (found[0].key, found[0].given) if found else (refused[0].key, refused[0].value)
        raise BadInput([Problem(key, value, "several values are the quality tune's axes (the speed tune "
                                "searches tune.zero, tune.offload, tune.micro_batch_size, ...)",
                                f"tune.objective=quality, or one value: {key}=<value>")])
    if refused:
        raise BadInput(refused)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), tune_cell.terminate_as_exit():
        if quality_tune:
            return quality.tune(argv, base, found)
        return _tune(argv)


def _tune(argv: list[str]) -> int:
    from ds_trainer.config import hardware
    from ds_trainer.config.checks import resolve
    from ds_trainer.tools.tune import space as tn

    base, fixed = tn.split_overrides(argv)
    compose = _compose
    cfg = compose(argv)
    t, info = cfg.tune, hardware.detect(cfg.platform.value)
    ranks = resolve.world_size_of(cfg)
    budget = tn.vram_budget(t, info)
    cells = tn.space(t, fixed, ranks, int(cfg.train.gradient_accumulation_steps))
    tune_dir = Path(str(t.dir)).absolute()
    calibrated = _calibration(cfg, info, base, tune_dir / "tune_state.json")
    tn.plan_cells(cells, compose, base, budget, info, calibrated.factor)
    for c in cells:
        c.result["factor"] = calibrated.factor
    if all(c.status == "invalid" for c in cells):
        raise BadInput([Problem("tune", "the search space", f"every cell is invalid, e.g. {cells[0].label}: "
                                f"{cells[0].message}", "fix the training overrides, or widen tune.zero/tune.offload")])
    if budget is not None and not any(c.status == "planned" for c in cells):
        raise tn.nothing_fits(cells, budget)
    tune_dir.mkdir(parents=True, exist_ok=True)
    (tune_dir / "tune_state.json").write_text(json.dumps({"base": base, "calibration": asdict(calibrated)}))
    measure = [o for o in base if not override_key(o).startswith(MEASURE_KEYS)] + tn.measure_overrides(
        t, cfg.logger.name.value, str(t.name))
    ctx = tune_out.Context(cfg, base, budget, ranks, calibrated, tune_dir, info)
    print(f"tune: {sum(c.status == 'planned' for c in cells)} of {len(cells)} cells to measure "
          f"({sum(c.status == 'pruned' for c in cells)} pruned by the planner, "
          f"{sum(c.status == 'invalid' for c in cells)} invalid); {calibrated.describe()}; folder {tune_dir}",
          file=sys.stderr, flush=True)
    device = calibration.device_kind(info)
    for cell in cells:
        if cell.status != "planned":
            continue
        _measure(cell, cfg, measure + cell.overrides(), tune_dir, device)
        tune_out.write(ctx, cells, tn.winner(cells, budget))
    best = tn.winner(cells, budget)
    out = tune_out.write(ctx, cells, best, final=True)
    if best is None:
        print(f"tune: no cell trained; see {out['md']}", file=sys.stderr)
        return 1
    print(tune_out.announce(ctx, best, out))
    return 0
