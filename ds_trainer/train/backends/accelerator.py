"""The Accelerator of a run, set up for its backend, and the collectives its parts use.

Each backend passes every plugin field explicitly, so `ACCELERATE_*` environment variables and a stale
`~/.cache/huggingface/accelerate/default_config.yaml` cannot leak into a run.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.accelerate_file import mixed_precision

if TYPE_CHECKING:
    from ds_trainer.train.backends import Backend


def make_accelerator(cfg: DictConfig, backend: Backend, platform_kind: str, run_dir: Path) -> Any:
    """The Accelerator of a training run, set up for `backend`.

    Without CUDA, Accelerate leaves the process-group backend unset and then counts a single
    process; DeepSpeed's CPU accelerator, CPU DDP and FSDP2 on the CPU all communicate over gloo, so it is set here.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    # On GPUs the collectives time out after an hour instead of NCCL's 10 minutes: rank 0 alone hashes a resumed
    # checkpoint (77 GB for SDXL with its portable state and EMA) or writes one while the others wait.
    group = process_group(platform_kind, backend.host_collectives)
    handlers: list[Any] = [InitProcessGroupKwargs(backend=group)] if platform_kind == "cpu" else \
        [InitProcessGroupKwargs(backend=group, timeout=datetime.timedelta(minutes=60))]
    kwargs, more = backend.accelerator_kwargs(platform_kind)
    wandb = cfg.logger.name.value == "wandb" and cfg.logger.mode.value != "disabled"
    with console.stdout_to_log("Accelerate's set-up"):  # DeepSpeed prints that its CPU comm op loaded
        accelerator = Accelerator(mixed_precision=mixed_precision(cfg), kwargs_handlers=[*handlers, *more],
                                  log_with="wandb" if wandb else None,
                                  project_config=ProjectConfiguration(project_dir=str(run_dir)),
                                  step_scheduler_with_optimizer=False, **kwargs)
    console.adopt()  # DeepSpeed (imported by now) logs through the run's handlers
    backend.after_accelerator(accelerator, platform_kind)
    return accelerator


def process_group(platform_kind: str, host_collectives: bool) -> str | None:
    """The torch.distributed backend of a run: gloo without CUDA; on GPUs NCCL (Accelerate's default, None), and
    beside it gloo for CPU tensors where the backend reduces some (`Backend.host_collectives`: FSDP2's CPU offload
    clips and gathers host-resident shards). A plain "nccl" group maps the "cuda" device alone, so a collective on
    a CPU tensor fails with "No backend type associated with device type cpu"; Accelerate adds gloo itself only
    under `accelerate launch` (FSDP_OFFLOAD_PARAMS), not under torchrun, srun or `python -m ds_trainer`."""
    if platform_kind == "cpu":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else None


def prepare(accelerator: Any, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
    """`accelerator.prepare` of the trained module, its optimizer and (if any) its LR schedule."""
    if scheduler is None:
        model, optimizer = accelerator.prepare(model, optimizer)
        return model, optimizer, None
    return accelerator.prepare(model, optimizer, scheduler)  # type: ignore[no-any-return]


def from_main(accelerator: Any, value: Any) -> Any:
    """`value` as the main process has it, on every process (a collective)."""
    from accelerate.utils import broadcast_object_list

    if accelerator.num_processes == 1:
        return value
    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]


def any_rank(accelerator: Any, flag: bool) -> bool:
    """Whether `flag` holds on any process (a collective: every rank calls it)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), reduction="sum").item() > 0)
