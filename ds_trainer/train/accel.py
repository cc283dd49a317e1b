"""Accelerate wiring: the only module that imports `accelerate`, and only inside functions.

Every DeepSpeedPlugin field is passed explicitly, so `ACCELERATE_*` environment variables and a stale
`~/.cache/huggingface/accelerate/default_config.yaml` cannot leak into a run.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.accelerate_file import mixed_precision


def deepspeed_plugin(cfg: DictConfig, ds: dict[str, Any]) -> Any:
    """A DeepSpeedPlugin for `ds` with every field explicit (nothing read from the environment)."""
    from accelerate.utils import DeepSpeedPlugin

    zero = ds["zero_optimization"]
    offload_optimizer = zero.get("offload_optimizer", {})
    offload_param = zero.get("offload_param", {})
    return DeepSpeedPlugin(
        hf_ds_config=ds,
        gradient_accumulation_steps=ds["gradient_accumulation_steps"],
        gradient_clipping=ds["gradient_clipping"],
        zero_stage=zero["stage"],
        is_train_batch_min=True,
        offload_optimizer_device=offload_optimizer.get("device", "none"),
        offload_param_device=offload_param.get("device", "none"),
        offload_optimizer_nvme_path=offload_optimizer.get("nvme_path", "none"),
        offload_param_nvme_path=offload_param.get("nvme_path", "none"),
        zero3_init_flag=zero["stage"] == 3,
        zero3_save_16bit_model=bool(zero.get("stage3_gather_16bit_weights_on_model_save", False)),
        # None, not "": Accelerate would look for a layer class named "" (a UNet has no MoE layers).
        transformer_moe_cls_names=None,
        enable_msamp=False,
        msamp_opt_level="O1",
    )


def make_accelerator(cfg: DictConfig, ds: dict[str, Any] | None, platform_kind: str, run_dir: Path) -> Any:
    """The Accelerator of a training run: DeepSpeed from `ds`, or plain DDP when `ds` is None.

    Without CUDA, Accelerate leaves the process-group backend unset and then counts a single
    process; DeepSpeed's CPU accelerator and CPU DDP both communicate over gloo, so it is set here.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration

    # On GPUs the collectives time out after an hour instead of NCCL's 10 minutes: rank 0 alone hashes a resumed
    # checkpoint (77 GB for SDXL with its portable state and EMA) or writes one while the others wait.
    handlers: list[Any] = [InitProcessGroupKwargs(backend="gloo")] if platform_kind == "cpu" else \
        [InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=60))]
    kwargs: dict[str, Any] = {}
    if ds is not None:
        kwargs["deepspeed_plugin"] = deepspeed_plugin(cfg, ds)
    else:
        kwargs["gradient_accumulation_steps"] = int(cfg.train.gradient_accumulation_steps)
        kwargs["cpu"] = platform_kind == "cpu"
        # DDP's buckets are the gradients instead of a second copy of them (4 bytes a parameter: 10 GB for SDXL).
        handlers.append(DistributedDataParallelKwargs(gradient_as_bucket_view=True))
    wandb = cfg.logger.name.value == "wandb" and cfg.logger.mode.value != "disabled"
    with console.stdout_to_log("Accelerate's set-up"):  # DeepSpeed prints that its CPU comm op loaded
        accelerator = Accelerator(mixed_precision=mixed_precision(cfg), kwargs_handlers=handlers,
                                  log_with="wandb" if wandb else None,
                                  project_config=ProjectConfiguration(project_dir=str(run_dir)),
                                  step_scheduler_with_optimizer=False, **kwargs)
    console.adopt()  # DeepSpeed (imported by now) logs through the run's handlers
    return accelerator


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
