"""Qwen-Image's facts (and Qwen-Image-Edit's): a dual-stream MMDiT trained by flow matching with the
resolution-dependent shift on a video VAE's packed latents, captions by Qwen2.5-VL
(Qwen-Image-Edit's encoded with the reference picture); its single file the transformer alone in
diffusers' names, as ComfyUI's."""

from __future__ import annotations

from typing import Any

from ds_trainer.config.families.spec import (
    FamilySpec,
    TransformerFile,
    blocks_mismatch,
    width_mismatch,
)


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """ComfyUI's file (diffusers' names) against the architecture: its blocks and width."""
    keys = set(shapes)
    found = blocks_mismatch(keys, "transformer_blocks", int(arch["num_layers"]))
    if found:
        return found
    return width_mismatch(shapes, "img_in.weight", width)


def _text_tokens(cfg: Any) -> int:
    """Qwen2.5-VL's caption tokens after the template's prefix (an editing model's reference's
    vision tokens come before them: the planner adds those)."""
    return int(cfg.model.flow.text_max_length)


def _context_lengths(cfg: Any, width: int, height: int,
                     frames: int) -> dict[str, int]:  # noqa: ARG001 - a still image
    """The plan splits the image's packed tokens and the caption's (its mask with them)."""
    return {"image tokens": (width // 16) * (height // 16),
            "caption tokens": int(cfg.model.flow.text_max_length)}


SPEC = FamilySpec(
    name="qwen_image",
    label="Qwen-Image",
    component="transformer",
    module_classes=("QwenImageTransformer2DModel",),
    implementation="ds_trainer.train.families.qwen_image:QwenImage",
    text_encoders=("qwen_vl",),
    dynamic_shift=True,
    attention_mask=True,
    fp16=(
        "diffusers clips its transformer's streams to +-65504 in fp16 as it does Flux.1's (their "
        "activations leave fp16's range), and Qwen2.5-VL encodes the captions in the same dtype"
    ),
    caption_limit=1024,
    caption_sees_reference=True,
    references=3,  # Qwen-Image-Edit-2509/2511's QwenImageEditPlusPipeline: Picture 1 to 3
    reference_area=384 * 384,  # its CONDITION_IMAGE_SIZE
    pipeline="QwenImagePipeline",
    transformer_file=TransformerFile(
        mark="txt_norm.weight",
        label="a Qwen-Image transformer (diffusers' names, as ComfyUI's file)",
        example="qwen_image_bf16.safetensors",
        mismatch=_mismatch,
        bare_names=True,
    ),
    code_url="https://github.com/QwenLM/Qwen-Image",
    modelspec_architecture="qwen-image",
    kohya_base_version="qwen_image",
    kohya_readers="ComfyUI (`models/loras`), musubi-tuner, diffusers' `load_lora_weights`",
    tags=("qwen-image", "text-to-image"),
    text_tokens=_text_tokens,
    input_layer="img_in",
    context_lengths=_context_lengths,
)
