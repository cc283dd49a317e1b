"""SDXL components (families/sdxl.py) and what every family shares (the source of weights, frozen parts kept out
of ZeRO-3, dtypes): the trained UNet and the frozen VAE, text encoders and tokenizers.

`model.pretrained` (a local diffusers folder, a hub id, or a single-file SDXL checkpoint: see
single_file.py) loads weights, `model.vae` replaces the VAE; without it every part is
built from the architecture configs in `ds_trainer/assets/<model>` with random weights, so nothing
is ever downloaded unless the user asks for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer import console
from ds_trainer.config import weights_file


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


def _source(cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """Where to load from, and the from_pretrained keyword arguments."""
    if cfg.model.pretrained and not weights_file.is_single_file(cfg.model.pretrained):
        kwargs = {"revision": cfg.model.revision, "variant": cfg.model.variant}
        return str(cfg.model.pretrained), {k: v for k, v in kwargs.items() if v}
    return str(cfg.model.architecture), {}


@contextlib.contextmanager
def outside_zero3(deepspeed_plugin: Any) -> Iterator[None]:
    """Build frozen models whole: loaded while a ZeRO-3 config is live, transformers would partition
    them with zero.Init and their forward would fail on shapes (diffusers#1865)."""
    if deepspeed_plugin is None or deepspeed_plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    with deepspeed_plugin.zero3_init_context_manager(enable=False):
        unset_hf_deepspeed_config()
        yield


FROZEN_DTYPES = {"bf16": "bfloat16", "bf16_pure": "bfloat16", "fp16": "float16", "fp32": "float32"}


def lora_base_dtype(cfg: DictConfig) -> torch.dtype | None:
    """The 16-bit type the frozen base under a LoRA (the UNet's, a text encoder's) is held in during 16-bit
    training, as the forward computes in it; None under fp32."""
    return {"bf16": torch.bfloat16, "bf16_pure": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.name.value)


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """The parameters of `module` that do not train, to `dtype` in place (the trained ones stay fp32)."""
    for p in module.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)


def frozen_dtype_name(cfg: DictConfig, kind: str) -> str:
    """The dtype the text encoders (and a VAE without force_upcast) run in: float32 on the CPU (where 16-bit
    is emulated for much of a text encoder and slower), else the run's `precision` (fp16 on GPUs without
    bf16, float32 when asked). Part of the latent cache's identity."""
    return "float32" if kind == "cpu" else FROZEN_DTYPES[cfg.precision.name.value]


def load_frozen(cfg: DictConfig, deepspeed_plugin: Any = None) -> Frozen:
    """VAE, both text encoders and tokenizers, in eval mode with gradients off."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    console.adopt()  # diffusers and transformers, imported now, log through the run's handlers

    from ds_trainer.train import single_file

    path, kwargs = _source(cfg)
    with outside_zero3(deepspeed_plugin):
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

    from ds_trainer.train import single_file

    single = single_file.checkpoint(cfg) if weights_file.is_single_file(cfg.model.pretrained) else None
    return trained_module(cfg, UNet2DConditionModel, "unet", single)


def trained_module(cfg: DictConfig, cls: Any, subfolder: str, single: Any = None) -> Any:
    """The module to train (a diffusers model class whose folder in a pipeline is `subfolder`) in fp32, train mode,
    with gradient checkpointing as `train` asks: from `single` (a single file's path or tensors in its makers'
    layout, its config from the architecture) or `model.pretrained`, else built with random weights."""
    path, kwargs = _source(cfg)
    if single is not None:
        model = cls.from_single_file(single, config=str(cfg.model.architecture), subfolder=subfolder,
                                     local_files_only=True, torch_dtype=torch.float32)
    elif cfg.model.pretrained:
        model = cls.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.float32, **kwargs)
    else:
        torch.manual_seed(int(cfg.train.seed))
        model = cls.from_config(cls.load_config(path, subfolder=subfolder))
    if cfg.train.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model


def meta_module(cfg: DictConfig, cls: Any, subfolder: str) -> torch.nn.Module:
    """The module `trained_module` builds, on the meta device (no memory): for checks before training."""
    path, kwargs = _source(cfg)
    with torch.device("meta"):
        model: torch.nn.Module = cls.from_config(cls.load_config(path, subfolder=subfolder, **kwargs))
    return model


def noise_scheduler(cfg: DictConfig) -> Any:
    """The training noise schedule (DDPM) from the model's scheduler config."""
    from diffusers import DDPMScheduler

    path, kwargs = _source(cfg)
    return DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kwargs)


def inference_scheduler(cfg: DictConfig) -> Any:
    """The scheduler exported with the pipeline (the model's own, Euler for SDXL)."""
    from diffusers import EulerDiscreteScheduler

    path, kwargs = _source(cfg)
    return EulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kwargs)


@torch.no_grad()
def encode_prompts(frozen: Frozen, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL text conditioning: both encoders' penultimate hidden states, concatenated, and the
    second encoder's pooled projection."""
    states = []
    pooled = None
    for tokenizer, encoder in ((frozen.tokenizer, frozen.text_encoder), (frozen.tokenizer_2, frozen.text_encoder_2)):
        ids = token_ids(tokenizer, prompts).to(device)
        out = encoder(ids, output_hidden_states=True)
        states.append(out.hidden_states[-2])
        pooled = out.text_embeds if hasattr(out, "text_embeds") else out[0]
    assert pooled is not None
    return torch.cat(states, dim=-1), pooled


def token_ids(tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


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
        out["input_ids"] = token_ids(frozen.tokenizer, prompts)
    else:
        ids = token_ids(frozen.tokenizer, prompts).to(device)
        out["embeds_1"] = frozen.text_encoder(ids, output_hidden_states=True).hidden_states[-2]
    if frozen.text_encoder_2 is None:
        out["input_ids_2"] = token_ids(frozen.tokenizer_2, prompts)
    else:
        result = frozen.text_encoder_2(token_ids(frozen.tokenizer_2, prompts).to(device), output_hidden_states=True)
        out["embeds_2"], out["pooled"] = result.hidden_states[-2], result.text_embeds
    return out


@torch.no_grad()
def encode_images(frozen: Frozen, pixels: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] to scaled VAE latents (the VAE's mean: deterministic, cacheable)."""
    vae = frozen.vae
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
    return latents * vae.config.scaling_factor
