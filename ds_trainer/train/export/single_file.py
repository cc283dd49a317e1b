"""`<run>/single_file/model.safetensors` (and `model_ema.safetensors` with EMA): a full fine-tune as the one file its
makers ship, which ComfyUI, Forge and InvokeAI load: SDXL with its VAE and both text encoders in Stability's SGM
layout, SD3/SD3.5's MMDiT in Stability's, Flux.1's transformer in Black Forest Labs' (train/layouts), Qwen-Image's
transformer as ComfyUI's file holds it (diffusers' names). In
`export.dtype`, with Stability's model-spec keys in the header (layouts/metadata.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.train.families import common
from ds_trainer.train.layouts import metadata, table, transformers
from ds_trainer.train.layouts import sdxl as sdxl_layout

if TYPE_CHECKING:
    from ds_trainer.train.families import Family

FOLDER, MODEL, EMA = "single_file", "model.safetensors", "model_ema.safetensors"


def tensors(family: str, denoiser: Any, parts: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The file's tensors: `denoiser` (the UNet or transformer) and `parts` (for SD3 the `vae`, for SDXL also
    `text_encoder` and `text_encoder_2`), as the makers' files hold them: Flux.1's transformer alone, SD3/SD3.5's
    MMDiT and VAE, SDXL's UNet, VAE and both text encoders."""
    out = denoiser_tensors(family, denoiser)
    if family in ("flux", "qwen_image"):
        return out
    vae = parts["vae"].state_dict()
    out.update(table.weights(sdxl_layout.vae(vae, len(parts["vae"].config.block_out_channels)), vae, sdxl_layout.VAE))
    if family == "sd3":
        return out
    te1, te2 = parts["text_encoder"].state_dict(), parts["text_encoder_2"].state_dict()
    out.update(table.weights(sdxl_layout.clip_l(te1), te1, sdxl_layout.CLIP_L))
    out.update(table.weights(sdxl_layout.clip_g(te2), te2, sdxl_layout.CLIP_G))
    out.update(sdxl_layout.constants(parts["text_encoder"].config.max_position_embeddings))
    return out


def denoiser_tensors(family: str, denoiser: Any) -> dict[str, torch.Tensor]:
    """The UNet's or transformer's tensors under the file's names."""
    state, config = denoiser.state_dict(), denoiser.config
    if family == "qwen_image":  # ComfyUI's file (Comfy-Org's qwen_image_bf16) keeps diffusers' names
        return dict(state)
    if family == "flux":
        return table.weights(transformers.flux(state, config.num_layers, config.num_single_layers), state)
    if family == "sd3":
        return table.weights(transformers.sd3(state, config.num_layers), state, sdxl_layout.UNET)
    return table.weights(sdxl_layout.unet(state, config.layers_per_block), state, sdxl_layout.UNET)


def export(cfg: DictConfig, family: Family, run_dir: Path, denoiser: Any, parts: dict[str, Any], ema: bool) -> Path:
    """`<run>/single_file/model.safetensors` (`model_ema.safetensors` for the EMA) in `export.dtype`, with the model
    spec in its header."""
    path = run_dir / FOLDER / (EMA if ema else MODEL)
    header = metadata.checkpoint(cfg, family, run_dir, ema)
    return write(path, tensors(family.name, denoiser, parts), cfg.export.dtype.value, header)


def write(path: Path, state: dict[str, torch.Tensor], dtype: str, metadata: dict[str, str]) -> Path:
    """`state` in `dtype` (integer tensors as they are) as `path`, atomically (a `.partial` file renamed)."""
    from safetensors.torch import save_file

    to = common.SAVE_DTYPES[dtype]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file({k: (v.to(to) if v.is_floating_point() else v).contiguous() for k, v in state.items()}, str(partial),
              metadata=metadata)
    os.replace(partial, path)
    return path
