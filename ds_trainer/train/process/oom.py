"""Out of memory: recognising it, and the one line that says what to try next."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from ds_trainer.config import ds_config


def is_oom(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, and the same failure as other allocators word it."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or any(
        words in text for words in ("out of memory", "not enough memory", "can't allocate memory"))


def message(cfg: DictConfig, device: str) -> str:
    """One line: the memory settings of the run and what to try next."""
    option = ds_config.zero_option(cfg)
    zero = f"zero={option}"
    tries = []
    if option != "stage3":
        tries.append("a higher ZeRO stage (zero=stage3)")
    if cfg.offload.device.value == "none":
        tries.append("offload=cpu")
    if int(cfg.train.micro_batch_size) > 1:
        tries.append(f"train.micro_batch_size={int(cfg.train.micro_batch_size) // 2} with more "
                     "train.gradient_accumulation_steps")
    if not cfg.train.gradient_checkpointing:
        tries.append("train.gradient_checkpointing=true")
    where = "CUDA" if device == "cuda" else device.upper()
    return (f"{where} out of memory with {zero} offload={cfg.offload.device.value} "
            f"resolution={cfg.resolution.width}x{cfg.resolution.height} "
            f"train.micro_batch_size={cfg.train.micro_batch_size} precision={cfg.precision.name.value}; try "
            + (", ".join(tries) or "a smaller resolution"))
