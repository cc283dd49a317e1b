"""`train.attention`: the kernel the trained module's attention layers run (torch's scaled_dot_product_attention,
which every diffusers attention processor of the families calls).

`sdpa` leaves the choice to torch (the fastest kernel that takes the inputs). A named kernel is the only one allowed
inside each attention layer of the trained UNet or transformer, in its forward and in a gradient-checkpointed
recompute (hooks on each attention module, not on the whole step: the VAE, which encodes in fp32 and has attention
too, and the text encoders keep torch's choice). The config checks refuse a kernel the device lacks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("ds_trainer")


def restrict(module: torch.nn.Module, kernel: str) -> int:
    """Allow only `kernel` in `module`'s attention layers (nothing for `sdpa`); returns how many layers."""
    if kernel == "sdpa":
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]
    held: list[Any] = []  # entered contexts, innermost last (layers do not interleave on one thread)

    def enter(_module: Any, _args: Any) -> None:
        context = sdpa_kernel([backend])
        context.__enter__()
        held.append(context)

    def leave(_module: Any, _args: Any, _output: Any) -> None:
        if held:
            held.pop().__exit__(None, None, None)

    layers = [m for m in module.modules() if hasattr(m, "set_processor")]  # diffusers' attention modules
    for layer in layers:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    log.info("attention: %s kernel only, in %d attention layers of the trained module", kernel, len(layers))
    return len(layers)
