"""The UNet the planner measures, built on the meta device from an architecture folder (no memory, no download):
its parameter count and largest layer, and random inputs of a given image size. The planner (plan.py), its
sampling part (plan_samples.py) and the bench's raw loop (bench_cells.py) all build on it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class UNetStats:
    params: int
    largest_layer: int


@cache
def unet_stats(architecture: str) -> UNetStats:
    """Parameter count and largest layer (a module's own parameters) of the UNet, built on meta."""
    unet = meta_unet(architecture)
    params = sum(p.numel() for p in unet.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in unet.modules())
    return UNetStats(params, largest)


@cache
def meta_unet(architecture: str) -> Any:
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(architecture, subfolder="unet"))


def unet_inputs(config: Any, batch: int, height: int, width: int, dtype: Any = None, device: Any = None,
                tokens: int = 77) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Random SDXL UNet inputs for images of height x width pixels: latents, timesteps, prompt embeddings
    and the added conditions (pooled text embedding, time ids)."""
    import torch

    pooled = int(config.projection_class_embeddings_input_dim) - 6 * int(config.addition_time_embed_dim)
    kw = {"dtype": dtype, "device": device}
    latents = torch.randn(batch, int(config.in_channels), height // 8, width // 8, **kw)
    embeds = torch.randn(batch, tokens, int(config.cross_attention_dim), **kw)
    cond = {"text_embeds": torch.randn(batch, pooled, **kw), "time_ids": torch.randn(batch, 6, **kw)}
    return latents, torch.randint(0, 1000, (batch,), device=device), embeds, cond
