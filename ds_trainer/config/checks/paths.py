"""The files and folders a run reads: the images, the model's weights, the checkpoint to resume. Torch-free,
read-only.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import weights_file
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig) -> list[Problem]:
    """data.path, model.pretrained (and what its file holds, model.vae), then resume."""
    out = []
    if cfg.data.source.value == "folder":
        if OmegaConf.is_missing(cfg.data, "path") or not cfg.data.path:
            out.append(Problem("data.path", "???", "data=folder reads images from a folder",
                               "data.path=/path/to/images"))
        elif not Path(cfg.data.path).is_dir():
            out.append(Problem("data.path", cfg.data.path, "is not a folder", "data.path=/path/to/images"))
    pretrained = cfg.model.pretrained
    if weights_file.is_single_file(pretrained) and not Path(pretrained).exists():
        out.append(Problem("model.pretrained", pretrained, "no such checkpoint file",
                           "model.pretrained=/path/to/sd_xl_base_1.0.safetensors"))
    elif pretrained and not Path(pretrained).exists() and not re.fullmatch(r"[\w.-]+/[\w.-]+", pretrained):
        out.append(Problem("model.pretrained", pretrained, "is neither a local folder nor a hub id (org/name)",
                           "model.pretrained=/path/to/diffusers/folder (or stabilityai/stable-diffusion-xl-base-1.0)"))
    out += weights_file.problems(cfg)
    resume = cfg.resume
    if resume not in (None, "latest") and not Path(resume).is_dir():
        out.append(Problem("resume", resume, "is neither `latest` nor a checkpoint folder",
                           "resume=latest (or resume=<run dir>/checkpoints/step_N)"))
    return out
