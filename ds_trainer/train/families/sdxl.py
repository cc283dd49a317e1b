"""SDXL: a UNet with text_time micro-conditioning, DDPM noise (epsilon or v-prediction, optional min-SNR
weighting), CLIP-L and OpenCLIP-bigG, StableDiffusionXLPipeline; and SDXL's parts, built and encoded here.

`model.pretrained` (a local diffusers folder, a hub id, or a single-file SDXL checkpoint: see single_file.py) loads
weights, `model.vae` replaces the VAE; without it every part is built from the architecture's configs with random
weights (common.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config import weights_file
from ds_trainer.config.families.sdxl import SPEC
from ds_trainer.train.families import common, text_encoders
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.layouts import sdxl as sdxl_layout
from ds_trainer.train.layouts.table import Part


class SDXL:
    spec = SPEC
    name = SPEC.name
    component = SPEC.component
    sequence_encoder = ""  # CLIP's 77 tokens, cached in float32
    text_sees_reference = False

    def __init__(self, cfg: DictConfig | None = None) -> None:  # noqa: ARG002 - one constructor for every family
        pass

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        return load_frozen(cfg, whole)

    def context_plan(self, model: torch.nn.Module) -> dict[str, Any] | None:  # noqa: ARG002
        """diffusers' own plan (the class's `_cp_plan`), where there is one."""
        return None

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        x, t, enc, cond = unet_inputs(model.config, shape.batch, shape.height, shape.width,
                                      shape.dtype, shape.device, shape.tokens)
        return lambda: model(x, t, enc, added_cond_kwargs=cond)

    def planner_blocks(self) -> tuple[type, ...]:
        """The UNet's ResNet and transformer blocks."""
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.transformers.transformer_2d import Transformer2DModel

        return (ResnetBlock2D, Transformer2DModel)

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        return sdxl_layout.unet_tensors(denoiser)

    def single_file(self, denoiser: Any, parts: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Stability's SGM file: the UNet, the VAE and both text encoders."""
        return {**self.single_file_denoiser(denoiser), **sdxl_layout.vae_tensors(parts["vae"]),
                **sdxl_layout.encoder_tensors(parts["text_encoder"], parts["text_encoder_2"])}

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> list[Part]:
        return sdxl_layout.unet(shapes, config.layers_per_block)

    def unused(self, model: torch.nn.Module) -> list[str]:  # noqa: ARG002 - the Family protocol's signature
        return []

    def guidance_kwargs(self, scale: float, negative: str) -> dict[str, Any]:
        return {"guidance_scale": scale, "negative_prompt": negative or None}  # None: the zeroed unconditional

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        return load_unet(cfg)  # type: ignore[no-any-return]

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import UNet2DConditionModel

        return common.meta_module(cfg, UNet2DConditionModel, "unet")

    def text_inputs(self, frozen: Any, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None,  # noqa: ARG002 - the Family protocol's signature
                    ) -> dict[str, torch.Tensor]:
        return text_inputs(frozen, prompts, device)

    def text_parts(self, frozen: Any) -> TextParts:
        """CLIP-L's and OpenCLIP-bigG's widths of `prompt_embeds`, and bigG's `pooled` (both encoders frozen:
        data.text_encoder_dropout is refused with text-encoder training)."""
        width = int(frozen.text_encoder.config.hidden_size)
        return {"clip_l": [("prompt_embeds", (slice(None), slice(0, width)))],
                "clip_g": [("prompt_embeds", (slice(None), slice(width, None))), ("pooled", (slice(None),))]}

    def encode_images(self, frozen: Any, pixels: torch.Tensor) -> torch.Tensor:
        return encode_images(frozen, pixels)

    def conditioning(
            self, frozen: Any, pixels: torch.Tensor,  # noqa: ARG002 - the protocol's
    ) -> dict[str, torch.Tensor]:
        """Nothing beside the latents."""
        return {}

    def storage_dtype(self, key: str) -> torch.dtype | None:  # noqa: ARG002 - the Family protocol's signature
        return None

    def schedule(self, cfg: DictConfig) -> Any:
        return noise_scheduler(cfg)

    def num_train_timesteps(self, schedule: Any) -> int:
        return int(schedule.config.num_train_timesteps)

    def training_loss(self, cfg: DictConfig, model: Any, schedule: Any, batch: dict[str, torch.Tensor],
                      gens: list[torch.Generator], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Each sample's denoising loss (epsilon or v-prediction, optional min-SNR weighting, its source's weight)."""
        latents = batch["latents"]
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in gens])
        if cfg.train.noise_offset:
            noise += cfg.train.noise_offset * torch.stack([torch.randn((latents.shape[1], 1, 1), generator=g)
                                                           for g in gens])
        steps = schedule.config.num_train_timesteps
        t = torch.cat([torch.randint(0, steps, (1,), generator=g) for g in gens])
        per_sample = self.losses(model, schedule, batch, noise, t, device, dtype)
        if cfg.train.min_snr_gamma:
            from diffusers.training_utils import compute_snr

            snr = compute_snr(schedule, t).to(device)
            clipped = snr.clamp(max=float(cfg.train.min_snr_gamma))
            prediction_type = schedule.config.prediction_type
            per_sample = per_sample * (clipped / snr if prediction_type == "epsilon" else clipped / (snr + 1))
        return common.source_weights(batch, per_sample)

    def losses(self, model: Any, schedule: Any, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Each sample's mean squared error (fp32) between the UNet's prediction for its latents noised with `noise`
        at timestep `t` and the target of the scheduler's prediction type (the noise, or the velocity)."""
        latents = batch["latents"]
        noisy = schedule.add_noise(latents, noise, t)
        prediction_type = schedule.config.prediction_type
        target = noise if prediction_type == "epsilon" else schedule.get_velocity(latents, noise, t)
        if "prompt_embeds" in batch:  # the text encoders are frozen: their cached conditioning
            cond = {"text_embeds": batch["pooled"].to(device, dtype), "time_ids": batch["time_ids"].to(device, dtype)}
            pred = model(noisy.to(device, dtype), t.to(device), batch["prompt_embeds"].to(device, dtype),
                         added_cond_kwargs=cond).sample
        else:  # a text encoder trains: the model (text_encoders.Denoiser) encodes the token ids itself
            text = {key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
                    for key, value in batch.items() if key in text_encoders.TEXT_KEYS}
            pred = model(noisy.to(device, dtype), t.to(device), text, batch["time_ids"].to(device, dtype)).sample
        return common.per_sample_mse(pred, target, batch.get("weight_map"))

    def pipeline(self, cfg: DictConfig, frozen: Any, trained: dict[str, Any]) -> Any:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=frozen.vae, text_encoder=trained.get("text_encoder", frozen.text_encoder),
            text_encoder_2=trained.get("text_encoder_2", frozen.text_encoder_2), tokenizer=frozen.tokenizer,
            tokenizer_2=frozen.tokenizer_2,
            unet=trained["unet"] if "unet" in trained else load_unet(cfg).eval(),
            scheduler=inference_scheduler(cfg))

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:  # noqa: ARG002 - the Family protocol's signature
        return {}

    def lora_pipeline(self) -> Any:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline


# --- SDXL's parts: CLIP-L and OpenCLIP-bigG, the VAE, the UNet, its schedulers


@dataclass
class Frozen:
    """The parts that are not trained: kept out of ZeRO, used to encode images and captions."""

    vae: Any
    text_encoder: Any  # None where it trains (text_encoders=lora|full): it is part of the trained module then
    text_encoder_2: Any
    tokenizer: Any
    tokenizer_2: Any

    def modules(self) -> list[Any]:
        """The frozen modules (the VAE and the encoders that do not train)."""
        return [m for m in (self.vae, *self.encoders())]

    def encoders(self) -> list[Any]:
        """The frozen text encoders (those that do not train)."""
        return [m for m in (self.text_encoder, self.text_encoder_2) if m is not None]


def load_frozen(cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
    """VAE, both text encoders and tokenizers, in eval mode with gradients off, built inside `whole()`."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    console.adopt()  # diffusers and transformers, imported now, log through the run's handlers

    from ds_trainer.train.families import single_file

    path, kwargs = common.source(cfg)
    with whole():
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs)
        tokenizer_2 = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2", **kwargs)
        if weights_file.is_single_file(cfg.model.pretrained):
            state = single_file.checkpoint(cfg)
            vae = single_file.vae(cfg, state)
            te1, te2 = single_file.text_encoders(cfg, state)
            del state
        elif cfg.model.pretrained:
            vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kwargs)
            te1 = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kwargs)
            te2 = CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", **kwargs)
        else:
            torch.manual_seed(int(cfg.train.seed))
            vae = AutoencoderKL.from_config(AutoencoderKL.load_config(path, subfolder="vae"))
            te1 = CLIPTextModel(CLIPTextConfig.from_pretrained(path, subfolder="text_encoder"))
            te2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(path, subfolder="text_encoder_2"))
        if cfg.model.vae is not None and not weights_file.is_single_file(cfg.model.pretrained):
            # e.g. the fp16-safe SDXL VAE instead of the model's own (single_file.vae applied it above)
            vae = single_file.vae(cfg)
    for module in (vae, te1, te2):
        module.requires_grad_(False)
        module.eval()
    return Frozen(vae, te1, te2, tokenizer, tokenizer_2)


def load_unet(cfg: DictConfig) -> Any:
    """The UNet to train, in fp32 (DeepSpeed or Accelerate casts for mixed precision)."""
    from diffusers import UNet2DConditionModel

    from ds_trainer.train.families import single_file

    single = single_file.checkpoint(cfg) if weights_file.is_single_file(cfg.model.pretrained) else None
    return common.trained_module(cfg, UNet2DConditionModel, "unet", single)


def noise_scheduler(cfg: DictConfig) -> Any:
    """The training noise schedule (DDPM) from the model's scheduler config."""
    from diffusers import DDPMScheduler

    path, kwargs = common.source(cfg)
    return DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kwargs)


def inference_scheduler(cfg: DictConfig) -> Any:
    """The scheduler exported with the pipeline (the model's own, Euler for SDXL)."""
    from diffusers import EulerDiscreteScheduler

    path, kwargs = common.source(cfg)
    return EulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kwargs)


@torch.no_grad()
def encode_prompts(frozen: Frozen, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL text conditioning: both encoders' penultimate hidden states, concatenated, and the
    second encoder's pooled projection."""
    states = []
    pooled = None
    for tokenizer, encoder in ((frozen.tokenizer, frozen.text_encoder), (frozen.tokenizer_2, frozen.text_encoder_2)):
        ids = common.token_ids(tokenizer, prompts).to(device)
        out = encoder(ids, output_hidden_states=True)
        states.append(out.hidden_states[-2])
        pooled = out.text_embeds if hasattr(out, "text_embeds") else out[0]
    assert pooled is not None
    return torch.cat(states, dim=-1), pooled


@torch.no_grad()
def text_inputs(frozen: Frozen, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """What a batch carries for its captions: with both encoders frozen their conditioning (`prompt_embeds`,
    `pooled`); with an encoder trained (its slot in `frozen` is None) its token ids (`input_ids`, `input_ids_2`)
    and the frozen one's outputs (`embeds_1`, or `embeds_2` and `pooled`), which the trained module joins."""
    if frozen.text_encoder is not None and frozen.text_encoder_2 is not None:
        embeds, pooled = encode_prompts(frozen, prompts, device)
        return {"prompt_embeds": embeds, "pooled": pooled}
    out: dict[str, torch.Tensor] = {}
    if frozen.text_encoder is None:
        out["input_ids"] = common.token_ids(frozen.tokenizer, prompts)
    else:
        ids = common.token_ids(frozen.tokenizer, prompts).to(device)
        out["embeds_1"] = frozen.text_encoder(ids, output_hidden_states=True).hidden_states[-2]
    if frozen.text_encoder_2 is None:
        out["input_ids_2"] = common.token_ids(frozen.tokenizer_2, prompts)
    else:
        ids = common.token_ids(frozen.tokenizer_2, prompts).to(device)
        result = frozen.text_encoder_2(ids, output_hidden_states=True)
        out["embeds_2"], out["pooled"] = result.hidden_states[-2], result.text_embeds
    return out


@torch.no_grad()
def encode_images(frozen: Frozen, pixels: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] to scaled VAE latents (the VAE's mean: deterministic, cacheable)."""
    vae = frozen.vae
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
    return latents * vae.config.scaling_factor


def unet_inputs(config: Any, batch: int, height: int, width: int, dtype: Any = None,
                device: Any = None, tokens: int = 77) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Random SDXL UNet inputs for images of height x width pixels: latents, timesteps, prompt
    embeddings and the added conditions (pooled text embedding, time ids)."""
    time_ids = 6 * int(config.addition_time_embed_dim)
    pooled = int(config.projection_class_embeddings_input_dim) - time_ids
    kw = {"dtype": dtype, "device": device}
    latents = torch.randn(batch, int(config.in_channels), height // 8, width // 8, **kw)
    embeds = torch.randn(batch, tokens, int(config.cross_attention_dim), **kw)
    cond = {"text_embeds": torch.randn(batch, pooled, **kw),
            "time_ids": torch.randn(batch, 6, **kw)}
    return latents, torch.randint(0, 1000, (batch,), device=device), embeds, cond
