"""Resuming a run, in one place: `Resume.find` (rank 0 decides what to resume from and tells the others), then
`before_prepare` (the carried fp32 weights into the module, and under DeepSpeed in 16 bits the loaded weights held
for its masters) and `load` (after `prepare`: DeepSpeed's, FSDP's or Accelerate's native load, bit-exact; or under
another layout the checkpoint's portable state, `carry.py`; the LR schedule, the EMA, the data position).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import trust
from ds_trainer.train.state import carry, checkpoint, portable

if TYPE_CHECKING:
    from ds_trainer.train.backends import Backend
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")


class Resume:
    """What this run resumes from (`path`, None for a fresh start) and how."""

    def __init__(self, cfg: DictConfig, path: Path | None, native: bool = True) -> None:
        self.cfg, self.path = cfg, path
        self.saved: dict[str, Any] = (checkpoint.complete(path) or {}) if path else {}
        # Under another layout than the checkpoint's (stage, offload, ranks, batch split), or
        # from a checkpoint this user's runs did not write (`native` false: config/trust.py),
        # its portable state carries over; otherwise the backend's native load.
        self.carry = carry.Carry(cfg, path, native)
        self.exact: carry.Exact | None = None

    @classmethod
    def find(cls, cfg: DictConfig, run_dir: Path, accelerator: Any) -> Resume:
        """Rank 0 decides what to resume from and tells the others: ranks looking at the file system at different
        moments could otherwise disagree and then load different checkpoints."""
        from ds_trainer.train.backends import accelerator as accel

        path = checkpoint.resume_point(cfg, run_dir, accelerator)
        native = trust.native_allowed(cfg, path) if accelerator.is_main_process else None
        return cls(cfg, path, bool(accel.from_main(accelerator, native)))

    def describe(self) -> dict[str, Any]:
        """What this run continues from, for summary.json: the checkpoint, its run folder, its
        step, the layout it was saved under, and how it loads (native, or carried through its
        portable state)."""
        assert self.path is not None
        how = "portable state" if self.carry.changed else "native"
        return {"checkpoint": str(self.path), "run_dir": str(self.path.parent.parent),
                "step": self.saved.get("step"), "layout": self.saved.get("layout"), "load": how,
                "why": "; ".join(self.carry.changes) if self.carry.changed else None}

    @property
    def wandb_id(self) -> str | None:
        return self.saved.get("wandb_id")

    @property
    def step(self) -> int | None:
        return self.saved.get("step")

    def before_prepare(self, model: torch.nn.Module, backend: Backend) -> None:
        """The carried fp32 weights into the (not yet prepared) module; and where `prepare` builds the fp32 masters
        from a 16-bit cast, the loaded weights held to be written into them (`carry.Exact`)."""
        self.carry.before_prepare(model)
        self.exact = carry.Exact(backend.masters_from_cast(self.path is not None), model)

    def load(self, run: Run) -> tuple[int, int]:
        """Collective, after `prepare`: whatever this run continues from put in place; returns (the step to continue
        after, the samples seen by then)."""
        cfg = self.cfg
        if self.exact is not None:
            self.exact.after_prepare(run)
            self.exact = None
        native = not self.carry.changed
        after_native_load = _register_schedule(run, self.path if native else None)
        if not native:
            step = self.carry.after_prepare(run)
        else:
            step = self._native(run)
            if self.path is not None:
                after_native_load(self.path)
                self.carry.after_native_load()
        batch = int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps)
        return self.carry.start(step, batch * run.mesh.data_world)

    def _native(self, run: Run) -> int:
        """The backend's own load of the checkpoint; returns the step it was saved at (0: a fresh start)."""
        if self.path is None:
            return 0
        run.backend.load(run.accelerator, self.path, run.trained.partial)
        step = int(self.saved["step"])
        if run.ema is not None and (self.path / "ema.pt").exists():
            # Memory-mapped: each rank reads the pages of its own slice, not the whole EMA.
            run.ema.load_state_dict(portable.saved_state(self.path / "ema.pt", "EMA", mmap=True))
        log.info("resumed from %s at step %d", self.path, step)
        return step


def _register_schedule(run: Run, native_from: Path | None) -> Any:
    """Where the backend's engine does not own the LR schedule (DDP and FSDP step one of DeepSpeed's classes, which
    Accelerate neither takes for a scheduler nor saves; the per-group schedules under every backend), it is registered
    as a checkpoint object. Returns what to do after a native load: put the LR of the resumed position into the
    optimizer (from the registered object, or for a checkpoint written before it was registered, from its portable
    state)."""
    scheduler, accelerator = run.scheduler, run.accelerator
    if scheduler is None or run.backend.owns_schedule(accelerator):
        return lambda _: None
    registered = native_from is None or (native_from / "custom_checkpoint_0.pkl").exists()
    if registered:
        accelerator.register_for_checkpointing(scheduler)

    def after_load(folder: Path) -> None:
        if not registered:
            saved = folder / "portable" / "scheduler.pt"
            if saved.exists():
                scheduler.load_state_dict(portable.scheduler_state(saved))
            accelerator.register_for_checkpointing(scheduler)  # saved with every checkpoint from now on
        scheduler.step(scheduler.last_batch_iteration)  # the LR of the resumed position
    return after_load
