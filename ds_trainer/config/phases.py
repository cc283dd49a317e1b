"""A run in phases, which a family's spec asks for (`FamilySpec.phases`: Wan 2.2 A14B's
`model.video.expert=both`, the high-noise expert's run, then the low-noise one's): each phase is a
run of its own in a subfolder of the run's (`<run>/experts/high`), one after the other in one
command and one process, its config the run's with the phase's overrides. Here: the phases of a
config, each one's config, which are done (by an earlier launch of the same command), which phase a
checkpoint continues, and the run's summary of its phases. Torch-free."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import families
from ds_trainer.config.families.spec import Phase
from ds_trainer.config.rundir import write_yaml

NOT_STARTED = "not started"


def of(cfg: DictConfig) -> list[Phase]:
    """The run's phases, in order; [] for a run of one (and for `cache_only`: the phases share the
    latent cache, built once)."""
    if cfg.get("cache_only"):
        return []
    return families.of(cfg).phases(cfg)


def config(cfg: DictConfig, phase: Phase, run_dir: Path, resume: str | None) -> DictConfig:
    """The phase's config: the run's as composed, with the phase's overrides (`{run}`: the run's
    folder) and `resume` (what this phase continues from)."""
    out = copy.deepcopy(cfg)
    for key, value in phase.overrides.items():
        given = value.format(run=run_dir) if isinstance(value, str) else value
        OmegaConf.update(out, key, given, merge=False)
    out.resume = resume
    return out


def overrides(phase: Phase, run_dir: Path) -> list[str]:
    """The phase's overrides on a command line (appended to the run's, they train the phase
    alone)."""
    return [f"{key}={str(value).format(run=run_dir)}" for key, value in phase.overrides.items()]


def describe(cfg: DictConfig, phases: list[Phase], run_dir: Path) -> str:
    """The log's line: what trains in which phase, where."""
    each = "; then ".join(f"{p.name} in {run_dir / p.folder} ({', '.join(overrides(p, run_dir))})"
                          for p in phases)
    return (f"{cfg.model.name} trains in {len(phases)} phases, one after the other in this "
            f"process, each train.max_steps={cfg.train.max_steps} steps: {each}; the run's folder "
            "then joins their exports (the last phase's samples and pipeline hold every phase's "
            "trained module)")


def done(cfg: DictConfig, folder: Path) -> bool:
    """Whether the phase's folder holds its finished run (summary.json ok) of the same length (an
    earlier launch of this command); a longer train.max_steps continues it."""
    summary = read_summary(folder)
    try:
        written = yaml.safe_load((folder / "config.yaml").read_text())
        steps = int(written["train"]["max_steps"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return False
    return summary.get("status") == "ok" and steps == int(cfg.train.max_steps)


def located(phases: list[Phase], checkpoint: Path) -> tuple[int, Path] | None:
    """The phase whose folder holds `checkpoint` (`<run>/<phase folder>/checkpoints/step_N`) and
    that run's folder; None for a checkpoint of no phase."""
    folder = checkpoint.absolute().parent.parent
    for k, phase in enumerate(phases):
        parts = Path(phase.folder).parts
        if folder.parts[-len(parts):] == parts:
            return k, folder.parents[len(parts) - 1]
    return None


def read_summary(folder: Path) -> dict[str, Any]:
    """A run folder's summary.json ({} when it has none)."""
    try:
        found = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def summary(run_dir: Path, phases: list[Phase]) -> dict[str, Any]:
    """The run's summary.json: the last phase that ran's (its loss, speed, memory: what a sweep's
    report reads), its status the first phase's that did not end ok, each phase's in `phases`."""
    rows: list[dict[str, Any]] = []
    last: dict[str, Any] = {}
    for phase in phases:
        own = read_summary(run_dir / phase.folder)
        last = own or last
        rows.append({"name": phase.name, "folder": phase.folder,
                     "status": own.get("status", NOT_STARTED), "steps": own.get("steps"),
                     "final_loss": own.get("final_loss"), "message": own.get("message")})
    failed = next((row for row in rows if row["status"] != "ok"), None)
    status, message = "ok", None
    if failed is not None:
        status = "error" if failed["status"] == NOT_STARTED else failed["status"]
        message = f"phase {failed['name']}: {failed['message'] or failed['status']}"
    return {**last, "status": status, "message": message, "phases": rows}


def write_overrides(folder: Path, given: list[str], phase: Phase, run_dir: Path) -> None:
    """The phase's `.hydra/overrides.yaml`: the run's command line and the phase's own overrides
    (what trains the phase alone; the model card quotes it)."""
    own = [o for o in given if o.split("=", 1)[0].lstrip("+~") not in phase.overrides]
    (folder / ".hydra").mkdir(parents=True, exist_ok=True)
    write_yaml(folder / ".hydra" / "overrides.yaml", [*own, *overrides(phase, run_dir)])
