"""SDXL: a UNet with text_time micro-conditioning, DDPM noise (epsilon or v-prediction, optional min-SNR
weighting), CLIP-L and OpenCLIP-bigG (train/models.py builds and encodes), StableDiffusionXLPipeline."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.train import models, text_encoders


class SDXL:
    name = "sdxl"
    component = "unet"

    def load_frozen(self, cfg: DictConfig, deepspeed_plugin: Any = None) -> models.Frozen:
        return models.load_frozen(cfg, deepspeed_plugin)

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        return models.load_unet(cfg)  # type: ignore[no-any-return]

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import UNet2DConditionModel

        return models.meta_module(cfg, UNet2DConditionModel, "unet")

    def text_inputs(self, frozen: Any, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        return models.text_inputs(frozen, prompts, device)

    def encode_images(self, frozen: Any, pixels: torch.Tensor) -> torch.Tensor:
        return models.encode_images(frozen, pixels)

    def storage_dtype(self, key: str) -> torch.dtype | None:
        return None

    def schedule(self, cfg: DictConfig) -> Any:
        return models.noise_scheduler(cfg)

    def num_train_timesteps(self, schedule: Any) -> int:
        return int(schedule.config.num_train_timesteps)

    def training_loss(self, cfg: DictConfig, model: Any, schedule: Any, batch: dict[str, torch.Tensor],
                      gens: list[torch.Generator], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The denoising loss (epsilon or v-prediction, optional min-SNR weighting)."""
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
        return per_sample.mean()

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
        per_sample = torch.nn.functional.mse_loss(pred.float(), target.to(device).float(), reduction="none")
        return per_sample.mean(dim=list(range(1, per_sample.ndim)))

    def pipeline(self, cfg: DictConfig, frozen: Any, trained: dict[str, Any]) -> Any:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline(
            vae=frozen.vae, text_encoder=trained.get("text_encoder", frozen.text_encoder),
            text_encoder_2=trained.get("text_encoder_2", frozen.text_encoder_2), tokenizer=frozen.tokenizer,
            tokenizer_2=frozen.tokenizer_2,
            unet=trained["unet"] if "unet" in trained else models.load_unet(cfg).eval(),
            scheduler=models.inference_scheduler(cfg))

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        return {}

    def lora_pipeline(self) -> Any:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline
