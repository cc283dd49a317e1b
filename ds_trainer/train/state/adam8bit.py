"""bitsandbytes' 8-bit Adam state in the portable format: the moments dequantized to fp32 Adam moments
(`exp_avg`, `exp_avg_sq`) for the writer, and quantized again from them after a carry.

bitsandbytes keeps each tensor's (under ZeRO: each rank's flat partition's) first and second moments as uint8
codes (`state1`, `state2`) over a dynamic map (`qmap1`, `qmap2`), with an fp32 scale per block of 256 elements
(`absmax1`, `absmax2`); tensors below its `min_8bit_size` keep fp32 moments in the same keys. `exposed` adds the
fp32 moments under Adam's names for as long as the portable state is read (DeepSpeed's per-parameter views of the
partition's state are then relinked, so its safe_get functions find them); `absorb` quantizes the carried ones
into the optimizer's own state, in the blocks of this run's layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

BLOCK = 256
_PAIRS = (("exp_avg", "state1", "qmap1", "absmax1"), ("exp_avg_sq", "state2", "qmap2", "absmax2"))


def is_8bit(base: Any) -> bool:
    """Whether the optimizer holding the state is one of bitsandbytes' 8-bit optimizers."""
    return any(cls.__module__.startswith("bitsandbytes.") and cls.__name__ == "Optimizer8bit"
               for cls in type(base).__mro__)


def _relink(engine: Any) -> None:
    """ZeRO-1/2 keep per-parameter views of the partition's state, made when it was linked: link it again."""
    zero = engine.optimizer if engine is not None else None
    if zero is not None and hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


@contextlib.contextmanager
def exposed(engine: Any, base: Any) -> Iterator[None]:
    """The 8-bit moments as fp32 `exp_avg`/`exp_avg_sq` beside them while the block runs (a no-op for any other
    optimizer)."""
    if not is_8bit(base):
        yield
        return
    from bitsandbytes import functional

    added = []
    for state in base.state.values():
        if "state1" not in state:
            continue
        for name, codes, qmap, absmax in _PAIRS:
            if state[codes].dtype == torch.uint8:
                state[name] = functional.dequantize_blockwise(state[codes], absmax=state[absmax], code=state[qmap],
                                                              blocksize=BLOCK).float()
            else:  # below min_8bit_size: fp32 already
                state[name] = state[codes]
        added.append(state)
    _relink(engine)
    try:
        yield
    finally:
        for state in added:
            for name, *_ in _PAIRS:
                state.pop(name, None)
        _relink(engine)


def absorb(engine: Any, base: Any, step: int) -> None:
    """After a carry wrote fp32 `exp_avg`/`exp_avg_sq` into the state: create bitsandbytes' own state where it is
    missing, quantize the moments into it (this layout's blocks), set the step, and drop the fp32 copies."""
    if not is_8bit(base):
        return
    from bitsandbytes import functional

    # By the state's own keys: under ZeRO-3 the groups' `params` are empty between steps (it sets each sub-group's
    # flat partition only while it steps).
    where = {id(p): (g, i) for g, group in enumerate(base.param_groups) for i, p in enumerate(group["params"])}
    for p, state in list(base.state.items()):
        if "exp_avg" not in state:
            continue
        moments = {name: state.pop(name) for name, *_ in _PAIRS if name in state}
        if "state1" not in state:
            gindex, pindex = where.get(id(p), (0, None))
            group = base.param_groups[gindex]
            if pindex is None:  # ZeRO-3: the partition stands in the group while its state is made, as in a step
                params, group["params"] = group["params"], [p]
                try:
                    base.init_state(group, p, gindex, 0)
                finally:
                    group["params"] = params
            else:
                base.init_state(group, p, gindex, pindex)
        for name, codes, qmap, absmax in _PAIRS:
            if name not in moments:
                continue
            value = moments[name].to(state[codes].device, torch.float32).reshape(state[codes].shape)
            if state[codes].dtype == torch.uint8:
                functional.quantize_blockwise(value, code=state[qmap], absmax=state[absmax], out=state[codes],
                                              blocksize=BLOCK)
            else:
                state[codes].copy_(value)
        state["step"] = int(step)
    _relink(engine)
