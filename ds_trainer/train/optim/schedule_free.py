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
from functools import partial
from typing import Any

import torch

from ds_trainer.train.backends import deepspeed, inner
from ds_trainer.train.state import portable

Write = Callable[[torch.Tensor], Any]


def _places(module: torch.nn.Module, base: Any, masters: dict[int, torch.Tensor],
            ) -> Iterator[tuple[torch.nn.Parameter, Any, Any, Write | None]]:
    """(parameter, its fp32 master (this rank's part under ZeRO), the matching part of z, how to set the master) for
    every trained parameter; the master is None where this rank holds no part of it."""
    for _, p in portable.trainable(module):
        if hasattr(p, "ds_id"):  # ZeRO-3: this rank's partition (a copy on the device when the state is offloaded)
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            yield p, safe_get_local_fp32_param(p), safe_get_local_optimizer_state(p, "z"), partial(_set_local, p)
        elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2 (and BF16_Optimizer): the fragment of the flat partition it owns
            mapping = p._hp_mapping
            if mapping is None:
                yield p, None, None, None
                continue
            master = mapping.get_hp_fragment()
            yield p, master, (mapping.optim_fragment or {}).get("z"), master.copy_
        else:  # the parameter itself (ddp, ZeRO-0 fp32), or its own fp32 master (ZeRO-0 16-bit)
            master = masters.get(id(p), p)
            yield p, master, base.state[master]["z"], master.data.copy_


def _set_local(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_local_fp32_param

    safe_set_local_fp32_param(p, value)


def _refresh(params: list[torch.nn.Parameter], masters: dict[int, torch.Tensor]) -> None:
    """The module's weights from the (moved or restored) fp32 masters, as DeepSpeed's step leaves them."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_local_fp32_param

    gathered: list[Any] = []
    for p in params:
        if hasattr(p, "ds_id"):
            z3: Any = p  # DeepSpeed's partitioned parameter
            z3.ds_tensor.data.copy_(safe_get_local_fp32_param(p).view(-1))
            if z3.ds_status == ZeroParamStatus.AVAILABLE:
                gathered.append(p)
        elif hasattr(p, "_hp_mapping"):
            p.data.copy_(safe_get_full_fp32_param(p))  # collective: joins every rank's fragment
        elif id(p) in masters:
            p.data.copy_(masters[id(p)])
    if gathered:
        # ZeRO-3 keeps small parameters whole on every rank (and may keep others gathered): a gather skips a whole
        # parameter, so it is released first and gathered again from the partitions just written.
        gathered[0].partition(gathered)
        gathered[0].all_gather(gathered)


def eval_weights(accelerator: Any, model: Any, optimizer: Any) -> contextlib.AbstractContextManager:
    """`moved` for a run's prepared UNet and optimizer."""
    engine = inner.engine(accelerator)
    return moved(accelerator.unwrap_model(model), inner.optimizer(accelerator, optimizer), engine)


@contextlib.contextmanager
def moved(module: torch.nn.Module, base: Any, engine: Any) -> Iterator[None]:
    """Within: the module (and the fp32 masters that LoRA export reads) at x. `base` is the schedule-free optimizer
    itself (DeepSpeed's inner one), `engine` the DeepSpeed engine or None. Before its first step the optimizer has
    no z and x is y: nothing moves."""
    if not any("z" in state for state in base.state.values()):
        yield
        return
    weight = 1 - 1 / float(base.param_groups[0]["betas"][0])
    masters = deepspeed.unfused_masters(engine)
    saved: list[tuple[Write, torch.Tensor]] = []
    params: list[torch.nn.Parameter] = []
    with torch.no_grad():
        for p, master, z, write in _places(module, base, masters):
            params.append(p)
            if master is None or write is None or z is None:  # no part here, or not stepped yet (x is y)
                continue
            saved.append((write, master.detach().to("cpu", copy=True)))
            write(torch.lerp(master, z.to(master.device), weight))
        _refresh(params, masters)
    try:
        yield
    finally:
        with torch.no_grad():
            for write, y in saved:
                write(y)
            _refresh(params, masters)


def context(cfg: Any, accelerator: Any, model: Any, optimizer: Any) -> Callable[[], contextlib.AbstractContextManager]:
    """What samples and exports run in: the evaluation weights for schedule-free AdamW, nothing otherwise."""
    if str(cfg.resolved.optimizer) != "schedule_free_adamw":
        return contextlib.nullcontext
    return lambda: eval_weights(accelerator, model, optimizer)
