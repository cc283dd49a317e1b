"""Checkpoints: collective saves that never look complete before they are, keep-last-K, and finding
the checkpoint to resume from.

A save goes into `checkpoints/.step_N.partial/` (every rank writes its DeepSpeed shards there); after
a barrier rank 0 writes `COMPLETE` with the trainer state and renames the folder to `step_N`. A crash
at any moment leaves either the previous checkpoints untouched or a `.partial` folder nobody resumes from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import portability, rundir, trust
from ds_trainer.errors import TrainingError
from ds_trainer.train.state import disk, integrity

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

log = logging.getLogger(__name__)

MARKER = "COMPLETE"


def fingerprint(cfg: DictConfig) -> str:
    """What makes two runs the same experiment for `resume=latest`: model, data, resolution, seed.

    ZeRO stage, offload, world size and step counts may differ between a run and its resume.
    """
    keys: dict[str, Any] = {k: OmegaConf.to_container(cfg[k], resolve=True)
                            for k in ("model", "data", "resolution")}
    # The frozen expert beside the trained one (expert=both's second phase: the first's, in its
    # own run folder) is not what trains: the same experiment whichever run trained it.
    (keys["model"].get("video") or {}).pop("other_expert", None)
    keys["seed"] = int(cfg.train.seed)
    if cfg.adapter.method.value != "none":  # a LoRA never resumes from a full fine-tune's checkpoint, or another rank's
        a = cfg.adapter
        adapter: list[Any] = [a.method.value, int(a.rank), int(a.alpha), list(a.targets)]
        keys["adapter"] = adapter + ([int(a.factor)] if a.method.value == "lokr" else [])  # LoKr's factor: its shapes
    shape = portability.text_encoders_shape(cfg)
    if shape is not None:  # trained text encoders: another experiment (absent otherwise, as before they existed)
        keys["text_encoders"] = shape
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete(path: Path) -> dict[str, Any] | None:
    """The trainer state of a complete checkpoint folder, or None."""
    marker = path / MARKER
    if not path.is_dir() or path.name.startswith(".") or not marker.is_file():
        return None
    try:
        state = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return None  # damaged, or not a marker this code wrote
    return state


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    found = []
    for path in root(run_dir).glob("step_*"):
        state = complete(path)
        if state is not None:
            found.append((int(state["step"]), path))
    return sorted(found)


def find_resume(cfg: DictConfig, run_dir: Path, say: bool = True) -> Path | None:
    """The checkpoint `resume` names: a folder, or for `latest` the newest complete checkpoint of
    this run directory (a requeued job) or else of the newest earlier run of the same experiment;
    `say`: log what it continues from (the run's own call; the checks' is quiet)."""
    own = _own(run_dir, str(cfg.resume), say)
    if cfg.resume is None:
        # A requeued job (preemption, time limit) runs again in its own run directory: continue there.
        if own and say:
            log.warning("continuing from %s: this run directory already holds checkpoints (a requeued job)", own)
        return own
    if cfg.resume != "latest":
        path = Path(cfg.resume)
        if complete(path) is None:
            said = "damaged or not ds_trainer's" if (path / MARKER).exists() else "missing"
            raise _resume_error(str(cfg.resume), f"not a complete ds_trainer checkpoint (its "
                                f"{MARKER} marker is {said})")
        if (why := damaged(path)) is not None:
            raise _resume_error(str(cfg.resume), f"the checkpoint is damaged: {why}")
        return path
    if own:
        return own
    mine = fingerprint(cfg)
    candidates = []
    outputs = Path(cfg.paths.outputs)  # a run's; a run in phases' (<run>/experts/high/checkpoints)
    for marker in [*outputs.glob(f"runs/*/*/checkpoints/step_*/{MARKER}"),
                   *outputs.glob(f"runs/*/*/*/*/checkpoints/step_*/{MARKER}")]:
        state = complete(marker.parent)
        if state is not None and state.get("fingerprint") == mine:
            candidates.append((marker.stat().st_mtime, int(state["step"]), marker.parent))
    if not candidates:
        if say:
            log.warning("resume=latest: no complete checkpoint of this experiment under %s; starting from "
                        "step 0", cfg.paths.outputs)
        return None
    return newest_intact([c[2] for c in sorted(candidates)], say)


def _own(run_dir: Path, resume: str, say: bool) -> Path | None:
    """The newest intact checkpoint of the run folder itself; a folder whose every checkpoint is
    damaged is refused (starting over there would write its steps a second time)."""
    own = [p for _, p in checkpoints(run_dir)]
    intact = newest_intact(own, say)
    if own and intact is None and resume in ("None", "latest"):
        why = damaged(own[-1])
        raise _resume_error(resume, f"every checkpoint of this run folder {run_dir} is damaged "
                            f"({own[-1].name}: {why}); starting over there would write its steps "
                            "a second time (they are kept for you to look at)")
    return intact


# --- integrity: COMPLETE records each file's size and content hash; a resume checks them first


def record_files(folder: Path) -> dict[str, Any]:
    """What the marker records of the folder's files (see train/integrity.py)."""
    return integrity.manifest(folder, skip=frozenset({MARKER}))


def damaged(path: Path) -> str | None:
    """Why a complete checkpoint can no longer be loaded (a file truncated or changed), or None."""
    state = complete(path)
    return None if state is None else integrity.damage(path, state)


def newest_intact(paths: list[Path], say: bool = True) -> Path | None:
    """The newest of `paths` (oldest first) that is not damaged; each damaged one is named in the log."""
    for path in reversed(paths):
        why = damaged(path)
        if why is None:
            return path
        if say:
            log.warning("skipping the damaged checkpoint %s: %s; using an earlier one", path, why)
    return None


def _resume_error(value: str, why: str) -> Exception:
    from ds_trainer.config.problems import ConfigError, Problem, Report

    report = Report(OmegaConf.create(), [Problem("resume", value, why,
                                                 "resume=latest (the newest intact checkpoint) or resume=<another "
                                                 "checkpoint folder>")])
    return ConfigError(report.render())


def _not_running(path: Path | None, run_dir: Path) -> Path | None:
    """Refuse to resume from the checkpoints of a run that still trains (train/run.lock): both would
    write checkpoints of one experiment and log to one W&B run."""
    from ds_trainer.config import runlock

    source = path.parent.parent if path is not None else None
    if source is not None and source.resolve() != run_dir.resolve() and (held := runlock.holder(source)):
        raise _resume_error(str(path), f"its run {source} is still training ({runlock.describe(held)})")
    return path


def resume_point(cfg: DictConfig, run_dir: Path, accelerator: Any) -> Path | None:
    """`find_resume` on the main process, its answer (or its refusal, raised on every rank) everywhere."""
    from ds_trainer.config.problems import ConfigError
    from ds_trainer.train.backends import accelerator as accel

    answer: tuple[Path | None, str | None] = (None, None)
    if accelerator.is_main_process:
        try:
            answer = (_not_running(find_resume(cfg, run_dir), run_dir), None)
        except ConfigError as exc:
            answer = (None, str(exc))
    path, refusal = accel.from_main(accelerator, answer)
    if refusal is not None:
        raise ConfigError(refusal)
    return path  # type: ignore[no-any-return]


def save(accelerator: Any, run_dir: Path, step: int, state: dict[str, Any], keep: int,
         write: Callable[[Path], None]) -> Path:
    """Collective: every rank calls it, and `write(folder)` (the backend's state, the portable state, the EMA) into
    the folder being saved. Returns the completed checkpoint folder."""
    final = root(run_dir) / f"step_{step:08d}"
    partial = root(run_dir) / f".step_{step:08d}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        write(partial)
    except Exception as exc:
        if not disk.is_full(exc, partial.parent):
            raise
        shutil.rmtree(partial, ignore_errors=True)  # give the space back; it never looked complete
        raise TrainingError(disk.message(exc, partial.parent, f"saving the step-{step} checkpoint",
                                         intact(run_dir))) from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        rundir.follow_umask(partial)  # safetensors writes its files readable by the owner alone
        # Signed: this user's run wrote it (config/trust.py).
        marker = trust.signed({**state, "step": step, **record_files(partial)})
        (partial / MARKER).write_text(json.dumps(marker, indent=2))
        _fsync_dir(partial)
        os.replace(partial, final)
        for _, old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class Saver:
    """When the recipe saves: every `train.checkpoint_every` steps, every `train.checkpoint_every_minutes` of wall
    time (what no signal handler can save, kill -9 or a lost node, then loses at most that), at the last step
    (unless `train.final_checkpoint=false`) and when the ranks agreed to stop. Collective, like `save`."""

    def __init__(self, run: Run, last: Path | None, on_save: Callable[[], None] | None = None,
                 also: Callable[[Path, int], None] | None = None) -> None:
        cfg, accelerator = run.cfg, run.accelerator
        self.accelerator, self.run_dir, self.ema, self.last, self.also = accelerator, run.run_dir, run.ema, last, also
        # `accelerator.save_state` arguments (a LoRA leaves frozen weights out), and what to do after a save.
        self.save_kwargs, self.on_save = run.trained.save_kwargs(run), on_save
        self.every, self.keep = int(cfg.train.checkpoint_every), int(cfg.train.checkpoints_to_keep)
        self.every_s = float(cfg.train.checkpoint_every_minutes) * 60
        self.since = time.monotonic()
        self.final = int(cfg.train.max_steps) if cfg.train.final_checkpoint else None
        self.state = {"backend": run.backend.name, "stage": int(cfg.zero.stage),
                      "world_size": accelerator.num_processes, "fingerprint": fingerprint(cfg),
                      "wandb_id": run.tracker.wandb_id,
                      "layout": portability.layout(cfg)}  # checked at a resume when there is no portable state

    def due(self) -> bool:
        """Whether the wall-time interval has passed (asked on rank 0; the step's all-reduce tells the others)."""
        return bool(self.every_s) and time.monotonic() - self.since >= self.every_s

    def after_step(self, step: int, stopping: bool, due: bool = False) -> None:
        """Save if this step is one to save at; `due`: the ranks agreed the wall-time interval has passed."""
        if step == self.final or (self.every and step % self.every == 0) or stopping or due:
            self.since = time.monotonic()
            extra = {"ema": self.ema.state_dict()} if self.ema is not None else {}  # collective
            self.last = save(self.accelerator, self.run_dir, step, self.state, self.keep,
                             lambda folder: self._write(folder, step, extra))
            if self.on_save is not None:
                self.on_save()

    def _write(self, folder: Path, step: int, extra: dict[str, Any]) -> None:
        """Collective: the backend's own state (`accelerator.save_state`), then `also` (the portable state); rank 0
        writes `extra` (the EMA) as `<name>.pt`."""
        import torch

        self.accelerator.save_state(str(folder), **(self.save_kwargs or {}))
        if self.also is not None:
            self.also(folder, step)
        if self.accelerator.is_main_process:
            for name, value in extra.items():
                torch.save(value, folder / f"{name}.pt")


def intact(run_dir: Path) -> str | None:
    """The name of the newest completed checkpoint of the run (what resume=latest continues from), or None."""
    saved = checkpoints(run_dir)
    return saved[-1][1].name if saved else None


def _fsync_dir(path: Path) -> None:
    """Flush the folder's files before the rename makes the checkpoint visible as complete."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
