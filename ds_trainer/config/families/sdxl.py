"""SDXL's facts: a UNet trained on DDPM noise, CLIP-L and OpenCLIP-bigG, a single file that holds
the VAE and both encoders in Stability's SGM layout (read through `model.pretrained`, not
`model.transformer`)."""

from __future__ import annotations

from ds_trainer.config.families.spec import FamilySpec

SPEC = FamilySpec(
    name="sdxl",
    label="SDXL",
    component="unet",
    module_classes=("UNet2DConditionModel",),
    implementation="ds_trainer.train.families.sdxl:SDXL",
    text_encoders=("clip_l", "clip_g"),
    single_file_parts=("vae", "text_encoder", "text_encoder_2"),
    flow=False,
    pipeline="StableDiffusionXLPipeline",
    code_url="https://github.com/Stability-AI/generative-models",
    modelspec_architecture="stable-diffusion-xl-v1-base",
    kohya_base_version="sdxl_base_v1-0",
    kohya_readers="ComfyUI (`models/loras`), Forge, kohya's scripts, "
    "diffusers' `load_lora_weights`",
    diffusers_lora_in_comfyui=False,
    tags=("stable-diffusion-xl", "text-to-image"),
    cache_key_without_family=True,
)
