"""`train.attention`: the kernel the trained module's attention layers run (torch's scaled_dot_product_attention,
which every diffusers attention processor of the families calls).

`sdpa` leaves the choice to torch (the fastest kernel that takes the inputs). A named kernel is the only one allowed
inside each attention layer of the trained UNet or transformer, in its forward and in a gradient-checkpointed
recompute: each attention module's processor runs inside `sdpa_kernel` (not the whole step: the VAE, which encodes
in fp32 and has attention too, and the text encoders keep torch's choice). The config checks refuse a kernel the
device lacks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("ds_trainer")


class _Held:
    """An attention layer's processor, run with only one SDPA kernel allowed. A `with` inside the processor's call
    (not hooks around the layer) so that torch.compile traces it (train.compile), a gradient-checkpointed recompute
    runs it too, and a copy of the module (EMA's) copies it with its own processor."""

    def __init__(self, inner: Any, backend: Any) -> None:
        self.inner, self.backend = inner, backend

    def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([self.backend]):
            return self.inner(attn, *args, **kwargs)


def restrict(module: torch.nn.Module, kernel: str) -> int:
    """Allow only `kernel` in `module`'s attention layers (nothing for `sdpa`); returns how many layers."""
    if kernel == "sdpa":
        return 0
    from torch.nn.attention import SDPBackend

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]
    layers = [m for m in module.modules() if hasattr(m, "set_processor")]  # diffusers' attention modules
    for layer in layers:
        layer.set_processor(_Held(layer.processor, backend))  # type: ignore[operator]
    log.info("attention: %s kernel only, in %d attention layers of the trained module", kernel, len(layers))
    return len(layers)
