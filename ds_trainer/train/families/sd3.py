"""SD3 and SD3.5: the MMDiT transformer (SD3Transformer2DModel), trained by flow matching (train/flow.py), on the
latents of a 16-channel VAE (scaled and shifted), conditioned on CLIP-L and CLIP-G (penultimate hidden states,
joined and zero-padded to T5's width, then T5's sequence after them; the two pooled projections joined), as
StableDiffusion3Pipeline encodes them; StableDiffusion3Pipeline samples and is exported.

The text encoders stay frozen here (diffusers' SD3 scripts train CLIP's LoRA at most, T5 never); their outputs are
cached with the latents, the long joined sequence in bf16 (`storage_dtype`: T5's 256 tokens of SD3.5 take 2.6 MiB
per caption in bf16).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.sd3 import SPEC
from ds_trainer.train.families import common, flow, joint_attention
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.layouts import sdxl as sdxl_layout
from ds_trainer.train.layouts import transformers as transformers_layout
from ds_trainer.train.layouts.table import Part

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ENCODERS
    vae: Any
    text_encoder: Any  # CLIP-L (CLIPTextModelWithProjection)
    text_encoder_2: Any  # CLIP-G (CLIPTextModelWithProjection)
    text_encoder_3: Any  # T5 (T5EncoderModel)
    tokenizer: Any
    tokenizer_2: Any
    tokenizer_3: Any


class SD3(FlowFamily):
    spec = SPEC
    name = SPEC.name

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        c, b, on = model.config, shape.batch, shape.tensors
        latents = (b, int(c.in_channels), shape.height // 8, shape.width // 8)
        inputs = {"hidden_states": torch.randn(*latents, **on),
                  "encoder_hidden_states": torch.randn(b, shape.tokens, int(c.joint_attention_dim),
                                                       **on),
                  "pooled_projections": torch.randn(b, int(c.pooled_projection_dim), **on),
                  "timestep": torch.rand(b, device=shape.device) * 1000}
        return lambda: model(**inputs)

    def context_plan(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """diffusers has none for SD3's transformer: its joint attention through the dispatch that
        runs Ulysses, its image's and caption's tokens split at the first block."""
        joint_attention.install(model)
        return joint_attention.plan()

    def planner_blocks(self) -> tuple[type, ...]:
        """The MMDiT's joint blocks."""
        from diffusers.models.attention import JointTransformerBlock

        return (JointTransformerBlock,)

    def __init__(self, cfg: DictConfig | None = None) -> None:
        flow_cfg = cfg.model.flow if cfg is not None else None
        self._t5_length = int(flow_cfg.t5_max_length) if flow_cfg is not None else 256  # T5's tokens per caption

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
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
        path, kwargs = common.source(cfg)
        with whole():
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

        return common.trained_module(cfg, SD3Transformer2DModel, "transformer",  # type: ignore[no-any-return]
                                     cfg.model.get("transformer"))

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import SD3Transformer2DModel

        return common.meta_module(cfg, SD3Transformer2DModel, "transformer")

    @torch.no_grad()
    def text_inputs(self, frozen: Frozen, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None,  # noqa: ARG002 - the Family protocol's signature
                    max_length: int | None = None) -> dict[str, torch.Tensor]:
        """`prompt_embeds` (CLIP-L and CLIP-G's penultimate states joined, padded to T5's width, then T5's
        sequence) and `pooled` (the two CLIP projections joined)."""
        states, pooled = [], []
        clips = ((frozen.tokenizer, frozen.text_encoder), (frozen.tokenizer_2, frozen.text_encoder_2))
        for tokenizer, encoder in clips:
            out = encoder(common.token_ids(tokenizer, prompts).to(device), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        clip = torch.cat(states, dim=-1)
        length = max_length if max_length is not None else self._t5_length
        ids = frozen.tokenizer_3(prompts, padding="max_length", max_length=length, truncation=True,
                                 add_special_tokens=True, return_tensors="pt").input_ids
        t5 = frozen.text_encoder_3(ids.to(device))[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"prompt_embeds": torch.cat([clip, t5.to(clip.dtype)], dim=-2), "pooled": torch.cat(pooled, dim=-1)}

    def text_parts(self, frozen: Frozen) -> TextParts:
        """`prompt_embeds`: the CLIP tokens (CLIP-L's width, then CLIP-G's), then T5's; `pooled`: CLIP-L's projection,
        then CLIP-G's. Zeros for T5's part are what StableDiffusion3Pipeline feeds without T5."""
        tokens = int(frozen.tokenizer.model_max_length)
        width = int(frozen.text_encoder.config.hidden_size)
        widths = width + int(frozen.text_encoder_2.config.hidden_size)
        projected = int(frozen.text_encoder.config.projection_dim)
        return {"clip_l": [("prompt_embeds", (slice(0, tokens), slice(0, width))), ("pooled", (slice(0, projected),))],
                "clip_g": [("prompt_embeds", (slice(0, tokens), slice(width, widths))),
                           ("pooled", (slice(projected, None),))],
                "t5": [("prompt_embeds", (slice(tokens, None), slice(None)))]}

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        sigma = schedule.sigma(t)
        noisy = flow.noisy(latents, noise, sigma)
        pred = model(hidden_states=noisy.to(device, dtype), timestep=(sigma * schedule.num_train_timesteps).to(device),
                     encoder_hidden_states=batch["prompt_embeds"].to(device, dtype),
                     pooled_projections=batch["pooled"].to(device, dtype)).sample
        return per_sample_mse(pred, flow.target(latents, noise), batch.get("weight_map"))

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        path, kwargs = common.source(cfg)
        return StableDiffusion3Pipeline(
            transformer=trained["transformer"] if "transformer" in trained else self.load_trained(cfg).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kwargs),
            vae=frozen.vae, text_encoder=frozen.text_encoder, tokenizer=frozen.tokenizer,
            text_encoder_2=frozen.text_encoder_2, tokenizer_2=frozen.tokenizer_2,
            text_encoder_3=frozen.text_encoder_3, tokenizer_3=frozen.tokenizer_3)

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        return {"max_sequence_length": int(cfg.model.flow.t5_max_length)}

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        return transformers_layout.sd3_tensors(denoiser)

    def single_file(self, denoiser: Any, parts: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Stability's file: the MMDiT and the VAE."""
        return {**self.single_file_denoiser(denoiser), **sdxl_layout.vae_tensors(parts["vae"])}

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> list[Part]:
        return transformers_layout.sd3(shapes, config.num_layers)

    def lora_pipeline(self) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline
