"""SD3 and SD3.5's facts: an MMDiT trained by flow matching, CLIP-L, CLIP-G and T5, its single file
the MMDiT and the VAE in Stability's layout (`model.transformer` reads the MMDiT's file)."""

from __future__ import annotations

from typing import Any

from ds_trainer.config.families.spec import (
    FamilySpec,
    TransformerFile,
    blocks,
    blocks_mismatch,
    width_mismatch,
)

_T5_FP16 = (
    "T5 overflows in fp16 (transformers keeps its feed-forward output projections in fp32 for "
    "this reason; cast whole, its hidden states are clamped to about 65504 and cached wrong for "
    "good), and the SD3/Flux transformers' activations leave fp16's range (diffusers runs them "
    "in bf16 or fp32)"
)


def _mismatch(shapes: dict[str, list[int]], arch: dict[str, Any], width: int) -> str | None:
    """Stability's MMDiT file against the architecture: its blocks, width, SD3.5 Medium's second
    attentions, QK-norm."""
    keys = set(shapes)
    dual, wanted = (
        sorted(blocks({k for k in keys if ".attn2." in k}, "joint_blocks.")),
        sorted(arch.get("dual_attention_layers") or []),
    )
    if dual != wanted:
        return (
            f"blocks {dual or 'none'} with a second attention (SD3.5 Medium's MMDiT-X), "
            f"the architecture {wanted or 'none'}: another SD3 model"
        )
    normed = any(".ln_q." in k for k in keys)
    if normed != bool(arch.get("qk_norm")):
        file_has, arch_has = (
            ("with" if normed else "without"),
            ("with" if arch.get("qk_norm") else "without"),
        )
        return (
            f"a transformer {file_has} QK-norm, the architecture {arch_has} (SD3.5 has it, SD3 not)"
        )
    found = blocks_mismatch(keys, "joint_blocks", int(arch["num_layers"]))
    if found:
        return found
    return width_mismatch(shapes, "x_embedder.proj.weight", width)


def _text_tokens(cfg: Any) -> int:
    """CLIP's 77 tokens, then T5's."""
    return int(cfg.model.flow.t5_max_length) + 77


def _context_lengths(cfg: Any, width: int, height: int,
                     frames: int) -> dict[str, int]:  # noqa: ARG001 - a still image
    """Its plan (train/families/joint_attention.py) splits the image's patch tokens and the
    caption's (CLIP's 77, then T5's)."""
    return {"image tokens": (width // 16) * (height // 16),
            "caption tokens (CLIP's 77 + model.flow.t5_max_length)":
                77 + int(cfg.model.flow.t5_max_length)}


SPEC = FamilySpec(
    name="sd3",
    label="SD3/SD3.5",
    component="transformer",
    module_classes=("SD3Transformer2DModel",),
    implementation="ds_trainer.train.families.sd3:SD3",
    text_encoders=("clip_l", "clip_g", "t5"),
    single_file_parts=("vae",),
    pipeline="StableDiffusion3Pipeline",
    fp16=_T5_FP16,
    transformer_file=TransformerFile(
        mark="joint_blocks.0.context_block.adaLN_modulation.1.bias",
        label="an SD3/SD3.5 transformer (Stability's MMDiT layout)",
        example="sd3.5_medium.safetensors",
        mismatch=_mismatch,
    ),
    code_url="https://github.com/Stability-AI/generative-models",
    modelspec_architecture="stable-diffusion-3-5-medium",
    kohya_base_version="5-medium",
    kohya_readers="ComfyUI (`models/loras`), kohya's sd-scripts (diffusers has no reader of this "
    "layout for SD3: use `pytorch_lora_weights.safetensors` there)",
    tags=("stable-diffusion-3", "sd3", "text-to-image"),
    text_tokens=_text_tokens,
    input_layer="pos_embed.proj",
    context_lengths=_context_lengths,
)
