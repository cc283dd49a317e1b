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
from ds_trainer.errors import TrainingError


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


def fsdp_plugin(cfg: DictConfig, platform_kind: str) -> Any:
    """A FullyShardedDataParallelPlugin (FSDP2) with every field explicit: a field left None is read from the
    `FSDP_*` environment, and one set that FSDP2 does not use warns or raises."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    meaning = cfg.resolved.fsdp
    compute = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}.get(meaning.compute_dtype, "float32"))
    reduce = getattr(torch, {"bf16": "bfloat16"}.get(meaning.reduce_dtype, "float32"))
    # Pinned host memory needs an accelerator; a CPU-only build fails with "Cannot access accelerator device".
    offload = CPUOffloadPolicy(pin_memory=platform_kind != "cpu" and bool(cfg.offload.pin_memory)) \
        if cfg.offload.device.value == "cpu" else OffloadPolicy()
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=bool(meaning.reshard_after_forward),
        # The compute dtype of the forward and backward; the sharded fp32 parameters stay the masters.
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, output_dtype=compute,
                                                    cast_forward_inputs=True),
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(meaning.units),
        cpu_offload=offload,
        ignored_modules=[],
        state_dict_type="SHARDED_STATE_DICT",  # torch.distributed.checkpoint: reshards on load, any world size
        activation_checkpointing=False,  # the UNet's own gradient checkpointing (it keeps parameter names)
        activation_checkpointing_offload=False,
        cpu_ram_efficient_loading=False,
        min_num_params=0,
    )


def _fsdp_on_cpu(accelerator: Any, plugin: Any) -> None:
    """Accelerate never selects FSDP for a CPU process (it gives DDP, silently); FSDP2 itself runs on gloo. Set
    the distributed type in both places Accelerate reads it (else a later AcceleratorState() reverts it), as
    Accelerate 1.14-1.15 keep them; `make_accelerator` then checks that FSDP2 is what runs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


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
    fsdp = cfg.resolved.backend == "fsdp"
    plugin = fsdp_plugin(cfg, platform_kind) if fsdp else None
    if ds is not None:
        kwargs["deepspeed_plugin"] = deepspeed_plugin(cfg, ds)
    elif fsdp:
        from accelerate.utils import GradientAccumulationPlugin

        # Gradients reduce-scattered after every micro-batch: no full unsharded gradient kept between them
        # (Accelerate's no_sync would keep one per rank, the whole UNet's in the reduce dtype).
        kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(
            num_steps=int(cfg.train.gradient_accumulation_steps), sync_each_batch=True)
        if platform_kind == "cpu":
            kwargs["cpu"] = True
        else:
            kwargs["fsdp_plugin"] = plugin
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
    if fsdp:
        if platform_kind == "cpu":
            _fsdp_on_cpu(accelerator, plugin)
        if not accelerator.is_fsdp2:
            raise TrainingError(f"zero={cfg.zero.backend.value}: Accelerate set up {accelerator.distributed_type} "
                                "instead of FSDP2; check the accelerate version (pip install -c constraints.txt "
                                "accelerate) and unset ACCELERATE_* variables")
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
