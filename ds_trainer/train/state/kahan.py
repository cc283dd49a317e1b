"""precision.weight_update=kahan: optimi's Kahan compensation in the portable state and in a carried resume.

Beside each bf16 weight w optimi keeps a bf16 compensation c of what rounding w's updates lost, added back at the
next step: the weight the run has learned is w + c, closer than w alone. The portable state therefore holds w + c
as the fp32 weight, and a carry into a Kahan run sets w to the carried weight rounded to bf16 and c to what that
rounding lost, so a move into another layout continues from the same learned weight. optimi counts its steps per
parameter group (`step`, set up at the group's first step), not per tensor. (bitsandbytes' 8-bit state is
`adam8bit`'s.)
"""

from __future__ import annotations

from typing import Any

import torch

COMP = "kahan_comp"


def _is_optimi(base: Any) -> bool:
    return type(base).__module__.split(".")[0] == "optimi"


def is_kahan(base: Any) -> bool:
    """Whether `base` (the optimizer that holds the state) is one of optimi's, summing with compensation."""
    return _is_optimi(base) and any(g.get("kahan_sum") for g in base.param_groups)


def step_count(base: Any) -> int | None:
    """optimi's step count (its groups step together), or None for another optimizer and for one of
    optimi's that counts no steps (Lion: no bias correction)."""
    if not _is_optimi(base):
        return None
    if any(g.get("setup") and "step" not in g for g in base.param_groups):
        return None
    return max((int(g["step"]) for g in base.param_groups if g.get("setup")), default=0)


def with_compensation(weight: torch.Tensor, comp: torch.Tensor | None) -> torch.Tensor:
    """The learned weight w + c in fp32 (w alone before the first step, when there is no compensation yet)."""
    return weight.float() if comp is None else weight.float() + comp.float()


def remainder(value: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """What rounding `value` to the weight's dtype lost: the compensation a carried weight starts with."""
    return (value.float() - rounded.float()).to(rounded.dtype)


def set_clock(base: Any, t: int) -> None:
    """optimi's groups as their first step would leave them, at step t (a carry writes the state into them): set up,
    summing with compensation, and on the implementation optimi picks (Triton on CUDA tensors, else its loop)."""
    from optimi.utils import _default_to_triton  # optimi's own choice at a group's first step (optimi 0.3)

    for group in base.param_groups:
        if group["triton"] is None and group["foreach"] is None:
            group["triton"] = _default_to_triton(list(group["params"]))
        group.update(setup=True, kahan_sum=True, step=torch.tensor(t, dtype=torch.int32))


def fill(base: Any, tensor: torch.Tensor) -> None:
    """Zero compensation for `tensor` beside the moments a carry made for it (optimi would otherwise take a state
    without one for a fresh one and zero the carried moments at its first step)."""
    base.state[tensor][COMP] = torch.zeros_like(tensor)
