"""SD3 and SD3.5: the MMDiT transformer (SD3Transformer2DModel), trained by flow matching (train/flow.py), on the
latents of a 16-channel VAE (scaled and shifted), conditioned on CLIP-L and CLIP-G (penultimate hidden states,
joined and zero-padded to T5's width, then T5's sequence after them; the two pooled projections joined), as
StableDiffusion3Pipeline encodes them; StableDiffusion3Pipeline samples and is exported.

The text encoders stay frozen here (diffusers' SD3 scripts train CLIP's LoRA at most, T5 never); their outputs are
cached with the latents, the long joined sequence in bf16 (`storage_dtype`: T5's 256 tokens of SD3.5 take 2.6 MiB
per caption in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.train import flow, models

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass
class Frozen:
    vae: Any
    text_encoder: Any  # CLIP-L (CLIPTextModelWithProjection)
    text_encoder_2: Any  # CLIP-G (CLIPTextModelWithProjection)
    text_encoder_3: Any  # T5 (T5EncoderModel)
    tokenizer: Any
    tokenizer_2: Any
    tokenizer_3: Any

    def modules(self) -> list[Any]:
        return [m for m in (self.vae, *self.encoders()) if m is not None]

    def encoders(self) -> list[Any]:
        return [m for m in (self.text_encoder, self.text_encoder_2, self.text_encoder_3) if m is not None]


class SD3:
    name = "sd3"
    component = "transformer"

    def __init__(self, cfg: DictConfig | None = None) -> None:
        flow_cfg = cfg.model.flow if cfg is not None else None
        self._t5_length = int(flow_cfg.t5_max_length) if flow_cfg is not None else 256  # T5's tokens per caption

    def load_frozen(self, cfg: DictConfig, deepspeed_plugin: Any = None) -> Frozen:
        from diffusers import AutoencoderKL
        from transformers import (
            CLIPTextConfig,
            CLIPTextModelWithProjection,
            CLIPTokenizer,
            T5Config,
            T5EncoderModel,
            T5Tokenizer,
        )

        console.adopt()
        path, kwargs = models._source(cfg)
        with models.outside_zero3(deepspeed_plugin):
            tokenizers = [CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs),
                          CLIPTokenizer.from_pretrained(path, subfolder="tokenizer_2", **kwargs),
                          T5Tokenizer.from_pretrained(path, subfolder="tokenizer_3", **kwargs)]
            if cfg.model.pretrained:
                vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kwargs)
                encoders = [CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder", **kwargs),
                            CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2", **kwargs),
                            T5EncoderModel.from_pretrained(path, subfolder="text_encoder_3", **kwargs)]
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKL.from_config(AutoencoderKL.load_config(path, subfolder="vae"))
                encoders = [CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(path, subfolder=name))
                            for name in ENCODERS[:2]]
                encoders.append(T5EncoderModel(T5Config.from_pretrained(path, subfolder="text_encoder_3")))
        for module in (vae, *encoders):
            module.requires_grad_(False)
            module.eval()
        return Frozen(vae, *encoders, *tokenizers)

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import SD3Transformer2DModel

        path, kwargs = models._source(cfg)
        if cfg.model.pretrained:
            model = SD3Transformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.float32,
                                                          **kwargs)
        else:
            torch.manual_seed(int(cfg.train.seed))
            model = SD3Transformer2DModel.from_config(SD3Transformer2DModel.load_config(path, subfolder="transformer"))
        if cfg.train.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        model.train()
        return model  # type: ignore[no-any-return]

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import SD3Transformer2DModel

        path, kwargs = models._source(cfg)
        with torch.device("meta"):
            model: torch.nn.Module = SD3Transformer2DModel.from_config(
                SD3Transformer2DModel.load_config(path, subfolder="transformer", **kwargs))
        return model

    @torch.no_grad()
    def text_inputs(self, frozen: Frozen, prompts: list[str], device: torch.device,
                    max_length: int | None = None) -> dict[str, torch.Tensor]:
        """`prompt_embeds` (CLIP-L and CLIP-G's penultimate states joined, padded to T5's width, then T5's
        sequence) and `pooled` (the two CLIP projections joined)."""
        states, pooled = [], []
        clips = ((frozen.tokenizer, frozen.text_encoder), (frozen.tokenizer_2, frozen.text_encoder_2))
        for tokenizer, encoder in clips:
            out = encoder(models.token_ids(tokenizer, prompts).to(device), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        clip = torch.cat(states, dim=-1)
        length = max_length if max_length is not None else self._t5_length
        ids = frozen.tokenizer_3(prompts, padding="max_length", max_length=length, truncation=True,
                                 add_special_tokens=True, return_tensors="pt").input_ids
        t5 = frozen.text_encoder_3(ids.to(device))[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"prompt_embeds": torch.cat([clip, t5.to(clip.dtype)], dim=-2), "pooled": torch.cat(pooled, dim=-1)}

    @torch.no_grad()
    def encode_images(self, frozen: Frozen, pixels: torch.Tensor) -> torch.Tensor:
        vae = frozen.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def storage_dtype(self, key: str) -> torch.dtype | None:
        return torch.bfloat16 if key == "prompt_embeds" else None

    def schedule(self, cfg: DictConfig) -> flow.Schedule:
        return flow.Schedule.of(cfg)

    def num_train_timesteps(self, schedule: flow.Schedule) -> int:
        return schedule.num_train_timesteps

    def training_loss(self, cfg: DictConfig, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor],
                      gens: list[torch.Generator], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in gens])
        t = schedule.draw(gens)
        per_sample = self.losses(model, schedule, batch, noise, t, device, dtype)
        return (per_sample * schedule.weights(schedule.sigma(t)).to(device)).mean()

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        sigma = schedule.sigma(t)
        noisy = flow.noisy(latents, noise, sigma)
        pred = model(hidden_states=noisy.to(device, dtype), timestep=(sigma * schedule.num_train_timesteps).to(device),
                     encoder_hidden_states=batch["prompt_embeds"].to(device, dtype),
                     pooled_projections=batch["pooled"].to(device, dtype)).sample
        target = flow.target(latents, noise)
        per_sample = torch.nn.functional.mse_loss(pred.float(), target.to(device).float(), reduction="none")
        return per_sample.mean(dim=list(range(1, per_sample.ndim)))

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        path, kwargs = models._source(cfg)
        return StableDiffusion3Pipeline(
            transformer=trained["transformer"] if "transformer" in trained else self.load_trained(cfg).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kwargs),
            vae=frozen.vae, text_encoder=frozen.text_encoder, tokenizer=frozen.tokenizer,
            text_encoder_2=frozen.text_encoder_2, tokenizer_2=frozen.tokenizer_2,
            text_encoder_3=frozen.text_encoder_3, tokenizer_3=frozen.tokenizer_3)

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        return {"max_sequence_length": int(cfg.model.flow.t5_max_length)}

    def lora_pipeline(self) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline
