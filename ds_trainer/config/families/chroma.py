"""Chroma's facts (Chroma1-HD, Chroma1-Base): FLUX.1-schnell's transformer with its per-block
modulation pruned to one shared approximator, trained by flow matching with the resolution-dependent
shift on Flux's VAE, T5-XXL alone (its padding masked but for one token), no guidance input; its
single file the transformer alone in its makers' layout (Black Forest Labs' names and the
approximator's), as ComfyUI loads Chroma1-HD.safetensors."""

from __future__ import annotations

from typing import Any

from ds_trainer.config.families.flux import SPEC as FLUX
from ds_trainer.config.families.spec import (
    FamilySpec,
    TransformerFile,
    blocks_mismatch,
    width_mismatch,
)

# diffusers' Chroma single-file converter splits the single-stream blocks' fused projection at this
# width
WIDTH = 3072


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """The makers' file against the architecture: its double and single blocks and width."""
    keys = set(shapes)
    for name, key in (("double_blocks", "num_layers"), ("single_blocks", "num_single_layers")):
        found = blocks_mismatch(keys, name, int(arch[key]))
        if found:
            return found
    return width_mismatch(shapes, "img_in.weight", width)


def _text_tokens(cfg: Any) -> int:
    """T5's sequence (padded to model.flow.t5_max_length; the padding masked)."""
    return int(cfg.model.flow.t5_max_length)


SPEC = FamilySpec(
    name="chroma",
    label="Chroma",
    component="transformer",
    module_classes=("ChromaTransformer2DModel",),
    implementation="ds_trainer.train.families.chroma:Chroma",
    text_encoders=("t5",),
    dynamic_shift=True,
    attention_mask=True,
    pipeline="ChromaPipeline",
    fp16=FLUX.fp16,
    transformer_file=TransformerFile(
        mark="distilled_guidance_layer.in_proj.bias",
        label="a Chroma transformer (its makers' layout, as Chroma1-HD.safetensors)",
        example="Chroma1-HD.safetensors",
        mismatch=_mismatch,
        width=WIDTH,
        width_model="chroma",
        within="flux",
    ),
    code_url="https://github.com/lodestone-rock/flow",
    modelspec_architecture="chroma",  # kohya's sd-scripts' name (ARCH_FLUX_1_CHROMA)
    kohya_base_version="chroma",
    kohya_readers="ComfyUI (`models/loras`), kohya's sd-scripts, diffusers' `load_lora_weights`",
    tags=("chroma", "text-to-image"),
    text_tokens=_text_tokens,
    input_layer="x_embedder",
)
