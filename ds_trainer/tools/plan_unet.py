"""The UNet the planner measures, built on the meta device from an architecture folder (no memory, no download):
its parameter count and largest layer, and random inputs of a given image size. The planner (plan.py), its
sampling part (plan_samples.py) and the bench's raw loop (bench_cells.py) all build on it. Also the counter of what
autograd saves in a meta-device forward (`saved_bytes`), which measures the UNet's and the trained text encoders'
activations (plan_lora.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


def saved_bytes(module: Any, blocks: tuple[Any, ...], forward: Callable[[], Any], checkpointing: bool) -> int:
    """Bytes autograd keeps for backward in `forward()` of `module` (built on the meta device), with checkpointing of
    its `blocks` or without."""
    import torch

    total, segments = [0], list[int]()
    # A tensor saved by several ops (or through views) counts once: keyed by the tensor a view is of,
    # kept referenced so its id stays unique. (Meta tensors have no storage address to key on.)
    # Weights saved for backward (and views of them) are parameters, counted as such already.
    params = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    keep: list[Any] = []
    starts: dict[int, int] = {}

    def pack(t: Any) -> Any:
        base = t
        while base._base is not None:
            base = base._base
        if id(base) not in seen and id(base) not in params:
            seen.add(id(base))
            keep.append(base)
            total[0] += base.numel() * base.element_size()
        return t

    def before(block: Any, args: Any) -> None:
        starts[id(block)] = total[0]

    def after(block: Any, args: Any, out: Any) -> None:
        segments.append(total[0] - starts[id(block)])

    handles = [h for m in module.modules() if isinstance(m, blocks)
               for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        with torch.device("meta"), efficient_attention_counted(total), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for h in handles:
            h.remove()
    if not checkpointing:
        return total[0]
    # Checkpointing keeps each block's input (counted by the outer forward) and recomputes one block at
    # a time: the saved total minus what the blocks keep inside, plus the largest block.
    # (A block's input is the previous block's output, already counted where it was saved.)
    return total[0] - sum(segments) + max(segments, default=0)


@contextlib.contextmanager
def efficient_attention_counted(count: list[int]) -> Iterator[None]:
    """Replace SDPA while counting: on meta it would take the math path and save the full attention
    matrix; memory-efficient kernels keep q, k, v, the output and a log-sum-exp per query."""
    import torch
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def counted(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            out = real(q, k, v, *args, **kwargs)
        out = out.detach().requires_grad_(q.requires_grad or k.requires_grad or v.requires_grad)
        lse = q.shape[0] * q.shape[1] * q.shape[2] * 4
        count[0] += sum(t.numel() * t.element_size() for t in (q, k, v, out)) + lse
        return out

    F.scaled_dot_product_attention = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
