"""What the prepared objects hold underneath, whatever the backend: DeepSpeed's engine (None under FSDP2 and DDP), the
optimizer that holds the optimizer state, and the LR schedule object that steps."""

from __future__ import annotations

from typing import Any


def engine(accelerator: Any) -> Any:
    """The DeepSpeed engine `accelerator` prepared, or None (FSDP2, DDP)."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    return wrapped.engine if wrapped is not None else None


def optimizer(accelerator: Any, prepared: Any) -> Any:
    """The optimizer that holds the Adam state: DeepSpeed's inner one (or its basic one on ZeRO-0), or torch's
    (`prepared`: the optimizer `prepare` returned)."""
    found = engine(accelerator)
    outer = found.optimizer if found is not None else prepared
    return getattr(outer, "optimizer", outer)


def scheduler(accelerator: Any, prepared: Any) -> Any:
    """The LR schedule object that steps: DeepSpeed's engine's, or ours (DDP, FSDP, per-group schedules)."""
    found = engine(accelerator)
    if found is not None and found.lr_scheduler is not None:
        return found.lr_scheduler
    return getattr(prepared, "scheduler", prepared)
