"""Rectified-flow training (SD3, SD3.5, Flux.1): the noise levels a sample is trained at, how it is noised, what the
transformer is asked to predict, and the loss weights (`model.flow`, config/schema.py's FlowConfig).

A level is an index into a table of 1000 sigmas, sigma_i = shift * s_i / (1 + (shift - 1) * s_i) with
s_i = (1000 - i) / 1000: the table diffusers' FlowMatchEulerDiscreteScheduler trains and samples with (index 0 is
pure noise). A sample's index is u * 1000 for u drawn from the density from the sample's own generator, so the
draws do not depend on the batch layout. The transformer sees timestep sigma * 1000.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig


@dataclass(frozen=True)
class Schedule:
    """The shifted sigma table and the settings of `model.flow`."""

    sigmas: torch.Tensor  # float32, descending from 1 (index 0) to 1/1000 before the shift
    density: str
    logit_mean: float
    logit_std: float
    mode_scale: float
    weighting: str
    dynamic: bool = False  # Flux, Qwen-Image: the shift follows the image's token count (`shifted`)
    # (base tokens, max tokens, base shift, max shift): the line mu follows, the sampler's (its scheduler config's)
    line: tuple[int, int, float, float] = (256, 4096, 0.5, 1.15)

    @property
    def num_train_timesteps(self) -> int:
        return len(self.sigmas)

    @classmethod
    def of(cls, cfg: DictConfig, num_train_timesteps: int = 1000,
           line: tuple[int, int, float, float] = (256, 4096, 0.5, 1.15)) -> Schedule:
        f = cfg.model.flow
        return cls(table(num_train_timesteps, float(f.shift)), f.density.value, float(f.logit_mean),
                   float(f.logit_std), float(f.mode_scale), f.weighting.value, bool(f.dynamic_shift), line)

    def draw(self, gens: list[torch.Generator]) -> torch.Tensor:
        """One table index per sample (int64), u from each sample's generator."""
        u = torch.cat([density_sample(self.density, g, self.logit_mean, self.logit_std, self.mode_scale)
                       for g in gens])
        return (u * self.num_train_timesteps).long().clamp(0, self.num_train_timesteps - 1)

    def sigma(self, index: torch.Tensor, image_tokens: int | None = None) -> torch.Tensor:
        """The noise level of each table index; with the dynamic shift, shifted for `image_tokens`."""
        sigma = self.sigmas[index.long().cpu()]
        if self.dynamic:
            assert image_tokens is not None
            return shifted(sigma, image_tokens, self.line)
        return sigma

    def weights(self, sigma: torch.Tensor) -> torch.Tensor:
        return loss_weights(self.weighting, sigma)


def table(num_train_timesteps: int, shift: float) -> torch.Tensor:
    s = torch.arange(num_train_timesteps, 0, -1, dtype=torch.float64) / num_train_timesteps
    return (shift * s / (1 + (shift - 1) * s)).to(torch.float32)


def mu(image_tokens: int, base_tokens: int = 256, max_tokens: int = 4096, base_shift: float = 0.5,
       max_shift: float = 1.15) -> float:
    """Flux's shift exponent for an image of `image_tokens` tokens: linear from 0.5 at 256 tokens to 1.15 at 4096."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return base_shift + slope * (image_tokens - base_tokens)


def shifted(sigma: torch.Tensor, image_tokens: int,
            line: tuple[int, int, float, float] = (256, 4096, 0.5, 1.15)) -> torch.Tensor:
    """sigma' = e^mu / (e^mu + 1/sigma - 1): Flux's resolution-dependent shift (its sampler's, with mu of the
    image's tokens on the sampler's `line`: Flux's by default, Qwen-Image's from its scheduler config)."""
    e = math.exp(mu(image_tokens, *line))
    return (e / (e + (1 / sigma.double() - 1))).to(sigma.dtype)


def density_sample(density: str, generator: torch.Generator, logit_mean: float, logit_std: float,
                   mode_scale: float) -> torch.Tensor:
    """One u in [0, 1] (shape (1,)) drawn from `density`."""
    if density == "logit_normal":
        return torch.sigmoid(torch.randn(1, generator=generator) * logit_std + logit_mean)
    u = torch.rand(1, generator=generator)
    if density == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def loss_weights(weighting: str, sigma: torch.Tensor) -> torch.Tensor:
    if weighting == "sigma_sqrt":
        return (sigma ** -2.0).float()
    if weighting == "cosmap":
        return (2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))).float()
    return torch.ones_like(sigma, dtype=torch.float32)


def noisy(latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - sigma) x0 + sigma noise, sigma per sample."""
    s = sigma.to(latents.dtype).view(-1, *([1] * (latents.ndim - 1)))
    return (1 - s) * latents + s * noise


def target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the transformer predicts: d x_t / d sigma = noise - x0."""
    return noise - latents
