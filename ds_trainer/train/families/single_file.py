"""Loading a single-file SDXL checkpoint (original Stability layout) and a replacement VAE.

diffusers' single-file loaders convert the original keys; the architecture configs come from
`model.architecture` (ds_trainer/assets/<model>) with `local_files_only`, so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import weights_file
from ds_trainer.errors import InputError


def checkpoint(cfg: DictConfig) -> dict[str, torch.Tensor]:
    """The file's tensors, checked to be an SDXL base model (a .ckpt is only checked here)."""
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint

    path = str(cfg.model.pretrained)
    try:
        state = load_single_file_checkpoint(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise InputError(f"model.pretrained={path}: cannot be read as a checkpoint ({exc})") from None
    found = weights_file.what_it_is(state.keys())
    if found:
        raise InputError(f"model.pretrained={path} is not an SDXL checkpoint: {found}")
    return state


def text_encoders(cfg: DictConfig, state: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """CLIP ViT-L and OpenCLIP bigG (with projection) from the checkpoint's conditioner."""
    from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    arch = str(cfg.model.architecture)
    # Each encoder sees only its own keys: diffusers picks the encoder by key names and width, and would
    # read ViT-L's weights into bigG when both have one width (as in sdxl_tiny).
    only_l = {k: v for k, v in state.items() if not k.startswith(weights_file.OPEN_CLIP_G)}
    only_g = {k: v for k, v in state.items() if not k.startswith(weights_file.CLIP_L)}
    te1 = create_diffusers_clip_model_from_ldm(CLIPTextModel, only_l, subfolder="text_encoder", config=arch,
                                               local_files_only=True)
    te2 = create_diffusers_clip_model_from_ldm(CLIPTextModelWithProjection, only_g, subfolder="text_encoder_2",
                                               config=arch, local_files_only=True)
    return te1, te2


def vae(cfg: DictConfig, state: dict[str, torch.Tensor] | None = None) -> Any:
    """`model.vae` (a diffusers folder, with or without a vae/ subfolder, or a single file), else the
    checkpoint file's own VAE (`state`)."""
    from diffusers import AutoencoderKL

    arch = str(cfg.model.architecture)
    source = cfg.model.vae
    if source is None:
        return AutoencoderKL.from_single_file(state, config=arch, subfolder="vae", local_files_only=True)
    path = Path(source)
    if path.is_dir():
        subfolder = "vae" if (path / "vae" / "config.json").exists() else None
        return AutoencoderKL.from_pretrained(str(path), subfolder=subfolder)
    return AutoencoderKL.from_single_file(str(path), config=arch, subfolder="vae", local_files_only=True)
