"""`<run>/single_file/model.safetensors` (and `model_ema.safetensors` with EMA): a full fine-tune as the one file its
makers ship, which ComfyUI, Forge and InvokeAI load: SDXL with its VAE and both text encoders in Stability's SGM
layout, SD3/SD3.5's MMDiT in Stability's, Flux.1's transformer in Black Forest Labs' (train/layouts), Qwen-Image's
transformer as ComfyUI's file holds it (diffusers' names). In
`export.dtype`, with Stability's model-spec keys in the header (layouts/metadata.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.train import families
from ds_trainer.train.families import Family, common
from ds_trainer.train.layouts import metadata

FOLDER, MODEL, EMA = "single_file", "model.safetensors", "model_ema.safetensors"


def tensors(family: str | Family, denoiser: Any, parts: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The file's tensors: `denoiser` (the UNet or transformer) and `parts` (the family spec's single_file_parts:
    SD3's `vae`; SDXL's also `text_encoder` and `text_encoder_2`), as the makers' files hold them."""
    return _family(family).single_file(denoiser, parts)


def denoiser_tensors(family: str | Family, denoiser: Any) -> dict[str, torch.Tensor]:
    """The UNet's or transformer's tensors under the file's names."""
    return _family(family).single_file_denoiser(denoiser)


def _family(family: str | Family) -> Family:
    return families.named(family) if isinstance(family, str) else family


def export(cfg: DictConfig, family: Family, run_dir: Path, denoiser: Any, parts: dict[str, Any], ema: bool) -> Path:
    """`<run>/single_file/model.safetensors` (`model_ema.safetensors` for the EMA) in `export.dtype`, with the model
    spec in its header."""
    path = run_dir / FOLDER / (EMA if ema else MODEL)
    header = metadata.checkpoint(cfg, family, run_dir, ema)
    return write(path, tensors(family, denoiser, parts), cfg.export.dtype.value, header)


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
