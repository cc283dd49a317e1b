"""FLUX.2 ([dev] and [klein]): Flux2Transformer2DModel (double- and single-stream blocks, their
modulation shared) trained by flow matching (train/flow.py) with the resolution-dependent shift of
its scheduler config, on AutoencoderKLFlux2's latents as Flux2Pipeline makes them: the mode, cut
into 2 x 2 patches (4 x its channels at 1/16 of the image) and normalised by the VAE's batch-norm
statistics; each patch one token (packed), with 4-axis position ids (t, h, w, l), the text's at
(0, 0, 0, l). The cache keeps the patchified latents, so the noise is drawn where the pipeline draws
it. [dev]'s guidance-distilled input is given `model.flow.guidance`.

Captions: one language model's hidden states stacked along the features, every one of the padded
tokens kept (the transformer is given no mask): [dev] Mistral Small 3.1's layers 10, 20 and 30 over
its chat template with FLUX.2's system message; [klein] Qwen3's layers 9, 18 and 27 over Qwen3's
template without thinking (Flux2Pipeline's and Flux2KleinPipeline's encodings); cached in bf16. The
language model's head is not run. Flux2Pipeline or Flux2KleinPipeline samples (by the encoder) and
is exported; they sample at Black Forest Labs' empirical shift, not the scheduler's line.

The text encoder stays frozen (peers train the transformer alone)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config.families.flux2 import SPEC
from ds_trainer.train.families import common, flow
from ds_trainer.train.families.base import Shape, TextParts, Whole
from ds_trainer.train.families.chroma import scheduler_line
from ds_trainer.train.families.common import per_sample_mse
from ds_trainer.train.families.flow_family import FlowFamily, FrozenParts
from ds_trainer.train.layouts import flux2 as flux2_layout
from ds_trainer.train.layouts.table import Part

# the language model's hidden states each pipeline stacks, by the encoder's model_type
LAYERS = {"mistral3": (10, 20, 30), "qwen3": (9, 18, 27)}


@dataclass
class Frozen(FrozenParts):
    ENCODERS: ClassVar[tuple[str, ...]] = ("text_encoder",)
    vae: Any  # AutoencoderKLFlux2
    text_encoder: Any  # Mistral3ForConditionalGeneration ([dev]) or Qwen3ForCausalLM ([klein])
    tokenizer: Any  # Mistral's processor or tokenizer with its chat template; Qwen3's
    kind: str = field(default="mistral3")  # the encoder's model_type: a key of LAYERS


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) latents to (B, 4C, H/2, W/2): each 2 x 2 patch's values as channels, in
    Flux2Pipeline's order (`_patchify_latents`)."""
    b, c, h, w = latents.shape
    out = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return out.reshape(b, c * 4, h // 2, w // 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) patchified latents to (B, H * W, C) tokens."""
    return latents.flatten(2).transpose(1, 2)


def image_ids(height: int, width: int) -> torch.Tensor:
    """The (t, h, w, l) position ids of (height x width) patchified latents' tokens."""
    ids = torch.zeros(height, width, 4)
    ids[..., 1] += torch.arange(height)[:, None]
    ids[..., 2] += torch.arange(width)[None, :]
    return ids.reshape(-1, 4)


def text_ids(tokens: int) -> torch.Tensor:
    """The text's position ids: (0, 0, 0, l) for its l-th token."""
    ids = torch.zeros(tokens, 4)
    ids[:, 3] = torch.arange(tokens)
    return ids


def as_sampled(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A timestep or guidance (in 1/1000s) as a 16-bit run's transformer sees it: diffusers' FLUX.2
    casts them to its hidden states' dtype and then multiplies by 1000 there. Under autocast (DDP's
    float32 masters) the hidden states stay float32: the rounding is done here, so that every layout
    trains on the values the 16-bit ones and a bf16 pipeline give it."""
    if not torch.is_autocast_enabled(device.type):
        return value
    half = torch.get_autocast_dtype(device.type)
    return (value.to(half) * 1000).to(half).float() / 1000


def templated(frozen: Frozen, prompts: list[str], length: int) -> Any:
    """The captions' token ids and mask over the encoder's chat template, padded to `length`."""
    pad = {"padding": "max_length", "truncation": True, "max_length": length,
           "return_tensors": "pt"}
    if frozen.kind == "qwen3":
        texts = [frozen.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
            enable_thinking=False) for p in prompts]
        return frozen.tokenizer(texts, **pad)
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

    return frozen.tokenizer.apply_chat_template(
        format_input(prompts, SYSTEM_MESSAGE), add_generation_prompt=False, tokenize=True,
        return_dict=True, **pad)


class Flux2(FlowFamily):
    spec = SPEC
    name = SPEC.name
    sequence_encoder = "the language model"

    def __init__(self, cfg: DictConfig | None = None) -> None:
        f = cfg.model.flow if cfg is not None else None
        self._text_length = int(f.text_max_length) if f is not None else 512
        self._guidance = float(f.guidance) if f is not None and f.guidance is not None else None

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Frozen:
        import transformers
        from diffusers import AutoencoderKLFlux2

        console.adopt()
        path, kwargs = common.source(cfg)
        config = transformers.AutoConfig.from_pretrained(path, subfolder="text_encoder", **kwargs)
        cls = getattr(transformers, config.architectures[0])
        with whole():
            tokenizer = transformers.AutoProcessor.from_pretrained(path, subfolder="tokenizer",
                                                                   **kwargs)
            if cfg.model.pretrained:
                vae = AutoencoderKLFlux2.from_pretrained(path, subfolder="vae", **kwargs)
                encoder = cls.from_pretrained(path, subfolder="text_encoder", **kwargs)
            else:
                torch.manual_seed(int(cfg.train.seed))
                vae = AutoencoderKLFlux2.from_config(
                    AutoencoderKLFlux2.load_config(path, subfolder="vae"))
                encoder = cls(config)
        for module in (vae, encoder):
            module.requires_grad_(False)
            module.eval()
        return Frozen(vae, encoder, tokenizer, str(config.model_type))

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import Flux2Transformer2DModel

        return common.trained_module(  # type: ignore[no-any-return]
            cfg, Flux2Transformer2DModel, "transformer", cfg.model.get("transformer"))

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        from diffusers import Flux2Transformer2DModel

        return common.meta_module(cfg, Flux2Transformer2DModel, "transformer")

    @torch.no_grad()
    def text_inputs(self, frozen: Frozen, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None,  # noqa: ARG002 - the protocol's
                    ) -> dict[str, torch.Tensor]:
        """`prompt_embeds`: the language model's hidden states (LAYERS) of each templated caption,
        (B, tokens, 3 x width), as the pipelines' `_get_mistral_3_small_prompt_embeds` and
        `_get_qwen3_prompt_embeds` make them (its base model run: the head's logits unused)."""
        inputs = templated(frozen, prompts, self._text_length)
        base = frozen.text_encoder.model
        states = base(input_ids=inputs["input_ids"].to(device),
                      attention_mask=inputs["attention_mask"].to(device),
                      output_hidden_states=True, use_cache=False).hidden_states
        stacked = torch.stack([states[k] for k in LAYERS[frozen.kind]], dim=2)
        return {"prompt_embeds": stacked.flatten(2)}

    def text_parts(self, frozen: Frozen) -> TextParts:  # noqa: ARG002 - the protocol's
        """The language model makes the whole sequence."""
        return {"llm": [("prompt_embeds", (slice(None), slice(None)))]}

    @torch.no_grad()
    def encode_images(self, frozen: Frozen, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE's mode, patchified and normalised by its batch-norm statistics (Flux2Pipeline's
        `_encode_vae_image`)."""
        vae = frozen.vae
        latents = patchify(vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        var = vae.bn.running_var.view(1, -1, 1, 1)
        std = torch.sqrt(var + vae.config.batch_norm_eps).to(latents)
        return (latents - mean) / std

    def schedule(self, cfg: DictConfig) -> flow.Schedule:
        """The flow schedule with the shift line of its scheduler config."""
        return flow.Schedule.of(cfg, line=scheduler_line(cfg))

    def image_tokens(self, latents: torch.Tensor) -> int:
        """The tokens of the patchified latents: what the noise levels shift with."""
        return latents.shape[-2] * latents.shape[-1]

    def losses(self, model: Any, schedule: flow.Schedule, batch: dict[str, torch.Tensor],
               noise: torch.Tensor, t: torch.Tensor, device: torch.device,
               dtype: torch.dtype) -> torch.Tensor:
        latents = batch["latents"]
        sigma = schedule.sigma(t, self.image_tokens(latents))
        text = batch["prompt_embeds"]
        guidance = None
        if self._guidance is not None:
            guidance = as_sampled(torch.full((len(t),), self._guidance, device=device), device)
        pred = model(hidden_states=pack(flow.noisy(latents, noise, sigma)).to(device, dtype),
                     encoder_hidden_states=text.to(device, dtype),
                     # sigma, as the pipelines give it (timestep / 1000)
                     timestep=as_sampled(sigma.to(device), device),
                     # ids with a batch axis (the transformer reads the first): diffusers' context
                     # plan splits them along their tokens with the states
                     img_ids=image_ids(*latents.shape[-2:])[None].to(device),
                     txt_ids=text_ids(text.shape[1])[None].to(device), guidance=guidance,
                     return_dict=False)[0]
        weight = batch.get("weight_map")  # the mask at the patches' resolution, packed
        return per_sample_mse(pred, pack(flow.target(latents, noise)),
                              None if weight is None else pack(weight.expand_as(latents)))

    def pipeline(self, cfg: DictConfig, frozen: Frozen, trained: dict[str, Any]) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

        path, kwargs = common.source(cfg)
        model = trained.get("transformer")
        if model is None:
            model = self.load_trained(cfg).eval()
        parts = {"transformer": model, "vae": frozen.vae, "text_encoder": frozen.text_encoder,
                 "tokenizer": frozen.tokenizer,
                 "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(
                     path, subfolder="scheduler", **kwargs)}
        if frozen.kind == "mistral3":
            return Flux2Pipeline(**parts)
        return Flux2KleinPipeline(**parts, is_distilled=_distilled(cfg))

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:  # noqa: ARG002 - the protocol's
        return {"max_sequence_length": self._text_length}

    def guidance_kwargs(self, scale: float, negative: str) -> dict[str, Any]:  # noqa: ARG002
        """[dev]: the distilled guidance; [klein]: classifier-free guidance against the empty
        caption (its pipeline takes no negative prompt)."""
        return {"guidance_scale": scale}

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        """Black Forest Labs' names (flux2-dev.safetensors)."""
        return flux2_layout.tensors(denoiser)

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]],
                    config: Any) -> list[Part]:  # noqa: ARG002 - the protocol's
        """musubi-tuner's and ComfyUI's names (`lora_unet_double_blocks_0_img_attn_qkv`)."""
        return flux2_layout.parts(shapes)

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """The patchified latents' tokens (1/16 of the image), 4-axis ids, the guidance input where
        the transformer has one."""
        c, b, tokens, on = model.config, shape.batch, shape.tokens, shape.tensors
        height, width = shape.height // 16, shape.width // 16
        inputs = {"hidden_states": torch.randn(b, height * width, int(c.in_channels), **on),
                  "encoder_hidden_states": torch.randn(b, tokens, int(c.joint_attention_dim), **on),
                  "timestep": torch.rand(b, device=shape.device),
                  "img_ids": image_ids(height, width).to(shape.device),
                  "txt_ids": text_ids(tokens).to(shape.device), "guidance": None}
        if c.guidance_embeds:
            inputs["guidance"] = torch.full((b,), 4.0, device=shape.device)
        return lambda: model(**inputs)

    def planner_blocks(self) -> tuple[type, ...]:
        """Double- and single-stream blocks."""
        from diffusers.models.transformers.transformer_flux2 import (
            Flux2SingleTransformerBlock,
            Flux2TransformerBlock,
        )

        return (Flux2TransformerBlock, Flux2SingleTransformerBlock)

    def lora_pipeline(self) -> Any:
        """Flux2Pipeline (Flux2KleinPipeline reads the same LoRA: Flux2LoraLoaderMixin)."""
        from diffusers import Flux2Pipeline

        return Flux2Pipeline


def _distilled(cfg: DictConfig) -> bool:
    """Whether the [klein] checkpoint is step-distilled (its model_index.json says; the base models
    and the random tiny one are not): its pipeline then samples without classifier-free guidance."""
    if not cfg.model.pretrained:
        return False
    from diffusers import DiffusionPipeline

    path, kwargs = common.source(cfg)
    return bool(DiffusionPipeline.load_config(path, **kwargs).get("is_distilled", False))
