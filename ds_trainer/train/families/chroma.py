"""Chroma: ChromaTransformer2DModel (Flux.1's double- and single-stream blocks, their modulation
from one shared approximator of the timestep) trained by flow matching (train/flow.py) with the
resolution-dependent shift of its scheduler config, on Flux's VAE latents shifted, scaled and packed
2 x 2 into tokens with their 3-axis ids (Flux's: families/flux.py). No guidance input and no pooled
text: T5-XXL's sequence alone, encoded with its attention mask as ChromaPipeline encodes it, cached
in bf16 with the mask the transformer's attention is given (`prompt_mask`: the caption's tokens and
the first padding token, as the pipeline keeps it). ChromaPipeline samples (true classifier-free
guidance against a negative prompt) and is exported.

diffusers' Chroma hands its single-stream blocks no mask when gradient checkpointing recomputes them
(its `_gradient_checkpointing_func` call leaves the mask out); a run with
train.gradient_checkpointing says so."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.chroma import SPEC
from ds_trainer.train.families import common, flow
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.families.flux import image_ids, pack
from ds_trainer.train.layouts import chroma as chroma_layout
from ds_trainer.train.layouts.table import Part

log = logging.getLogger("ds_trainer")


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder",)
    vae: Any  # Flux's AutoencoderKL
    text_encoder: Any  # T5EncoderModel
    tokenizer: Any


def scheduler_line(cfg: DictConfig) -> tuple[int, int, float, float]:
    """The line the sampler's shift exponent follows (its scheduler config's tokens and shifts)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    path, kwargs = common.source(cfg)
    c = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler", **kwargs)
    return (
        int(c["base_image_seq_len"]),
        int(c["max_image_seq_len"]),
        float(c["base_shift"]),
        float(c["max_shift"]),
    )


def joint_mask(text_mask: torch.Tensor, image_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """ChromaPipeline's attention mask: the text's (1 on its kept tokens), then 1 for each image
    token, in the dtype it computes in (the transformer multiplies the mask by itself: a float mask,
    as the pipeline's is)."""
    ones = torch.ones(text_mask.shape[0], image_tokens, device=text_mask.device)
    return torch.cat([text_mask.float(), ones], dim=1).to(dtype)


class Chroma(FlowFamily):
    spec = SPEC
    name = SPEC.name

    def __init__(self, cfg: DictConfig | None = None) -> None:
        f = cfg.model.flow if cfg is not None else None
        self._t5_length = int(f.t5_max_length) if f is not None else 512

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        from diffusers import AutoencoderKL
        from transformers import T5Config, T5EncoderModel, T5Tokenizer

        console.adopt()
        path, kwargs = common.source(cfg)
        with whole():
            tokenizer = T5Tokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs)
            if cfg.model.pretrained:
                vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kwargs)
                encoder = T5EncoderModel.from_pretrained(path, subfolder="text_encoder", **kwargs)
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKL.from_config(AutoencoderKL.load_config(path, subfolder="vae"))
                encoder = T5EncoderModel(T5Config.from_pretrained(path, subfolder="text_encoder"))
        for module in (vae, encoder):
            module.requires_grad_(False)
            module.eval()
        return Frozen(vae, encoder, tokenizer)

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import ChromaTransformer2DModel

        if cfg.train.gradient_checkpointing:
            log.warning(
                "%s: with train.gradient_checkpointing diffusers' Chroma gives its single-stream "
                "blocks no text mask (ChromaTransformer2DModel leaves it out of the checkpointed "
                "call): the padding tokens are attended to there, unlike when it samples",
                cfg.model.name,
            )
        return common.trained_module(  # type: ignore[no-any-return]
            cfg, ChromaTransformer2DModel, "transformer", cfg.model.get("transformer")
        )

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import ChromaTransformer2DModel

        return common.meta_module(cfg, ChromaTransformer2DModel, "transformer")

    @torch.no_grad()
    def text_inputs(
        self,
        frozen: Frozen,
        prompts: list[str],
        device: torch.device,
        references: torch.Tensor | None = None,  # noqa: ARG002 - the protocol's
    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds`: T5's sequence, encoded with its attention mask; `prompt_mask`: 1 on the
        caption's tokens and the first padding token (ChromaPipeline's `_get_t5_prompt_embeds`)."""
        inputs = frozen.tokenizer(
            prompts,
            padding="max_length",
            max_length=self._t5_length,
            truncation=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask.to(device)
        embeds = frozen.text_encoder(
            inputs.input_ids.to(device), output_hidden_states=False, attention_mask=mask
        )[0]
        kept = torch.arange(mask.shape[1], device=device)[None] <= mask.sum(dim=1, keepdim=True)
        return {"prompt_embeds": embeds, "prompt_mask": kept.long()}

    def text_parts(self, frozen: Frozen) -> TextParts:  # noqa: ARG002 - the protocol's
        """T5 makes the whole sequence."""
        return {"t5": [("prompt_embeds", (slice(None), slice(None)))]}

    def schedule(self, cfg: DictConfig) -> flow.Schedule:
        """The flow schedule with the sampler's shift line (its scheduler config)."""
        return flow.Schedule.of(cfg, line=scheduler_line(cfg))

    def image_tokens(self, latents: torch.Tensor) -> int:
        """The packed tokens of the latents (2 x 2 patches): what the noise levels shift with."""
        return (latents.shape[-2] // 2) * (latents.shape[-1] // 2)

    def losses(
        self,
        model: Any,
        schedule: flow.Schedule,
        batch: dict[str, torch.Tensor],
        noise: torch.Tensor,
        t: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        latents = batch["latents"]
        height, width = latents.shape[-2:]
        tokens = self.image_tokens(latents)
        sigma = schedule.sigma(t, tokens)
        text = batch["prompt_embeds"]
        pred = model(
            hidden_states=pack(flow.noisy(latents, noise, sigma)).to(device, dtype),
            timestep=sigma.to(device),  # sigma, as the pipeline gives it (timestep / 1000)
            encoder_hidden_states=text.to(device, dtype),
            txt_ids=torch.zeros(text.shape[1], 3, device=device),
            img_ids=image_ids(height, width).to(device),
            attention_mask=joint_mask(batch["prompt_mask"].to(device), tokens, dtype),
        ).sample
        weight = batch.get("weight_map")  # the mask, packed: a weight per packed value
        return per_sample_mse(
            pred,
            pack(flow.target(latents, noise)),
            None if weight is None else pack(weight.expand_as(latents)),
        )

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        path, kwargs = common.source(cfg)
        model = trained.get("transformer")
        if model is None:
            model = self.load_trained(cfg).eval()
        return self.lora_pipeline()(
            transformer=model,
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(
                path, subfolder="scheduler", **kwargs
            ),
            vae=frozen.vae,
            text_encoder=frozen.text_encoder,
            tokenizer=frozen.tokenizer,
        )

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:  # noqa: ARG002 - the protocol's
        return {"max_sequence_length": self._t5_length}

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        """Its makers' names (Chroma1-HD.safetensors)."""
        return chroma_layout.tensors(denoiser)

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> list[Part]:
        """kohya's sd-scripts' Chroma LoRA names: its makers' modules (the fused qkv, `linear1`)."""
        return chroma_layout.parts(shapes, config.num_layers, config.num_single_layers)

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """2 x 2 patches of latents as tokens, 3-axis ids, the text's mask joined to the image's."""
        c, b, tokens, on = model.config, shape.batch, shape.tokens, shape.tensors
        image = (shape.height // 16) * (shape.width // 16)
        mask = torch.ones(b, tokens + image, **on)
        inputs = {
            "hidden_states": torch.randn(b, image, int(c.in_channels), **on),
            "encoder_hidden_states": torch.randn(b, tokens, int(c.joint_attention_dim), **on),
            "timestep": torch.rand(b, device=shape.device),
            "txt_ids": torch.zeros(tokens, 3, device=shape.device),
            "img_ids": torch.zeros(image, 3, device=shape.device),
            "attention_mask": mask,
        }
        return lambda: model(**inputs)

    def planner_blocks(self) -> tuple[type, ...]:
        """Double- and single-stream blocks."""
        from diffusers.models.transformers.transformer_chroma import (
            ChromaSingleTransformerBlock,
            ChromaTransformerBlock,
        )

        return (ChromaTransformerBlock, ChromaSingleTransformerBlock)

    def lora_pipeline(self) -> Any:
        from diffusers import ChromaPipeline

        return ChromaPipeline
