"""Sweeps: the named sweeps in `sweeps/`, failed cells that do not stop a sweep, and the sweep's end.

`python -m ds_trainer +sweep=zero_offload` loads `sweeps/zero_offload.yaml` (registered here as the
`sweep` group, merged at the root); it sets `hydra.mode: MULTIRUN`, so no `-m` is needed.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ds_trainer import SWEEPS_DIR
from ds_trainer.config import ds_config

log = logging.getLogger("ds_trainer")


def register() -> None:
    """Each `sweeps/<name>.yaml` becomes the option `+sweep=<name>`."""
    store = ConfigStore.instance()
    for path in sorted(SWEEPS_DIR.glob("*.yaml")):
        store.store(group="sweep", name=path.stem, node=OmegaConf.load(path), package="_global_")


def failed_cell(cfg: DictConfig, run_dir: Path, status: str, message: str) -> None:
    """Record a cell that did not train (invalid config, crash) so the report lists it."""
    from ds_trainer.config.checks.resolve import world_size_of
    from ds_trainer.config.rundir import write_json

    summary = {"status": status, "message": message, "zero": ds_config.zero_option(cfg),
               "offload": cfg.offload.device.value,
               "resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
               "micro_batch_size": int(cfg.train.micro_batch_size),
               "gradient_accumulation_steps": int(cfg.train.gradient_accumulation_steps),
               "gradient_checkpointing": bool(cfg.train.gradient_checkpointing), "precision": cfg.precision.name.value,
               "optimizer": str(cfg.optimizer.name),
               "world_size": world_size_of(cfg), "model": cfg.model.name}
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "summary.json").exists():  # a cell that trained wrote a fuller one
        write_json(run_dir / "summary.json", summary)


def run_cell_process(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> None:
    """Run one cell of a local sweep in a fresh process, as a plain run in the cell's folder.

    A process per cell isolates what a benchmark measures (peak memory, CUDA allocator state after an
    out-of-memory error) and gives every cell a clean process group.
    """
    cmd = [sys.executable, "-m", "ds_trainer", *overrides, "hydra.mode=RUN", f"hydra.run.dir={run_dir}"]
    if not any(o.startswith("logger.group=") for o in overrides):
        cmd.append(f"logger.group={cfg.logger.group}")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    tail: deque[str] = deque(maxlen=40)
    for line in proc.stderr:
        sys.stderr.write(line)
        tail.append(line)
    code = proc.wait()
    if code == 0:
        return
    text = "".join(tail)
    report = re.search(r"^ds_trainer: \d+ problems? in the configuration.*", text, flags=re.M | re.S)
    if code == 2 and report:
        from ds_trainer.config.problems import first_problem

        message = first_problem(report.group(0))
    else:
        message = next((line.strip() for line in reversed(tail) if line.strip()), f"exit status {code}")
    failed_cell(cfg, run_dir, "error", message)


def failures(sweep_dir: Path) -> tuple[int, int]:
    """(failed, total) cells of a finished sweep, from their summary.json files."""
    from ds_trainer.launch import report

    statuses = [r.get("status") for r in report.rows(sweep_dir)]
    return sum(1 for s in statuses if s != "ok"), len(statuses)


def previewed(sweep_dir: Path) -> None:
    """A dry run's end: how many cells composed (their run files written, nothing trained) and each refused one with
    its message; the exit status is the number of refused cells (a sweep's: its failed cells')."""
    from ds_trainer.launch import report

    table = report.rows(sweep_dir)
    refused = [(label, row) for label, row in zip(report.labels(table), table, strict=True)
               if row.get("status") == "error"]
    lines = [f"ds_trainer: dry run of a sweep: {len(table) - len(refused)} of {len(table)} cells composed (their "
             f"run files under {sweep_dir}; nothing trained), {len(refused)} refused"
             + (":" if refused else "")]
    lines += [f"  {label}: {row.get('message')}" for label, row in refused]
    print("\n".join(lines), file=sys.stderr, flush=True)
    if refused:
        raise SystemExit(min(len(refused), 255))


class SweepEnd(Callback):
    """At the end of a multirun: write the report, and exit with the number of failed cells."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:  # noqa: ARG002 - Hydra's callback signature
        from ds_trainer.config import distributed
        from ds_trainer.launch import report

        if not distributed.is_main():
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        if config.get("dry_run"):
            previewed(sweep_dir)
            return
        out = report.write(sweep_dir)
        failed, total = failures(sweep_dir)
        print(f"ds_trainer: sweep finished, {total - failed} of {total} cells ok, {failed} failed; "
              f"report: {out['md']}", file=sys.stderr, flush=True)
        (sweep_dir / "sweep_status.json").write_text(json.dumps({"failed": failed, "total": total}))
        if failed:
            raise SystemExit(min(failed, 255))
