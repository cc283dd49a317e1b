"""The LR schedule when the optimizer's parameter groups warm up over different lengths (the text encoders'
`text_encoders.warmup_steps` beside the UNet's `scheduler.warmup_steps`).

DeepSpeed's schedule classes take a peak per parameter group but one warm-up length for all of them, so each group
gets a schedule of its own, of the same class and block (`ds_config.group_blocks`), that DeepSpeed's own code steps:
its formulas are DeepSpeed's, not copied here. Each runs on a one-group stand-in optimizer, and the group's LR is
copied into the real optimizer after every step. The object is not handed to DeepSpeed or Accelerate: the training
step steps it under every backend and the checkpoint registers it (`accelerator.register_for_checkpointing`), as
the DDP and FSDP paths do with DeepSpeed's single schedule.
"""

from __future__ import annotations

from typing import Any

import torch


class GroupSchedules:
    """One DeepSpeed LR schedule per parameter group of `optimizer` (anything with `param_groups`: torch's,
    DeepSpeed's ZeRO optimizers, Accelerate's wrapper), built from `blocks` (DeepSpeed `scheduler` blocks, one a
    group). The interface of DeepSpeed's schedules: `step(last_batch_iteration=None)`, `get_last_lr`, `state_dict`."""

    def __init__(self, optimizer: Any, blocks: list[dict[str, Any]], peaks: list[float]) -> None:
        from deepspeed.runtime import lr_schedules

        if not len(blocks) == len(peaks) == len(optimizer.param_groups):
            raise ValueError(f"{len(blocks)} schedule blocks and {len(peaks)} peaks for "
                             f"{len(optimizer.param_groups)} parameter groups")
        self.optimizer = optimizer
        self.parts = []
        for block, peak in zip(blocks, peaks, strict=True):
            # The stand-in's one group starts at the group's peak LR: WarmupCosineLR scales the LR a group has.
            stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(peak))
            self.parts.append(getattr(lr_schedules, block["type"])(stand_in, **block["params"]))
        self._copy()

    @property
    def last_batch_iteration(self) -> int:
        return int(self.parts[0].last_batch_iteration)

    def step(self, last_batch_iteration: int | None = None) -> None:
        for part in self.parts:
            part.step(last_batch_iteration)
        self._copy()

    def get_last_lr(self) -> list[float]:
        return [float(part.optimizer.param_groups[0]["lr"]) for part in self.parts]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            part.load_state_dict(state)

    def _copy(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_last_lr(), strict=True):
            group["lr"] = lr
