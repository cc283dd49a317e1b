"""The trained module the planner measures (SDXL's UNet, or SD3's, Flux's or Qwen-Image's transformer when the folder
holds a `transformer/`), built on the meta device from an architecture folder (no memory, no download): its
parameter count and largest layer, random inputs of a given image size, and a forward of it (`forward_of`). The
planner (cells.py), its sampling part (samples.py) and the bench's raw loop (tools/bench/cells.py) build on it.
Also the counter of what autograd saves in a meta-device forward (`saved_bytes`), which measures the trained
module's and the trained text encoders' activations (lora.py)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from ds_trainer.config import families


@dataclass(frozen=True)
class UNetStats:
    """The trained module's parameter count and its largest layer's."""

    params: int
    largest_layer: int


@cache
def unet_stats(architecture: str) -> UNetStats:
    """Parameter count and largest layer (a module's own parameters) of the UNet, built on meta."""
    unet = meta_unet(architecture)
    params = sum(p.numel() for p in unet.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in unet.modules())
    return UNetStats(params, largest)


def text_tokens(cfg: Any) -> int:
    """The text tokens the trained module attends to, as its family counts them (config/families/: SDXL's CLIP 77,
    SD3's CLIP 77 and T5's after them, Flux's T5 alone, Qwen-Image's Qwen2.5-VL sequence); an editing model whose
    caption is encoded with its reference has the reference's vision tokens, their start and end before it."""
    spec = families.of(cfg)
    tokens = spec.text_tokens(cfg)
    if spec.caption_sees_reference and cfg.model.get("reference_images"):
        count = int(cfg.model.get("references") or 1)
        height, width = int(cfg.resolution.height), int(cfg.resolution.width)
        if count > 1 and spec.reference_area:  # several references: each encoded at about this area
            side = math.sqrt(spec.reference_area * width / height)
            width, height = round(side / 32) * 32, round(side * height / width / 32) * 32
        tokens += count * (vision_tokens(str(cfg.model.architecture), height, width) + 2)
    return tokens


def vision_tokens(architecture: str, height: int, width: int) -> int:
    """The `<|image_pad|>` tokens Qwen2.5-VL's processor (the folder's `processor` config) makes of an image of this
    size: the image resized to whole merged patches within its pixel bounds, one token per merged patch."""
    import json
    from pathlib import Path

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    c = json.loads((Path(architecture) / "processor" / "preprocessor_config.json").read_text())
    factor = int(c["patch_size"]) * int(c["merge_size"])
    h, w = smart_resize(height, width, factor=factor, min_pixels=int(c["size"]["shortest_edge"]),
                        max_pixels=int(c["size"]["longest_edge"]))
    return (h // factor) * (w // factor)


def token_height(cfg: Any, height: int) -> int:
    """The height of an image of as many tokens as the trained module sees for one of `height`
    pixels: an editing model's reference images (Kontext's, Qwen-Image-Edit's latents) follow the
    image's tokens, as an image as many times taller."""
    if not cfg.model.get("reference_images"):
        return height
    return height * (1 + int(cfg.model.get("references") or 1))


def is_transformer(architecture: str) -> bool:
    """Whether the folder's trained module is a diffusion transformer (SD3's `transformer/`), not a UNet."""
    from pathlib import Path

    return (Path(architecture) / "transformer" / "config.json").is_file()


@cache
def meta_unet(architecture: str) -> Any:
    """The trained module on the meta device, shared (cached): callers that change it build their own
    (`build_meta`)."""
    return build_meta(architecture)


def build_meta(architecture: str) -> Any:
    """A fresh trained module of `architecture` on the meta device."""
    import diffusers
    import torch

    folder = "transformer" if is_transformer(architecture) else "unet"
    config = diffusers.UNet2DConditionModel.load_config(architecture, subfolder=folder)
    cls = getattr(diffusers, str(config.get("_class_name", "UNet2DConditionModel")))  # SD3's, Flux's transformer
    with torch.device("meta"):
        return cls.from_config(config)


def blocks_of(model: Any) -> tuple[Any, ...]:
    """The classes gradient checkpointing recomputes one at a time: its family's (the UNet's ResNet and
    transformer blocks, a transformer's blocks)."""
    from ds_trainer.train import families as trained

    return trained.of_module(model).planner_blocks()


def forward_of(model: Any, batch: int, height: int, width: int, dtype: Any = None, device: Any = None,  # noqa: PLR0913
               tokens: int = 77, frames: int = 1, downsample: int = 8) -> Callable[[], Any]:
    """A forward of `model` (a UNet or a transformer) on random inputs for images of height x width
    pixels (a video model's clips of `frames` frames) with `tokens` text tokens (SDXL: CLIP's 77; SD3:
    77 + T5's; Flux: T5's), as its family builds them."""
    from ds_trainer.train import families as trained
    from ds_trainer.train.families.base import Shape

    shape = Shape(batch, height, width, tokens, frames, downsample, dtype, device)
    return trained.of_module(model).planner_forward(model, shape)


def unet_inputs(config: Any, batch: int, height: int, width: int, dtype: Any = None, device: Any = None,
                tokens: int = 77) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Random SDXL UNet inputs for images of height x width pixels (train/families/sdxl.py's)."""
    from ds_trainer.train.families.sdxl import unet_inputs as inputs

    return inputs(config, batch, height, width, dtype, device, tokens)  # type: ignore[no-any-return]


def saved_bytes(module: Any, blocks: tuple[Any, ...], forward: Callable[[], Any],  # noqa: PLR0913
                checkpointing: bool, block_inputs: bool = False,
                math_attention: bool = False) -> int:
    """Bytes autograd keeps for backward in `forward()` of `module` (built on the meta device), with
    checkpointing of its `blocks` or without. `block_inputs`: with checkpointing, count each block's
    inputs (a transformer's blocks follow one another, each kept for its recomputation).
    `math_attention` (train.attention=math): torch's math kernel runs as it is, saving each
    attention's probabilities (B x heads x S x S); else as fused kernels keep it."""
    import torch

    total, segments = [0], list[int]()
    # A tensor saved by several ops (or through views) counts once: keyed by the tensor a view is of,
    # kept referenced so its id stays unique. (Meta tensors have no storage address to key on.)
    # Weights saved for backward (and views of them) are parameters, counted as such already.
    params = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    keep: list[Any] = []
    starts: dict[int, int] = {}
    inputs, given = [0], set[int]()

    def pack(t: Any) -> Any:
        base = t
        while base._base is not None:
            base = base._base
        if id(base) not in seen and id(base) not in params:
            seen.add(id(base))
            keep.append(base)
            total[0] += base.numel() * base.element_size()
        return t

    def before(block: Any, args: Any, kwargs: dict[str, Any]) -> None:
        starts[id(block)] = total[0]
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and id(value) not in given:
                given.add(id(value))
                keep.append(value)
                inputs[0] += value.numel() * value.element_size()

    def after(block: Any, args: Any, out: Any) -> None:  # noqa: ARG001 - torch's hook signature
        segments.append(total[0] - starts[id(block)])

    handles = [h for m in module.modules() if isinstance(m, blocks)
               for h in (m.register_forward_pre_hook(before, with_kwargs=True), m.register_forward_hook(after))]
    try:
        # On meta, SDPA takes the math path: as train.attention=math runs on any device.
        attention: contextlib.AbstractContextManager[None] = efficient_attention_counted(total)
        if math_attention:
            attention = contextlib.nullcontext()
        saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.device("meta"), attention, saving:
            forward()
    finally:
        for h in handles:
            h.remove()
    if not checkpointing:
        return total[0]
    # Checkpointing keeps each block's input (counted by the outer forward) and recomputes one block at
    # a time: the saved total minus what the blocks keep inside, plus the largest block.
    # (A block's input is the previous block's output, already counted where it was saved.)
    return total[0] - sum(segments) + max(segments, default=0) + (inputs[0] if block_inputs else 0)


@contextlib.contextmanager
def efficient_attention_counted(count: list[int]) -> Iterator[None]:
    """Replace SDPA while counting: on meta it would take the math path and save the full attention
    matrix; memory-efficient kernels keep q, k, v, the output and a log-sum-exp per query."""
    import torch
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        # Positional (torch's own callers, SDXL's and SD3's processors) or by name (diffusers' attention dispatch,
        # Flux's processors).
        q, k, v = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("query", "key", "value")))
        with torch.no_grad():
            out = real(*args, **kwargs)
        out = out.detach().requires_grad_(q.requires_grad or k.requires_grad or v.requires_grad)
        lse = q.shape[0] * q.shape[1] * q.shape[2] * 4
        count[0] += sum(t.numel() * t.element_size() for t in (q, k, v, out)) + lse
        return out

    F.scaled_dot_product_attention = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
