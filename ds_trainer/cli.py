"""`python -m ds_trainer`: compose, validate, write the run files, then train (or stop: dry run)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ds_trainer import CONF_DIR, accel, distributed, ds_config, rundir, schema, validation

log = logging.getLogger("ds_trainer")

schema.register()
rundir.register_resolvers()


def prepare(cfg: DictConfig, run_dir: Path) -> tuple[DictConfig, dict | None]:
    """Validate `cfg` and write the run files; exit with the report on a user mistake."""
    report = validation.check(cfg)
    if not report.ok:
        print(report.render(), file=sys.stderr)
        raise SystemExit(2)
    for warning in report.warnings:
        log.warning("%s", warning)
    cfg = report.cfg
    world_size = int(cfg.resolved.world_size)
    ds = ds_config.build(cfg, world_size) if cfg.resolved.backend == "deepspeed" else None
    ds_json = run_dir / "ds_config.json" if ds is not None else None

    if distributed.is_main():
        rundir.write_run_files(run_dir, cfg, ds, accel.config_file(cfg, ds_json, world_size))
    return cfg, ds


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.logger.group is None:
        cfg.logger.group = Path(hydra_cfg.sweep.dir).name  # a sweep's cells share a W&B group
    cfg, ds = prepare(cfg, run_dir)
    if cfg.dry_run:
        if ds is not None:
            print(json.dumps(ds, indent=2))
        else:
            print(f"zero=ddp: plain Accelerate data parallel, no DeepSpeed config ({cfg.resolved.platform})")
        print(f"run files written to {run_dir}", file=sys.stderr)
        return
    from ds_trainer import metrics, train

    name = metrics.run_name(list(hydra_cfg.overrides.task))
    try:
        train.run(cfg, ds, run_dir, name)
    except train.TrainingError:
        raise SystemExit(1) from None  # the run's summary, already printed, says what failed and why
