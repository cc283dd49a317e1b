"""Flux.1: FluxTransformer2DModel (double- and single-stream blocks) trained by flow matching (train/flow.py) with
the resolution-dependent shift its sampler uses, on the VAE's latents shifted and scaled, then packed 2 x 2 into
tokens with their 3-axis position ids (text tokens at 0); the guidance-distilled dev model is given `model.flow
.guidance` as its guidance input. Captions: CLIP-L's pooled output and T5's sequence, as FluxPipeline encodes them
(T5's sequence cached in bf16). FluxPipeline samples and is exported.

The text encoders stay frozen here (diffusers' Flux scripts train CLIP's LoRA at most, T5 never).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.flux import SPEC
from ds_trainer.train.families import common, flow
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.layouts import transformers as transformers_layout
from ds_trainer.train.layouts.table import Part


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")
    vae: Any
    text_encoder: Any  # CLIP-L (CLIPTextModel): its pooled output
    text_encoder_2: Any  # T5 (T5EncoderModel): the sequence
    tokenizer: Any
    tokenizer_2: Any


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents to (B, H/2 * W/2, 4C) tokens, each a 2 x 2 patch (FluxPipeline's layout)."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def image_ids(height: int, width: int, frame: int = 0) -> torch.Tensor:
    """The position ids of the packed tokens of (height x width) latents: (frame, row, column) per token (Kontext's
    reference image: frame 1)."""
    ids = torch.full((height // 2, width // 2, 3), float(frame))
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


class Flux(FlowFamily):
    spec = SPEC
    name = SPEC.name

    def __init__(self, cfg: DictConfig | None = None) -> None:
        f = cfg.model.flow if cfg is not None else None
        self._t5_length = int(f.t5_max_length) if f is not None else 512
        self._guidance = float(f.guidance) if f is not None and f.guidance is not None else None
        # Flux.1 Kontext: the reference image's tokens follow the image's, at frame 1 of the position ids
        self.reference = bool(cfg.model.get("reference_images")) if cfg is not None else False

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        from diffusers import AutoencoderKL
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

        console.adopt()
        path, kwargs = common.source(cfg)
        with whole():
            tokenizers = [CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs),
                          T5Tokenizer.from_pretrained(path, subfolder="tokenizer_2", **kwargs)]
            if cfg.model.pretrained:
                vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kwargs)
                encoders = [CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kwargs),
                            T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", **kwargs)]
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKL.from_config(AutoencoderKL.load_config(path, subfolder="vae"))
                encoders = [CLIPTextModel(CLIPTextConfig.from_pretrained(path, subfolder="text_encoder")),
                            T5EncoderModel(T5Config.from_pretrained(path, subfolder="text_encoder_2"))]
        for module in (vae, *encoders):
            module.requires_grad_(False)
            module.eval()
        return Frozen(vae, *encoders, *tokenizers)

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import FluxTransformer2DModel

        from ds_trainer.errors import TrainingError

        model = common.trained_module(cfg, FluxTransformer2DModel, "transformer", cfg.model.get("transformer"))
        takes = bool(model.config.guidance_embeds)
        if takes != (self._guidance is not None):
            fix = "model.flow.guidance=3.5 (the dev model's training value)" if takes else "model.flow.guidance=null"
            raise TrainingError(f"model.flow.guidance={self._guidance}: this Flux transformer "
                                f"{'takes' if takes else 'has no'} guidance input (guidance_embeds={takes}); {fix}")
        return model  # type: ignore[no-any-return]

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import FluxTransformer2DModel

        return common.meta_module(cfg, FluxTransformer2DModel, "transformer")

    @torch.no_grad()
    def text_inputs(self, frozen: Frozen, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None,  # noqa: ARG002 - the Family protocol's signature
                    ) -> dict[str, torch.Tensor]:
        """`pooled` (CLIP-L's pooled output) and `prompt_embeds` (T5's sequence); Kontext's captions are encoded
        without their reference (`references` unread)."""
        pooled = frozen.text_encoder(common.token_ids(frozen.tokenizer, prompts).to(device)).pooler_output
        ids = frozen.tokenizer_2(prompts, padding="max_length", max_length=self._t5_length, truncation=True,
                                 return_tensors="pt").input_ids
        return {"prompt_embeds": frozen.text_encoder_2(ids.to(device))[0], "pooled": pooled}

    def text_parts(self, frozen: Frozen) -> TextParts:  # noqa: ARG002 - the Family protocol's signature
        """CLIP-L makes `pooled`, T5 the `prompt_embeds` sequence."""
        return {"clip_l": [("pooled", (slice(None),))], "t5": [("prompt_embeds", (slice(None), slice(None)))]}

    def image_tokens(self, latents: torch.Tensor) -> int:
        """The packed tokens of the latents (2 x 2 patches): what Flux's noise levels shift with."""
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        height, width = latents.shape[-2:]
        sigma = schedule.sigma(t, self.image_tokens(latents))  # Kontext's shift: the image's tokens alone
        noisy = pack(flow.noisy(latents, noise, sigma))
        ids = image_ids(height, width)
        if "control_latents" in batch:  # Kontext: the reference's tokens after the image's, at frame 1
            reference = batch["control_latents"]
            noisy = torch.cat([noisy, pack(reference.to(noisy.dtype))], dim=1)
            ids = torch.cat([ids, image_ids(reference.shape[-2], reference.shape[-1], frame=1)])
        text = batch["prompt_embeds"]
        guidance = torch.full((len(t),), self._guidance, device=device) if self._guidance is not None else None
        pred = model(hidden_states=noisy.to(device, dtype), timestep=sigma.to(device),  # Flux's timestep is sigma
                     guidance=guidance, pooled_projections=batch["pooled"].to(device, dtype),
                     encoder_hidden_states=text.to(device, dtype), txt_ids=torch.zeros(text.shape[1], 3, device=device),
                     img_ids=ids.to(device), return_dict=False)[0][:, :(height // 2) * (width // 2)]  # its own
        weight = batch.get("weight_map")  # the mask packed as the latents are: one weight per packed value
        return per_sample_mse(pred, pack(flow.target(latents, noise)),
                              None if weight is None else pack(weight.expand_as(latents)))

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        path, kwargs = common.source(cfg)
        return self.lora_pipeline()(
            transformer=trained["transformer"] if "transformer" in trained else self.load_trained(cfg).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kwargs),
            vae=frozen.vae, text_encoder=frozen.text_encoder, tokenizer=frozen.tokenizer,
            text_encoder_2=frozen.text_encoder_2, tokenizer_2=frozen.tokenizer_2)

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        if not self.reference:
            return {"max_sequence_length": self._t5_length}
        from ds_trainer.config import samples

        # Kontext: the reference at the sample's size, not snapped to its preferred resolutions around 1 MP
        width, height = samples.size(cfg)
        return {"max_sequence_length": self._t5_length, "max_area": width * height, "_auto_resize": False}

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        return transformers_layout.flux_tensors(denoiser)

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> list[Part]:
        return transformers_layout.flux(shapes, config.num_layers, config.num_single_layers)

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """2 x 2 patches of latents as tokens, 3-axis ids."""
        c, b, tokens, on = model.config, shape.batch, shape.tokens, shape.tensors
        image = (shape.height // 16) * (shape.width // 16)
        inputs = {"hidden_states": torch.randn(b, image, int(c.in_channels), **on),
                  "encoder_hidden_states": torch.randn(b, tokens, int(c.joint_attention_dim), **on),
                  "pooled_projections": torch.randn(b, int(c.pooled_projection_dim), **on),
                  "timestep": torch.rand(b, device=shape.device),
                  "txt_ids": torch.zeros(tokens, 3, device=shape.device),
                  "img_ids": torch.zeros(image, 3, device=shape.device), "guidance": None}
        if c.guidance_embeds:
            inputs["guidance"] = torch.full((b,), 3.5, device=shape.device)
        return lambda: model(**inputs)

    def planner_blocks(self) -> tuple[type, ...]:
        """Double- and single-stream blocks."""
        from diffusers.models.transformers.transformer_flux import (
            FluxSingleTransformerBlock,
            FluxTransformerBlock,
        )

        return (FluxTransformerBlock, FluxSingleTransformerBlock)

    def lora_pipeline(self) -> Any:
        """FluxPipeline, or FluxKontextPipeline for a model that edits a reference image (the same LoRA keys)."""
        from diffusers import FluxKontextPipeline, FluxPipeline

        return FluxKontextPipeline if self.reference else FluxPipeline
