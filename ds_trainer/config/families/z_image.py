"""Z-Image's facts (Tongyi-MAI/Z-Image and its distilled Z-Image-Turbo): a single-stream DiT (the
image's 2 x 2 patches and the caption's tokens refined apart, then one sequence) trained by flow
matching at a fixed shift on Flux's VAE latents, captions by Qwen3 (its second-to-last hidden state
in Qwen3's chat template); its single file the transformer alone in its makers' layout (fused qkv),
as ComfyUI loads z_image_turbo_bf16.safetensors."""

from __future__ import annotations

from typing import Any

from ds_trainer.config.families.spec import (
    FamilySpec,
    TransformerFile,
    blocks_mismatch,
    width_mismatch,
)


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """The makers' file against the architecture: its layers and width."""
    found = blocks_mismatch(set(shapes), "layers", int(arch["n_layers"]))
    if found:
        return found
    return width_mismatch(shapes, "x_embedder.weight", width)


def _text_tokens(cfg: Any) -> int:
    """Qwen3's caption tokens (at most model.flow.text_max_length; each caption its own length)."""
    return int(cfg.model.flow.text_max_length)


SPEC = FamilySpec(
    name="z_image",
    label="Z-Image",
    component="transformer",
    module_classes=("ZImageTransformer2DModel",),
    implementation="ds_trainer.train.families.z_image:ZImage",
    text_encoders=("qwen3",),
    attention_mask=True,
    pipeline="ZImagePipeline",
    fp16=(
        "Z-Image's transformer leaves fp16's range (ComfyUI clamps its attention and feed-forward "
        "outputs to run it in fp16; diffusers' does not), and it and Qwen3 are released in bf16"
    ),
    transformer_file=TransformerFile(
        mark="layers.0.adaLN_modulation.0.weight",
        label="a Z-Image transformer (its makers' layout, as ComfyUI's z_image_turbo_bf16)",
        example="z_image_turbo_bf16.safetensors",
        mismatch=_mismatch,
    ),
    code_url="https://github.com/Tongyi-MAI/Z-Image",
    modelspec_architecture="z-image",
    kohya_base_version="z_image",
    kohya_readers="ComfyUI (`models/loras`)",
    tags=("z-image", "text-to-image"),
    text_tokens=_text_tokens,
    input_layer="all_x_embedder.2-1",
)
