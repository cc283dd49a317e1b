"""Flux.1's facts (dev, schnell, Kontext): a transformer of double- and single-stream blocks trained
by flow matching with the resolution-dependent shift, CLIP-L and T5, dev's distilled guidance input;
its single file the transformer alone in Black Forest Labs' layout."""

from __future__ import annotations

from typing import Any

from ds_trainer.config.families.sd3 import SPEC as SD3
from ds_trainer.config.families.spec import (
    FamilySpec,
    TransformerFile,
    blocks_mismatch,
    width_mismatch,
)

# diffusers' Flux single-file converter splits the single-stream blocks' fused projection at
# this width
WIDTH = 3072


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """Black Forest Labs' file against the architecture: its double and single blocks, guidance
    input and width."""
    keys = set(shapes)
    guided = "guidance_in.in_layer.weight" in keys
    if guided != bool(arch.get("guidance_embeds")):
        file_has, arch_has = (
            ("with" if guided else "without"),
            ("with" if arch.get("guidance_embeds") else "without"),
        )
        return (
            f"a Flux transformer {file_has} a guidance input (FLUX.1-dev has one, schnell not), "
            "the "
            f"architecture {arch_has}"
        )
    for name, key in (("double_blocks", "num_layers"), ("single_blocks", "num_single_layers")):
        found = blocks_mismatch(keys, name, int(arch[key]))
        if found:
            return found
    return width_mismatch(shapes, "img_in.weight", width)


def _text_tokens(cfg: Any) -> int:
    """T5's sequence alone (CLIP gives the pooled vector only)."""
    return int(cfg.model.flow.t5_max_length)


def _context_lengths(cfg: Any, width: int, height: int,
                     frames: int) -> dict[str, int]:  # noqa: ARG001 - a still image
    """The plan splits the image's packed tokens and T5's (their ids with them)."""
    return {"image tokens": (width // 16) * (height // 16),
            "T5 tokens": int(cfg.model.flow.t5_max_length)}


SPEC = FamilySpec(
    name="flux",
    label="Flux.1",
    component="transformer",
    module_classes=("FluxTransformer2DModel",),
    implementation="ds_trainer.train.families.flux:Flux",
    text_encoders=("clip_l", "t5"),
    guidance_input=True,
    dynamic_shift=True,
    pipeline="FluxPipeline",
    fp16=SD3.fp16,
    transformer_file=TransformerFile(
        mark="double_blocks.0.img_attn.norm.key_norm.scale",
        label="a Flux.1 transformer (Black Forest Labs' layout)",
        example="flux1-dev.safetensors",
        mismatch=_mismatch,
        width=WIDTH,
        width_model="flux_dev",
    ),
    code_url="https://github.com/black-forest-labs/flux",
    modelspec_architecture="flux-1-dev",
    kohya_base_version="flux1",
    kohya_readers="ComfyUI (`models/loras`), Forge, kohya's sd-scripts, "
    "diffusers' `load_lora_weights`",
    tags=("flux", "text-to-image"),
    text_tokens=_text_tokens,
    input_layer="x_embedder",
    context_lengths=_context_lengths,
)
