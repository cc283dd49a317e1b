"""How a run ended, and what that means for the process: the failure policy of the recipe in one place.

Every ending is recorded in `summary.json` first: `ok`, `interrupted` (a signal, Ctrl-C), `oom` (with what to try
next), `lost` (another node's rank died) or `error` (with its message). Then the process leaves as the ending says:
a stop raises `Stopped` with the signal's exit status (under submitit, SIGUSR2 requeues the job first), a user's
or a resource's failure raises `TrainingError` (no traceback), a bug re-raises.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import distributed
from ds_trainer.errors import Stopped, TrainingError
from ds_trainer.train.families import compiled
from ds_trainer.train.observe import metrics
from ds_trainer.train.process import oom, rendezvous, stop
from ds_trainer.train.process.stop import Interrupted
from ds_trainer.train.state import checkpoint, disk

log = logging.getLogger("ds_trainer")


@dataclass(frozen=True)
class Outcome:
    """A run's ending: its status, the message summary.json gives, and the exception behind it (None: ok)."""

    status: str = "ok"
    message: str | None = None
    failure: BaseException | None = None

    @classmethod
    def of(cls, exc: BaseException, cfg: DictConfig, kind: str, tracker: Any, run_dir: Path) -> Outcome:
        """The ending an exception out of the run means (every failure is classified; none escapes unrecorded)."""
        signum = stop.received()
        if isinstance(exc, Interrupted):
            return cls("interrupted", str(exc), exc)
        if signum is not None:
            # Ctrl-C outside the loop, or a collective broken by a rank that stopped at once: the run was stopped.
            return cls("interrupted", _stopped_message(signum, tracker, run_dir), exc)
        if oom.is_oom(exc):
            return cls("oom", oom.message(cfg, kind), exc)
        if rendezvous.peer_lost(exc):  # another node's rank died: the launcher brings the whole job back
            return cls("lost", rendezvous.lost_message(exc), exc)
        if isinstance(exc, TrainingError):
            return cls("error", str(exc), exc)
        if disk.is_full(exc, run_dir):  # a write anywhere in the run (a checkpoint's own says so itself)
            text = disk.message(exc, run_dir, _writing(exc, cfg, run_dir), checkpoint.intact(run_dir))
            return cls("error", text, TrainingError(text))
        return cls("error", f"{type(exc).__name__}: {exc}", exc)

    def summarize(self, cfg: DictConfig, accelerator: Any, tracker: Any, nodes: Any, run_dir: Path) -> dict[str, Any]:
        """summary.json's content, written (and its lines printed) by the main process."""
        world = accelerator.num_processes if accelerator is not None else int(cfg.resolved.world_size)
        rows = tracker.rows if tracker else []
        validation = None
        if tracker:
            validation = metrics.validation_summary(tracker.validations, tracker.earlier)
        summary = {**metrics.summarize(cfg, rows, self.status, self.message, world, nodes,
                                       validation),
                   **(tracker.facts if tracker else {}),
                   **({"compile_s": round(compiled.CLOCK.seconds, 3), "compilations": compiled.CLOCK.count}
                      if compiled.CLOCK.count else {})}
        if accelerator.is_main_process if accelerator is not None else distributed.is_main():
            metrics.write_summary(run_dir, summary)
            metrics.print_summary(summary, run_dir)
        return summary

    def leave(self, accelerator: Any, last: bool = True) -> None:
        """Leave as the ending says: return after a clean shutdown, or raise (see the module's
        docstring). `last`: no later run trains in this process (see `shutdown`)."""
        failure = self.failure
        if self.status == "interrupted":
            log.warning("%s", self.message)
            if isinstance(failure, Interrupted) and failure.stop is not None:
                failure.stop.forward()  # under submitit, SIGUSR2 requeues the job (and exits) from here
            raise Stopped(self.message or "", stop.exit_status(stop.received())) from None
        if failure is None:
            shutdown(accelerator, last)
        elif isinstance(failure, TrainingError):
            raise failure.with_traceback(None) from None  # its class says the exit status (InputError: 2)
        elif self.status in ("oom", "lost"):
            raise TrainingError(self.message or "") from None
        else:
            raise failure


@contextlib.contextmanager
def writing(run_dir: Path, what: str, folder: Path | None = None) -> Iterator[None]:
    """Inside, a write that finds the disk full (under `folder`, default the run directory) stops the run with the
    one-screen message saying `what` was being written; other failures pass through."""
    try:
        yield
    except Exception as exc:
        if not disk.is_full(exc, folder or run_dir):
            raise
        raise TrainingError(disk.message(exc, folder or run_dir, what, checkpoint.intact(run_dir))) from None


def _writing(exc: BaseException, cfg: DictConfig, run_dir: Path) -> str:
    """What the run was writing when the disk filled, from the file the error names."""
    target = disk.where(exc)
    if target is None:
        return "writing the run's files"
    target, run_dir = target.resolve(), run_dir.resolve()
    for folder, what in ((Path(str(cfg.data.cache_dir)).resolve(), "building the latent cache"),
                         (run_dir / "checkpoints", "saving a checkpoint"), (run_dir / "samples", "writing samples")):
        if target.is_relative_to(folder):
            return what
    return f"writing {target.relative_to(run_dir) if target.is_relative_to(run_dir) else target}"


def _stopped_message(signum: int, tracker: Any, run_dir: Path) -> str:
    done = tracker.rows[-1]["step"] if tracker is not None and tracker.rows else None
    saved = checkpoint.checkpoints(run_dir)
    last = saved[-1][1] if saved else None
    if done is None:
        return str(Interrupted(signum, 0, last, now=True))
    tail = f"; checkpoint {last}" if last else ""
    return f"stopped by {stop.name(signum)} after step {done} (the steps are done; what followed them was not){tail}"


def shutdown(accelerator: Any, last: bool = True) -> None:
    """Finish the trackers and destroy the process group (gloo threads left alive abort the exit).
    Before a later run in this process (`last` false: a run's next phase) the group stays, for that
    run's Accelerator to take as it is (no second rendezvous); the rest goes: the engine and the
    prepared objects, and Accelerate's state of this run (its DeepSpeed or FSDP plugin, the
    accumulation), which the next run's Accelerator sets up anew."""
    accelerator.wait_for_everyone()
    if last:
        accelerator.end_training()
        return
    import gc

    import torch
    from accelerate.state import AcceleratorState, GradientState

    for tracker in accelerator.trackers:
        tracker.finish()
    accelerator.free_memory()  # DeepSpeed's engine destroyed, the prepared objects let go
    # Accelerate's own way between two runs in one process (its tests')
    AcceleratorState._reset_state(reset_partial_state=False)  # noqa: SLF001
    GradientState._reset_state()  # noqa: SLF001
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
