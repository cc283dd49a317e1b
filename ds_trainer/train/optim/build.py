"""The optimizers ds_trainer builds itself (every one under DDP and FSDP2; a client optimizer under DeepSpeed), with
DeepSpeed's LR schedule classes from the same config blocks, so one config owns every backend."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import ds_config, families, optimizers
from ds_trainer.config.checks import resolve
from ds_trainer.errors import TrainingError
from ds_trainer.train import backends
from ds_trainer.train.backends import inner
from ds_trainer.train.optim import group_schedule

log = logging.getLogger("ds_trainer")


def check_nonempty(cfg: DictConfig, params: list[Any]) -> None:
    """DeepSpeed and torch would fail later, on an empty flat buffer or an empty parameter group."""
    if not params:
        what = families.of(cfg).module_label
        raise TrainingError(f"optimizer={cfg.optimizer.name}: the {what} has no parameter left to train "
                            f"(adapter={cfg.adapter.method.value} froze them all); nothing was trained. Check "
                            "adapter.targets, or adapter=none for a full fine-tune")


def for_run(cfg: DictConfig, backend: backends.Backend, params: list[Any]) -> tuple[Any, Any]:
    """The optimizer and LR schedule handed to the backend's `prepare`: its own placeholders (DeepSpeed's from its
    JSON), or the optimizer the config names and its LR schedule (one of DeepSpeed's classes, or None)."""
    check_nonempty(cfg, params)
    return backend.own_optimizer(params) or client(cfg, params, backend.fused)


def client(cfg: DictConfig, params: list[Any], fused: bool = True) -> tuple[Any, Any]:
    """The optimizer the config names and its LR schedule (one of DeepSpeed's classes, or None)."""
    from deepspeed.runtime import lr_schedules

    built = optimizer(cfg, params, fused)
    schedule = ds_config.scheduler_block(cfg)
    scheduler = getattr(lr_schedules, schedule["type"])(built, **schedule["params"]) if schedule else None
    return built, scheduler


def group_schedules(cfg: DictConfig, optimizer: Any) -> Any:
    """After `prepare`, when the parameter groups warm up apart (`text_encoders.warmup_steps`): a schedule per
    group on the prepared optimizer (optim/group_schedule.py), outside DeepSpeed and Accelerate; else None."""
    blocks = ds_config.group_blocks(cfg)
    if blocks is None:
        return None
    schedules = group_schedule.GroupSchedules(optimizer, blocks, ds_config.group_lrs(cfg))
    log.info("LR schedule %s per parameter group: the UNet warms up over %d steps, the text encoders over %d",
             blocks[0]["type"], *ds_config.group_warmups(cfg))
    return schedules


def optimizer(cfg: DictConfig, params: list[Any], fused: bool = True) -> Any:
    """torch.optim's (with `fused`, where the device has the kernel: one kernel over all tensors instead of a
    per-tensor loop), bitsandbytes' AdamW8bit, prodigyopt's Prodigy, schedulefree's AdamW or optimi's Kahan-summed
    Adam, AdamW and Lion."""
    block = ds_config.optimizer_block(cfg)
    name = str(cfg.resolved.optimizer)
    if name == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **block["params"])
    if name == "prodigy":
        from prodigyopt import Prodigy

        # Sharded over several ranks each sees a part of the sums behind d: its all-reduce joins them (on CUDA
        # only; the config checks refuse the case elsewhere).
        with contextlib.redirect_stdout(io.StringIO()):  # its print() of "Using decoupled weight decay" on every rank
            return Prodigy(params, **block["params"], fsdp_in_use=resolve.partitioned_over_ranks(cfg))
    if name == "schedule_free_adamw":
        return _schedule_free(params, block)
    if name in optimizers.KAHAN_OPTIMIZERS:
        return _kahan(name, params, block, bool(cfg.resolved.get("kahan_loop", False)))
    torch_class = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "Adagrad": torch.optim.Adagrad,
                   "adamw_torch": torch.optim.AdamW}[block["type"]]
    try:
        return torch_class(params, **block["params"], **({"fused": True} if fused else {}))
    except (RuntimeError, ValueError) as exc:  # a device without the fused kernel: torch's default loop
        log.debug("fused %s unavailable here (%s)", block["type"], exc)
        return torch_class(params, **block["params"])


def _kahan(name: str, params: list[Any], block: dict[str, Any], loop: bool) -> Any:
    """optimi's Adam, AdamW or Lion with Kahan summation on the bf16 weights
    (precision.weight_update=kahan). optimi picks its Triton kernel on CUDA tensors and a loop
    elsewhere (FSDP2's DTensors among them); `loop` (a flat partition past the kernel's 32-bit
    indices: resolved.kahan_loop) takes the loop everywhere."""
    import optimi

    settings = dict(block["params"])
    if "betas" in settings:
        settings["betas"] = tuple(settings["betas"])
    if loop:  # optimi's torch loop (its foreach is deprecated, and gains nothing on one tensor)
        settings.update(triton=False, foreach=False)
        log.warning("optimizer %s steps with optimi's torch loop, not its Triton kernel: a "
                    "rank's flat partition is past the kernel's 32-bit indices "
                    "(resolved.kahan_loop)", name)
    cls = {"adam_kahan": optimi.Adam, "adamw_kahan": optimi.AdamW, "lion_kahan": optimi.Lion}[name]
    return cls(params, **settings, kahan_sum=True)


def _schedule_free(params: list[Any], block: dict[str, Any]) -> Any:
    import schedulefree

    optimizer = schedulefree.AdamWScheduleFree(params, **block["params"])
    optimizer.train()  # it refuses to step otherwise; nothing moves yet (no z before the first step)
    # train() looked each parameter up in its state, a defaultdict: empty entries for tensors DeepSpeed then
    # replaces by its flat partitions, which would break DeepSpeed's state_dict (a KeyError at the checkpoint).
    for key in [key for key, state in optimizer.state.items() if not state]:
        del optimizer.state[key]
    return optimizer


def check(cfg: DictConfig, accelerator: Any, optimizer: Any) -> None:
    """Nothing swapped behind the user's back: the optimizer that steps is the class the config names (Accelerate
    replaces a client optimizer by DeepSpeed's CPU Adam under offload unless told not to)."""
    name = str(cfg.resolved.optimizer)
    if name not in optimizers.CLIENT_CLASS:
        return
    module, cls = optimizers.CLIENT_CLASS[name]
    base = inner.optimizer(accelerator, optimizer)
    got = f"{type(base).__module__}.{type(base).__name__}"
    if type(base).__name__ != cls or not type(base).__module__.startswith(module.split(".")[0]):
        raise TrainingError(f"optimizer={name}: {got} would step instead of {module}.{cls}; nothing was trained. "
                            "Please report this with the run's config.yaml")
    if accelerator.is_main_process:
        how = ""
        if inner.engine(accelerator) is not None:
            how = " (a DeepSpeed client optimizer: " + ("ZeRO hands it each rank's flat partition)"
                                                        if int(cfg.zero.stage) > 0 else "per parameter)")
        log.info("optimizer %s.%s steps%s", module, cls, how)


def drop_unreachable_state(optimizer: Any) -> None:
    """An optimizer that makes its state at construction (torch's Adagrad: `sum` and `step`) keeps it under the
    parameters it was built with; the backend's prepare then gives it others (FSDP2's DTensors, DeepSpeed's fp32
    masters or flat partitions), and the first checkpoint failed with a KeyError in `state_dict()`. Before the first
    step that state is unreachable (no group holds its key) and the optimizer makes it again for the parameters it
    steps: it is dropped."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for key in [key for key in optimizer.state if id(key) not in held]:
        del optimizer.state[key]
