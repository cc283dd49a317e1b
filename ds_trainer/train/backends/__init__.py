"""How the trained module is sharded and stepped: DeepSpeed ZeRO (`deepspeed.py`), FSDP2 (`fsdp.py`) or plain data
parallel (`ddp.py`), each behind `Backend`. `of` picks one per run; outside this package no code asks which runs.

Tensor-level helpers a part may need whatever the backend (whole values of FSDP's DTensors: `sharded.py`; ZeRO-3's
NVMe swap: `nvme_swap.py`) live beside them, as do the Accelerator set-up and its collectives (`accelerator.py`).
Nothing here imports torch, DeepSpeed or Accelerate at module level: a DDP run never loads DeepSpeed.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from omegaconf import DictConfig

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole


class Backend(Protocol):
    """What differs between the backends, called by the recipe and its parts at named points."""

    name: str  # "deepspeed" | "fsdp" | "ddp": config.yaml's resolved.backend
    init_label: str  # the start-up mark of `prepare` ("DeepSpeed init")
    fused: bool  # whether torch's fused optimizer kernels may step it (not FSDP's DTensor shards)
    host_collectives: bool  # whether it reduces CPU tensors on a GPU machine (FSDP2's CPU offload): gloo beside NCCL

    def start_process(self) -> None:
        """Before anything is imported: where this environment's compiled ops live."""

    def accelerator_kwargs(self, platform_kind: str) -> tuple[dict[str, Any], list[Any]]:
        """The Accelerator's keyword arguments and extra kwargs handlers for this backend."""

    def after_accelerator(self, accelerator: Any, platform_kind: str) -> None:
        """Checks and fixes once the Accelerator exists (FSDP2 on a CPU process)."""

    def whole(self, accelerator: Any) -> AbstractContextManager[None]:
        """Inside, models are built whole (not partitioned by ZeRO-3's zero.Init): the frozen parts, a planner's."""

    def before_build(self, accelerator: Any) -> None:
        """Before the data and models load: what the backend needs ready (NVMe swap's op and folders)."""

    def own_optimizer(self, params: list[Any]) -> tuple[Any, Any] | None:
        """Where the backend builds the optimizer and LR schedule itself (DeepSpeed from its JSON), the placeholders
        `prepare` takes for them; None where ds_trainer builds them (train/optim/build.py)."""

    def before_prepare(self, model: Any) -> None:
        """The module as it must be when `prepare` shards it (FSDP2 bf16_pure: cast to bf16)."""

    def prepare(self, accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        """`accelerator.prepare` of the trained module, optimizer and (if any) schedule."""

    def masters_from_cast(self, resuming: bool) -> bool:
        """Whether `prepare` builds the fp32 masters from a 16-bit cast of the module (DeepSpeed in bf16/fp16),
        so that the loaded fp32 weights must be written into them after it."""

    def compute_dtype(self, model: Any) -> Any:
        """The dtype the family's loss gets its inputs in."""

    def clip(self, accelerator: Any, model: Any, limit: float) -> Any:
        """Inside the step's last micro-batch: clip the gradients to `limit` (inf: measure only); returns the norm
        where it is measured here (None where the optimizer step clips, as DeepSpeed's does)."""

    def grad_norm(self, accelerator: Any, measured: Any) -> float | None:
        """The step's gradient norm: `measured` by `clip`, or the engine's."""

    def owns_schedule(self, accelerator: Any) -> bool:
        """Whether the backend's engine steps and saves the run's LR schedule (else the recipe registers it)."""

    def engine(self, accelerator: Any) -> Any:
        """DeepSpeed's engine, or None: where the fp32 masters live apart from the module's parameters."""

    def params(self, accelerator: Any) -> Whole:
        """How a parameter is laid out under this backend (`params.py`): its whole shape, this
        rank's share, its whole value and fp32 master, read or set; the object every part asks
        instead of the parameter's attributes."""

    def keep_trainable_only(self, accelerator: Any) -> dict[str, Any]:
        """Checkpoints of a module with frozen parameters keep the trainable ones only: the `save_state` keyword
        arguments that say so (or a save hook registered here)."""

    def load(self, accelerator: Any, path: Path, partial: bool) -> None:
        """The native load of a checkpoint folder, and what the backend's own load leaves out."""


def of(cfg: DictConfig, ds: dict[str, Any] | None) -> Backend:
    """The run's backend: DeepSpeed from its JSON `ds`, else FSDP2 or DDP as `resolved.backend` says."""
    if ds is not None:
        from ds_trainer.train.backends.deepspeed import DeepSpeed

        return DeepSpeed(cfg, ds)
    if cfg.resolved.backend == "fsdp":
        from ds_trainer.train.backends.fsdp import FSDP

        return FSDP(cfg)
    from ds_trainer.train.backends.ddp import DDP

    return DDP(cfg)
