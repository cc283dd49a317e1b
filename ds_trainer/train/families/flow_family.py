"""What SD3 and Flux share (families/sd3.py, families/flux.py): the frozen parts' shape, the VAE's shifted and
scaled latents, T5's long sequence cached in bf16, the flow-matching schedule (train/flow.py) and its weighted loss.
A family adds its encoders, how the transformer is called (`losses`) and, for Flux, the image's token count that
shifts its noise levels (`image_tokens`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer.train.families import common, flow


class FrozenParts:
    """The frozen VAE and encoders (a dataclass's fields: `vae` and the names in ENCODERS)."""

    ENCODERS: ClassVar[tuple[str, ...]]
    vae: Any

    def modules(self) -> list[Any]:
        return [m for m in (self.vae, *self.encoders()) if m is not None]

    def encoders(self) -> list[Any]:
        return [m for m in (getattr(self, name) for name in self.ENCODERS) if m is not None]


class FlowFamily:
    component = "transformer"
    sequence_encoder = "T5"
    text_sees_reference = False  # Qwen-Image-Edit's captions are encoded with their reference image

    def unused(self, model: torch.nn.Module) -> list[str]:  # noqa: ARG002 - the Family protocol's signature
        return []  # SD3's last joint block updates no text; Flux's single-stream blocks end on the image tokens

    def single_file(self, denoiser: Any, parts: dict[str, Any]) -> dict[str, torch.Tensor]:  # noqa: ARG002
        """The transformer alone (Flux.1's and Qwen-Image's files): its spec holds no other part."""
        return self.single_file_denoiser(denoiser)  # type: ignore[attr-defined, no-any-return]

    def guidance_kwargs(self, scale: float, negative: str) -> dict[str, Any]:
        """SD3: classifier-free guidance (an empty negative prompt encoded); Flux.1-dev: the distilled guidance."""
        return {"guidance_scale": scale, "negative_prompt": negative or None}

    def image_tokens(self, latents: torch.Tensor) -> int | None:  # noqa: ARG002 - the Family protocol's signature
        """The image's token count where the noise levels shift with it (Flux); None for a fixed shift."""
        return None

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def encode_images(self, frozen: Any, pixels: torch.Tensor) -> torch.Tensor:
        vae = frozen.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def conditioning(
            self, frozen: Any, pixels: torch.Tensor,  # noqa: ARG002 - the protocol's
    ) -> dict[str, torch.Tensor]:
        """Nothing beside the latents (Wan's image to video has more)."""
        return {}

    def context_plan(self, model: torch.nn.Module) -> dict[str, Any] | None:  # noqa: ARG002
        """diffusers' own plan (the class's `_cp_plan`), where there is one."""
        return None

    def storage_dtype(self, key: str) -> torch.dtype | None:
        return torch.bfloat16 if key == "prompt_embeds" else None

    def schedule(self, cfg: DictConfig) -> flow.Schedule:
        return flow.Schedule.of(cfg)

    def num_train_timesteps(self, schedule: flow.Schedule) -> int:
        return schedule.num_train_timesteps

    def training_loss(self, cfg: DictConfig, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor],  # noqa: ARG002
                      gens: list[torch.Generator], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in gens])
        t = schedule.draw(gens)
        per_sample = self.losses(model, schedule, batch, noise, t, device, dtype)
        sigma = schedule.sigma(t, self.image_tokens(latents))
        return common.source_weights(batch, per_sample * schedule.weights(sigma).to(device))
