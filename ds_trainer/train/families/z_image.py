"""Z-Image (base and Turbo): ZImageTransformer2DModel, a single-stream DiT, trained by flow matching
(train/flow.py) at the fixed shift of its scheduler config on Flux's VAE latents shifted and scaled
(the transformer cuts them into 2 x 2 patches itself). As ZImagePipeline calls it: each sample's
latents as a (channels, 1, height, width) tensor of a list, the timestep 1 - sigma, each caption's
own tokens (its length, no padding), and its output the negative of the velocity (the pipeline
negates it before the scheduler's step).

Captions: Qwen3's second-to-last hidden state over Qwen3's chat template of the caption (one user
message, the generation prompt, thinking on), padded to `model.flow.text_max_length` tokens, the
caption's own tokens kept, as ZImagePipeline encodes them; cached in bf16 with their mask
(`prompt_mask`), each sample's tokens cut out by it in the step. ZImagePipeline samples (its
classifier-free guidance: `pos + scale * (pos - neg)`, off at scale 0, as Z-Image-Turbo samples) and
is exported.

The text encoder stays frozen (Qwen3-4B; peers train the transformer alone)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.z_image import SPEC
from ds_trainer.train.families import common, flow
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.layouts import z_image as z_image_layout
from ds_trainer.train.layouts.table import Part


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder",)
    vae: Any  # Flux's AutoencoderKL
    text_encoder: Any  # Qwen3Model: its second-to-last hidden state
    tokenizer: Any  # Qwen2Tokenizer with Qwen3's chat template


def chat(tokenizer: Any, prompt: str) -> str:
    """ZImagePipeline's text of a caption: Qwen3's chat template of one user message."""
    text: str = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=True)
    return text


def captions(batch: dict[str, torch.Tensor], device: torch.device,
             dtype: torch.dtype) -> list[torch.Tensor]:
    """Each sample's caption features, its own tokens alone (the transformer pads them itself)."""
    return [states[keep.bool()].to(device, dtype)
            for states, keep in zip(batch["prompt_embeds"], batch["prompt_mask"], strict=True)]


class ZImage(FlowFamily):
    spec = SPEC
    name = SPEC.name
    sequence_encoder = "Qwen3"

    def __init__(self, cfg: DictConfig | None = None) -> None:
        f = cfg.model.flow if cfg is not None else None
        self._text_length = int(f.text_max_length) if f is not None else 512

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        from diffusers import AutoencoderKL
        from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

        console.adopt()
        path, kwargs = common.source(cfg)
        with whole():
            tokenizer = Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer", **kwargs)
            if cfg.model.pretrained:
                vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kwargs)
                encoder = Qwen3Model.from_pretrained(path, subfolder="text_encoder", **kwargs)
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKL.from_config(AutoencoderKL.load_config(path, subfolder="vae"))
                encoder = Qwen3Model(Qwen3Config.from_pretrained(path, subfolder="text_encoder"))
        for module in (vae, encoder):
            module.requires_grad_(False)
            module.eval()
        return Frozen(vae, encoder, tokenizer)

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import ZImageTransformer2DModel

        return common.trained_module(  # type: ignore[no-any-return]
            cfg, ZImageTransformer2DModel, "transformer", cfg.model.get("transformer"))

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import ZImageTransformer2DModel

        return common.meta_module(cfg, ZImageTransformer2DModel, "transformer")

    @torch.no_grad()
    def text_inputs(self, frozen: Frozen, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None,  # noqa: ARG002 - the protocol's
                    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds`: Qwen3's second-to-last hidden state of each templated caption, zero past
        its tokens; `prompt_mask`: 1 on them (ZImagePipeline's `_encode_prompt`)."""
        texts = [chat(frozen.tokenizer, p) for p in prompts]
        inputs = frozen.tokenizer(texts, padding="max_length", max_length=self._text_length,
                                  truncation=True, return_tensors="pt")
        mask = inputs.attention_mask.to(device).bool()
        states = frozen.text_encoder(input_ids=inputs.input_ids.to(device), attention_mask=mask,
                                     output_hidden_states=True).hidden_states[-2]
        embeds = states * mask[..., None].to(states.dtype)
        return {"prompt_embeds": embeds, "prompt_mask": mask.long()}

    def text_parts(self, frozen: Frozen) -> TextParts:  # noqa: ARG002 - the protocol's
        """Qwen3 makes the whole sequence (its mask says which tokens are the caption's)."""
        return {"qwen3": [("prompt_embeds", (slice(None), slice(None)))]}

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor],
               noise: torch.Tensor, t: torch.Tensor, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        sigma = schedule.sigma(t)
        noisy = flow.noisy(latents, noise, sigma).to(device, dtype)
        out = model(list(noisy.unsqueeze(2).unbind(0)), (1 - sigma).to(device),
                    captions(batch, device, dtype), return_dict=False)[0]
        pred = -torch.stack(out).squeeze(2)  # its output is x0 - noise: the pipeline negates it
        weight = batch.get("weight_map")
        return per_sample_mse(pred, flow.target(latents, noise),
                              None if weight is None else weight.expand_as(latents))

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        path, kwargs = common.source(cfg)
        model = trained.get("transformer")
        if model is None:
            model = self.load_trained(cfg).eval()
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler",
                                                                    **kwargs)
        return self.lora_pipeline()(transformer=model, scheduler=scheduler, vae=frozen.vae,
                                    text_encoder=frozen.text_encoder, tokenizer=frozen.tokenizer)

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:  # noqa: ARG002 - the protocol's
        return {"max_sequence_length": self._text_length}

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        """Its makers' names (ComfyUI's z_image_turbo_bf16.safetensors)."""
        return z_image_layout.tensors(denoiser)

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]],
                    config: Any) -> list[Part]:  # noqa: ARG002 - the protocol's
        """ComfyUI's names (`lora_unet_layers_0_attention_qkv`): its makers' modules."""
        return z_image_layout.parts(shapes)

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """Each sample's latents (Flux's VAE: 8x; the transformer's 2 x 2 patches) and caption."""
        c, b, on = model.config, shape.batch, shape.tensors
        latents = [torch.randn(int(c.in_channels), 1, shape.height // 8, shape.width // 8, **on)
                   for _ in range(b)]
        caption = [torch.randn(shape.tokens, int(c.cap_feat_dim), **on) for _ in range(b)]
        t = torch.rand(b, device=shape.device)
        return lambda: model(latents, t, caption)

    def planner_blocks(self) -> tuple[type, ...]:
        """The refiners' and the main layers' blocks."""
        from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

        return (ZImageTransformerBlock,)

    def lora_pipeline(self) -> Any:
        from diffusers import ZImagePipeline

        return ZImagePipeline
