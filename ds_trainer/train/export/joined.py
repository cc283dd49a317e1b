"""What a run in phases (config/phases.py: Wan 2.2 A14B's `model.video.expert=both`) leaves in its
own folder, from its phases' folders, on rank 0: `summary.json` (each phase's status; the last
one's figures) and, once every phase ended ok, their exports joined as one model's: each phase's
trained module in its pipeline slot (`<run>/transformer` and `<run>/transformer_2`, their EMA),
each phase's LoRA and single-file folders under its name (`<run>/lora/high/`,
`<run>/single_file/low/model.safetensors`), the last phase's samples and pipeline (which hold
every phase's trained module), and the model card. Files are hard links to the phases' own
(copies where the file system has none)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig

from ds_trainer.config import families, phases
from ds_trainer.config.families.spec import Phase
from ds_trainer.config.rundir import follow_umask, write_json
from ds_trainer.train.export import card

log = logging.getLogger("ds_trainer")

# A phase's folders that the run's folder holds under the phase's name; the last phase's, as is.
BY_PHASE = ("lora", "lora_ema", "single_file")
FROM_LAST = ("pipeline", "samples")


def finish(cfg: DictConfig, run_dir: Path, phased: list[Phase]) -> None:
    """The run's summary.json from its phases' (however they ended), after the joined export when
    every phase ended ok; the closing lines on the terminal."""
    summary = phases.summary(run_dir, phased)
    if summary["status"] == "ok" and cfg.train.export:
        try:
            join(cfg, run_dir, phased)
        except OSError as exc:
            summary.update(status="error", message=f"joining the phases' exports: {exc}")
    write_json(run_dir / "summary.json", summary)
    each = ", ".join(f"{row['name']} {row['status']} ({row['steps'] or 0} steps, {row['folder']})"
                     for row in summary["phases"])
    say = log.info if summary["status"] == "ok" else log.error
    say("ds_trainer: %s: the phases %s; %s", summary["status"], each,
        summary["message"] or f"their exports joined in {run_dir}")


def join(cfg: DictConfig, run_dir: Path, phased: list[Phase]) -> None:
    """The phases' exports in the run's folder (see the module's docstring), and its model card."""
    component = families.of(cfg).component
    for phase in phased:
        folder = run_dir / phase.folder
        for suffix in ("", "_ema"):
            link(folder / f"{component}{suffix}", run_dir / f"{phase.slot}{suffix}")
        for name in BY_PHASE:
            link(folder / name, run_dir / name / phase.name)
    last = run_dir / phased[-1].folder
    for name in FROM_LAST:
        link(last / name, run_dir / name)
    if cfg.export.card:
        facts, validations = card.facts_of(last)
        (run_dir / "README.md").write_text(card.text(cfg, run_dir, facts, validations))
    phase_roots = {Path(p.folder).parts[0] for p in phased}  # the phases follow it themselves
    follow_umask(run_dir, skip=frozenset({"checkpoints", *phase_roots}))
    log.info("the phases' exports joined in %s: %s", run_dir,
             ", ".join(f"{p.name}'s trained {component} as {p.slot}" for p in phased))


def link(source: Path, target: Path) -> None:
    """`target` made the same files as `source` (a file or a folder; nothing when it is absent),
    replacing what was there (a join again, after a phase continued)."""
    if not source.exists():
        return
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    for file in files:
        placed = target if file == source else target / file.relative_to(source)
        placed.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(file, placed)
        except OSError:  # another file system, or one without hard links
            shutil.copy2(file, placed)
