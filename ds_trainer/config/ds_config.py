"""The DeepSpeed JSON, built from the composed config and the world size. Pure and torch-free.

Every value is written out: no "auto" (Accelerate cannot fill bucket sizes for a UNet, and
`train_batch_size` must equal micro batch x accumulation x world size exactly).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import nvme, optimizers, schema

# Keeps DeepSpeed's own periodic stdout logging out of the way; we log steps ourselves.
_STEPS_PER_PRINT = 2**31 - 1


def placement(cfg: DictConfig) -> tuple[str, str]:
    """Where DeepSpeed really keeps (optimizer state, parameters): `gpu`, `cpu` or `nvme`.

    Below stage 3, DeepSpeed keeps an NVMe-offloaded optimizer state in host memory (only stage 3
    swaps to disk) and never offloads parameters.
    """
    device, stage = str(cfg.offload.device.value), int(cfg.zero.stage)
    if device == "none" or cfg.zero.backend.value == "ddp" or stage == 0:
        return "gpu", "gpu"
    if cfg.zero.backend.value == "fsdp":  # CPUOffloadPolicy: all or nothing (config/checks refuses the rest)
        return device, device
    optimizer_on = device if stage == 3 else "cpu"
    params_on = device if stage == 3 and cfg.offload.params is not False else "gpu"
    return optimizer_on, params_on


def zero_option(cfg: DictConfig) -> str:
    """The `zero` option a config runs as: `ddp`, `stageN` or `fsdp_full_shard`/`fsdp_shard_grad_op` (after
    the config checks, any fallback included)."""
    return option_name(cfg.zero.backend.value, int(cfg.zero.stage))


def option_name(backend: str, stage: int | None) -> str:
    """The `zero` option of a backend and stage (as `config.yaml` records them)."""
    if backend == "ddp":
        return "ddp"
    if backend == "fsdp":
        return "fsdp_full_shard" if stage == 3 else "fsdp_shard_grad_op"
    return f"stage{stage}"


def warmup_steps(cfg: DictConfig) -> int:
    """The scheduler's warmup length: as set, else 10% of `train.max_steps` (at most 500)."""
    if cfg.scheduler.warmup_steps is not None:
        return int(cfg.scheduler.warmup_steps)
    return min(500, max(1, int(cfg.train.max_steps) // 10))


def optimizer_block(cfg: DictConfig) -> dict[str, Any]:
    """DeepSpeed's `optimizer` block (DDP builds the same torch optimizer from it)."""
    name, _ = optimizers.resolve(cfg.optimizer.name)
    if name is None:
        raise ValueError(f"unknown optimizer {cfg.optimizer.name!r}: run config.checks.check first")
    params: dict[str, Any] = {}
    for key in optimizers.PARAMS.get(name, ("lr", "weight_decay")):
        value = cfg.optimizer[key]
        if key == "betas":
            params[key] = [float(v) for v in value]
        else:
            params[key] = value if isinstance(value, bool) else int(value) if key == "slice_p" else float(value)
    return {"type": optimizers.DEEPSPEED_TYPE.get(name, name), "params": params}


def group_lrs(cfg: DictConfig) -> list[float]:
    """The peak LR of each optimizer parameter group: the UNet's, and with trained text encoders theirs
    (`text_encoders.lr`, None: the UNet's)."""
    lr = float(cfg.optimizer.lr)
    if not schema.trains_text_encoders(cfg):
        return [lr]
    te = cfg.text_encoders
    return [lr, lr if te.lr is None else float(te.lr)]


def _per_group(values: list[float]) -> float | list[float]:
    """One value for every group where they agree (as the JSON always had it), else one per group (DeepSpeed's
    schedules take a list, one entry per parameter group)."""
    return values[0] if len(set(values)) == 1 else values


def group_warmups(cfg: DictConfig) -> list[int]:
    """The warm-up length of each optimizer parameter group: the schedule's, and with trained text encoders
    `text_encoders.warmup_steps` (None: the schedule's), each at most `train.max_steps`."""
    total, warmup = int(cfg.train.max_steps), warmup_steps(cfg)
    if not schema.trains_text_encoders(cfg):
        return [min(warmup, total)]
    te = cfg.text_encoders
    return [min(warmup, total), min(warmup if te.warmup_steps is None else int(te.warmup_steps), total)]


def group_blocks(cfg: DictConfig) -> list[dict[str, Any]] | None:
    """When the parameter groups warm up over different lengths (`text_encoders.warmup_steps`): DeepSpeed's
    schedule block of each group alone (its peak, its warm-up; the rest of the schedule shared), which
    train/group_schedule.py runs side by side. None when one block serves every group (`scheduler_block`)."""
    warmups = group_warmups(cfg)
    if len(set(warmups)) == 1 or cfg.scheduler.name.value == "constant":
        return None
    lrs, base = group_lrs(cfg), float(cfg.optimizer.lr)
    return [_block(cfg, [lr], [lr / base], warmup) for lr, warmup in zip(lrs, warmups, strict=True)]


def scheduler_block(cfg: DictConfig) -> dict[str, Any] | None:
    """DeepSpeed's `scheduler` block, or None for a constant LR (and for groups that warm up apart: `group_blocks`).
    With trained text encoders at another LR every LR of the schedule is given per parameter group, scaled to the
    group's peak: the encoders follow the UNet's schedule (its warm-up and decay) at their own height.
    WarmupCosineLR scales each group's own LR by itself."""
    if cfg.scheduler.name.value == "constant" or group_blocks(cfg) is not None:
        return None
    lrs = group_lrs(cfg)
    return _block(cfg, lrs, [v / lrs[0] for v in lrs], group_warmups(cfg)[0])


def _block(cfg: DictConfig, lrs: list[float], scales: list[float], warmup: int) -> dict[str, Any]:
    """The block of a schedule whose groups peak at `lrs`, their floors `scheduler.warmup_min_lr` x `scales`."""
    name, total = cfg.scheduler.name.value, int(cfg.train.max_steps)
    lr = _per_group(lrs)
    s = cfg.scheduler
    if name == "warmup":
        params = {"warmup_min_lr": _per_group([float(s.warmup_min_lr) * v for v in scales]),
                  "warmup_max_lr": lr, "warmup_num_steps": warmup, "warmup_type": s.warmup_type}
        return {"type": "WarmupLR", "params": params}
    if name == "warmup_decay":
        params = {"warmup_min_lr": _per_group([float(s.warmup_min_lr) * v for v in scales]),
                  "warmup_max_lr": lr, "warmup_num_steps": warmup, "warmup_type": s.warmup_type,
                  "total_num_steps": total}
        return {"type": "WarmupDecayLR", "params": params}
    if name == "warmup_cosine":
        params = {"total_num_steps": total, "warmup_num_steps": warmup, "warmup_type": s.warmup_type,
                  "warmup_min_ratio": float(s.warmup_min_ratio), "cos_min_ratio": float(s.cos_min_ratio)}
        return {"type": "WarmupCosineLR", "params": params}
    if name == "one_cycle":
        half = max(1, total // 2)
        params = {"cycle_min_lr": _per_group([v * float(s.min_lr_ratio) for v in lrs]), "cycle_max_lr": lr,
                  "cycle_first_step_size": half, "cycle_second_step_size": max(1, total - half),
                  "cycle_momentum": False, "decay_lr_rate": 0.0}
        return {"type": "OneCycle", "params": params}
    raise ValueError(f"unknown scheduler {name!r}")


def _precision_blocks(cfg: DictConfig) -> dict[str, Any]:
    p = cfg.precision
    if p.name.value == "bf16":
        return {"bf16": {"enabled": True}}
    if p.name.value == "bf16_pure":  # ZeRO 1-3: bf16 masters, gradients and Adam moments (10 bytes a parameter)
        return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    if p.name.value == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": int(p.initial_scale_power),
                         "loss_scale_window": int(p.loss_scale_window), "hysteresis": int(p.hysteresis),
                         "min_loss_scale": float(p.min_loss_scale)}}
    return {}


def _offload_block(cfg: DictConfig, device: str, for_params: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"device": device, "pin_memory": bool(cfg.offload.pin_memory)}
    if device != "nvme":
        return block
    block["nvme_path"] = str(cfg.offload.nvme_path)
    if for_params:
        count, size = nvme.buffers(int(cfg.model.max_param_numel), int(cfg.zero.stage3_prefetch_bucket_size))
        block["buffer_count"] = int(cfg.offload.buffer_count or count)
        block["buffer_size"] = int(cfg.offload.buffer_size or size)
        block["max_in_cpu"] = 0
    else:
        block["buffer_count"] = int(cfg.offload.buffer_count or 4)
        # Not pipelined: train/nvme_swap.py mends the gradient read of the non-pipelined swapper only.
        block["pipeline_read"] = False
        block["pipeline_write"] = False
    return block


def _zero_block(cfg: DictConfig) -> dict[str, Any]:
    z, stage = cfg.zero, int(cfg.zero.stage)
    block: dict[str, Any] = {"stage": stage}
    if stage == 0:
        return block
    block.update(reduce_bucket_size=int(z.reduce_bucket_size), overlap_comm=bool(z.overlap_comm),
                 contiguous_gradients=bool(z.contiguous_gradients))
    if stage in (1, 2):
        block.update(allgather_partitions=bool(z.allgather_partitions), reduce_scatter=bool(z.reduce_scatter),
                     allgather_bucket_size=int(z.allgather_bucket_size),
                     round_robin_gradients=bool(z.round_robin_gradients))
    if stage == 3:
        block.update(reduce_scatter=bool(z.reduce_scatter),  # DeepSpeed's default (true); Muon needs it off
                     stage3_prefetch_bucket_size=int(z.stage3_prefetch_bucket_size),
                     stage3_param_persistence_threshold=int(z.stage3_param_persistence_threshold),
                     stage3_max_live_parameters=int(z.stage3_max_live_parameters),
                     stage3_max_reuse_distance=int(z.stage3_max_reuse_distance),
                     stage3_gather_16bit_weights_on_model_save=bool(z.stage3_gather_16bit_weights_on_model_save),
                     sub_group_size=int(z.sub_group_size))
    optimizer_on, params_on = placement(cfg)
    if optimizer_on != "gpu":
        # The effective device: below stage 3 an NVMe request is written as cpu, which is what
        # DeepSpeed does with it anyway (config/checks/resolve.py warns about it).
        block["offload_optimizer"] = _offload_block(cfg, optimizer_on, for_params=False)
    if params_on != "gpu":
        block["offload_param"] = _offload_block(cfg, params_on, for_params=True)
    return block


def aio_block() -> dict[str, Any]:
    """DeepSpeed's async I/O settings for NVMe swapping (its documented defaults, written out)."""
    return {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
            "single_submit": False, "overlap_events": True}


def build(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for `cfg` on `world_size` ranks; usable as is by
    `deepspeed.initialize`, the `deepspeed` launcher and Accelerate's DeepSpeedPlugin."""
    t = cfg.train
    micro, accum = int(t.micro_batch_size), int(t.gradient_accumulation_steps)
    ds: dict[str, Any] = {
        "train_batch_size": micro * accum * int(world_size),
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(t.gradient_clipping),
        "steps_per_print": _STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    name = optimizers.stepping(cfg.optimizer.name, cfg.precision.weight_update.value)
    if optimizers.is_client(name):
        # ds_trainer builds the optimizer and its LR schedule (train/recipe.py) and hands both to DeepSpeed. Under
        # offload DeepSpeed (and Accelerate before it) would replace a client optimizer by its CPU Adam: not here,
        # it steps where the offload puts the state, as named.
        if placement(cfg)[0] != "gpu":
            ds["zero_force_ds_cpu_optimizer"] = False
    else:
        ds["optimizer"] = optimizer_block(cfg)
        if OmegaConf.select(cfg, "resolved.torch_adam", default=False):
            # No nvcc matching torch here (config/checks/resolve.py said so): torch's AdamW instead of compiling
            # FusedAdam.
            ds["optimizer"]["params"]["torch_adam"] = True
        scheduler = scheduler_block(cfg)
        if scheduler is not None:
            ds["scheduler"] = scheduler
    ds.update(_precision_blocks(cfg))
    ds["zero_optimization"] = _zero_block(cfg)
    if "nvme" in placement(cfg):
        ds["aio"] = aio_block()
    return ds
