"""Schedule-free AdamW's evaluation weights, computed by ds_trainer under every layout.

The optimizer trains at y and keeps a second sequence z; the weights to sample, export and evaluate with are
x = y + (1 - 1/beta1) (z - y), which its `eval()` computes in place. Under DeepSpeed that call is not to be trusted:
under ZeRO-1/2 it would move only the flat fp32 masters, not the 16-bit module weights a sampler or exporter reads,
and under ZeRO-3 a partition's `params` are [] between steps, so it moves nothing (accelerate#4159 saw the train-view
weights saved). Here each trained parameter's fp32 master is moved to x from z, the module's weights are refreshed from
the masters, and afterwards both go back to y exactly: from a copy of the master values, which nothing else touches.

Collective under ZeRO-1/2/3 (every rank calls, in the same order). Checkpoints keep y and z (the training state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ds_trainer.train.backends import inner, masters
from ds_trainer.train.state import portable

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

Write = masters.Write


def eval_weights(run: Run) -> contextlib.AbstractContextManager:
    """`moved` for a run's prepared UNet and optimizer."""
    base = inner.optimizer(run.accelerator, run.optimizer)
    return moved(run.accelerator.unwrap_model(run.model), base, run.params.masters(base))


@contextlib.contextmanager
def moved(module: torch.nn.Module, base: Any, held: masters.Masters) -> Iterator[None]:
    """Within: the module (and the fp32 masters that LoRA export reads) at x. `base` is the schedule-free optimizer
    itself (DeepSpeed's inner one), `held` its masters under the backend's layout (`Backend.params(...).masters`).
    Before its first step the optimizer has no z and x is y: nothing moves."""
    if not any("z" in state for state in base.state.values()):
        yield
        return
    weight = 1 - 1 / float(base.param_groups[0]["betas"][0])
    saved: list[tuple[Write, torch.Tensor]] = []
    params: list[torch.nn.Parameter] = []
    with torch.no_grad():
        for p, master, z, write in held.local(portable.trainable(module), "z"):
            params.append(p)
            if master is None or write is None or z is None:  # no part here, or not stepped yet (x is y)
                continue
            saved.append((write, master.detach().to("cpu", copy=True)))
            write(torch.lerp(master, z.to(master.device), weight))
        held.refresh(params)
    try:
        yield
    finally:
        with torch.no_grad():
            for write, y in saved:
                write(y)
            held.refresh(params)


def context(run: Run) -> Callable[[], contextlib.AbstractContextManager]:
    """What samples and exports run in: the evaluation weights for schedule-free AdamW, nothing otherwise."""
    if str(run.cfg.resolved.optimizer) != "schedule_free_adamw":
        return contextlib.nullcontext
    return lambda: eval_weights(run)
