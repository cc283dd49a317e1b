"""What every part of a training run reads, built once by the recipe's setup (`recipe.setup`): the config, the
Accelerator, the backend and the model family (each resolved once), the run's folder and tracker, the frozen parts,
and once prepared the trained module, its optimizer, LR schedule and EMA. A plain record: no behaviour."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from ds_trainer.train.adapters.adapter import Trained
    from ds_trainer.train.backends import Backend
    from ds_trainer.train.backends.mesh import Mesh
    from ds_trainer.train.backends.params import Whole
    from ds_trainer.train.families import Family
    from ds_trainer.train.observe.metrics import Tracker
    from ds_trainer.train.state.ema import EMA


@dataclass
class Run:
    """One training run's shared parts. `model` is the trained module (a UNet, a transformer, or either with the
    trained text encoders), prepared by the backend; `trained` says what of it trains (whole, LoRA)."""

    cfg: DictConfig
    accelerator: Any
    backend: Backend
    family: Family
    run_dir: Path
    tracker: Tracker
    kind: str  # the platform: "cuda", "cpu", ...
    frozen: Any = None
    trained: Trained = None  # type: ignore[assignment]
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    ema: EMA | None = None
    # What samples, validation and exports run in: schedule-free AdamW's evaluation weights, else nothing.
    eval_weights: Callable[[], contextlib.AbstractContextManager[Any]] = field(default=contextlib.nullcontext)

    @property
    def mesh(self) -> Mesh:
        """The ranks as data x context (parallel.context): the data's coordinates of this rank."""
        from ds_trainer.train.backends.mesh import Mesh

        return Mesh.of(self.cfg, self.accelerator)

    @property
    def params(self) -> Whole:
        """How the backend lays the parameters out (`Backend.params`)."""
        return self.backend.params(self.accelerator)
