"""EMA of the UNet, kept outside ZeRO (on the CPU by default).

Under ZeRO-3 the trained parameters are empty placeholders outside a gather, so the update reads them
inside `GatheredParameters`, a chunk at a time to bound the memory of the gathered copy. Every rank
takes part in the gather (it is collective); only the values land in each rank's shadow copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

_GATHER_CHUNK = 100_000_000  # elements gathered at once under ZeRO-3


def _chunks(params: list[torch.nn.Parameter]) -> Iterator[list[torch.nn.Parameter]]:
    chunk: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        numel = int(getattr(p, "ds_numel", p.numel()))
        if chunk and size + numel > _GATHER_CHUNK:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += numel
    if chunk:
        yield chunk


class EMA:
    """Exponential moving average of named parameters, with the usual warm-up of the decay."""

    def __init__(self, unet: torch.nn.Module, decay: float, device: str = "cpu") -> None:
        self.decay, self.device, self.step = decay, device, 0
        self.names = [n for n, p in unet.named_parameters() if p.requires_grad]
        self.shadow: dict[str, torch.Tensor] = {}
        self._read(unet, init=True)

    def _read(self, unet: torch.nn.Module, init: bool, weight: float = 1.0) -> None:
        named = dict(unet.named_parameters())
        params = [named[n] for n in self.names]
        zero3 = any(hasattr(p, "ds_id") for p in params)
        by_id = {id(p): n for n, p in named.items()}
        for chunk in _chunks(params):
            if zero3:
                import deepspeed

                context: Any = deepspeed.zero.GatheredParameters(chunk, modifier_rank=None)
            else:
                context = torch.no_grad()
            with context, torch.no_grad():
                for p in chunk:
                    value = p.detach().to(self.device, torch.float32)
                    name = by_id[id(p)]
                    if init:
                        self.shadow[name] = value.clone()
                    else:
                        self.shadow[name].lerp_(value, weight)

    def update(self, unet: torch.nn.Module) -> None:
        """Collective under ZeRO-3: call on every rank after each optimizer step."""
        self.step += 1
        decay = min(self.decay, (1 + self.step) / (10 + self.step))
        self._read(unet, init=False, weight=1.0 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.shadow = {k: v.to(self.device, torch.float32) for k, v in state["shadow"].items()}
