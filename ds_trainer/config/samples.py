"""The `samples` group before a run: its prompts, its schedule and its rules. Torch-free.

The schedule is a function of the step and the configuration only, so every rank decides the same
(under ZeRO-3 a rank that skipped a sample would leave the others waiting in a gather forever).
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config.problems import Problem

_EXAMPLE = "'samples.prompts=[a red cube,a blue ball]' (or samples.prompts=/path/prompts.txt)"


def prompts(cfg: DictConfig) -> list[str]:
    """The prompts: `samples.prompts` as a list, or the non-empty lines of the file it names."""
    value = cfg.samples.prompts
    if isinstance(value, str):
        lines = Path(value).read_text(encoding="utf-8").splitlines()
        return [line.strip() for line in lines if line.strip()]
    return [str(p) for p in value]


def size(cfg: DictConfig) -> tuple[int, int]:
    """(width, height) of the samples: the training resolution unless set."""
    s = cfg.samples
    return (int(s.width if s.width is not None else cfg.resolution.width),
            int(s.height if s.height is not None else cfg.resolution.height))


def due(cfg: DictConfig, step: int) -> bool:
    """Whether to sample after optimizer step `step` (the same answer on every rank)."""
    s = cfg.samples
    if not s.enabled:
        return False
    every = int(s.every)
    return (every > 0 and step % every == 0) or (bool(s.at_end) and step == int(cfg.train.max_steps))


def _prompt_problems(cfg: DictConfig) -> list[Problem]:
    value = cfg.samples.prompts
    if isinstance(value, str):
        path = Path(value)
        if not path.is_file():
            return [Problem("samples.prompts", value, "is not a file (a string names a file of one prompt a line)",
                            _EXAMPLE)]
        try:
            found = prompts(cfg)
        except (OSError, UnicodeDecodeError) as exc:
            return [Problem("samples.prompts", value, f"cannot be read as UTF-8 text ({exc})", _EXAMPLE)]
        if not found:
            return [Problem("samples.prompts", value, "holds no prompt (every line is empty)", _EXAMPLE)]
        return []
    if not OmegaConf.is_list(value) or not all(isinstance(p, str | int | float) for p in value):
        return [Problem("samples.prompts", value, "must be a list of prompts or the path of a prompts file", _EXAMPLE)]
    if not [p for p in value if str(p).strip()]:
        return [Problem("samples.prompts", list(value), "samples=on needs at least one prompt", _EXAMPLE)]
    return []


def problems(cfg: DictConfig) -> list[Problem]:
    """Everything wrong with `samples` (nothing when sampling is off); `config.checks` asks it."""
    s = cfg.samples
    if not s.enabled:
        return []
    out = _prompt_problems(cfg)
    if s.every < 0:
        out.append(Problem("samples.every", s.every, "must be >= 0 (0 samples only at the end)", "samples.every=100"))
    if s.every == 0 and not s.at_end:
        out.append(Problem("samples.at_end", False, "with samples.every=0 nothing would ever be sampled",
                           "samples.every=100, or samples.at_end=true, or samples=none"))
    if s.steps < 1:
        out.append(Problem("samples.steps", s.steps, "the denoising steps must be at least 1", "samples.steps=25"))
    if not math.isfinite(s.guidance_scale) or s.guidance_scale < 0:
        out.append(Problem("samples.guidance_scale", s.guidance_scale,
                           "must be a finite number >= 0 (at most 1 turns classifier-free guidance off)",
                           "samples.guidance_scale=5.0"))
    if not list(s.seeds):
        out.append(Problem("samples.seeds", [], "needs at least one seed (one image per prompt and seed)",
                           "samples.seeds=[0]"))
    factor = int(cfg.model.downsample_factor)
    for side, value in zip(("width", "height"), size(cfg), strict=True):
        if value < factor or value % factor:
            nearest = max(factor, round(value / factor) * factor)
            out.append(Problem(f"samples.{side}", value, f"{cfg.model.name} needs a positive multiple of {factor} "
                               "(VAE x UNet downsampling)", f"samples.{side}={nearest}"))
    return out
