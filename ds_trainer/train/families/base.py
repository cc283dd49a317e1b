"""What a model family provides to the recipe (families/__init__.py says where each is used)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from ds_trainer.config import families as specs
from ds_trainer.config.families import FamilySpec
from ds_trainer.train.layouts.table import Part


@dataclass(frozen=True)
class Shape:
    """The inputs of a forward the planner measures (random, on any device): `batch` samples of
    height x width pixels (a video model's of `frames` frames), `tokens` text tokens, the pixels per
    latent-and-patch step `downsample` (model.downsample_factor)."""

    batch: int
    height: int
    width: int
    tokens: int = 77
    frames: int = 1
    downsample: int = 8
    dtype: Any = None
    device: Any = None

    @property
    def tensors(self) -> dict[str, Any]:
        """The keyword arguments of a random tensor of this shape's dtype and device."""
        return {"dtype": self.dtype, "device": self.device}


# Where a family builds its frozen parts: the backend's `whole()` (outside ZeRO-3's partitioning).
Whole = Callable[[], AbstractContextManager[Any]]
# Per text encoder (its spec's text_encoders), the parts of one sample's text tensors it made: (key, index).
TextParts = dict[str, list[tuple[str, tuple[slice, ...]]]]


class Family(Protocol):
    spec: FamilySpec  # its torch-free facts (config/families/)
    name: str
    component: str  # the trained module's pipeline component: "unet" or "transformer"
    sequence_encoder: str  # the encoder whose long sequence the cache keeps in bf16 ("T5"; "" for none)
    text_sees_reference: bool  # whether a caption is encoded with its reference image (Qwen-Image-Edit)

    def load_frozen(self, cfg: DictConfig, whole: Whole = nullcontext) -> Any:
        """The VAE, text encoders and tokenizers, eval mode, gradients off, built inside `whole()` (the backend's:
        outside ZeRO-3's partitioning). The object has
        `vae`, the encoders as attributes named like the pipeline's components, and `modules()`/`encoders()`."""

    def load_trained(self, cfg: DictConfig) -> torch.nn.Module:
        """The module to train, in float32, in train mode (gradient checkpointing as `train` asks)."""

    def meta_trained(self, cfg: DictConfig) -> torch.nn.Module:
        """The same module on the meta device (no memory): for checks before training."""

    def unused(self, model: torch.nn.Module) -> list[str]:
        """The names of the trained module's submodules whose output feeds nothing the loss sees: they never get a
        gradient (DDP refuses that), so they stay frozen, adapters on them too."""

    def text_inputs(self, frozen: Any, prompts: list[str], device: torch.device,
                    references: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """What a batch carries for its captions (cached on disk with the latents); `references` (images in [-1, 1])
        where the family's `text_sees_reference`."""

    def text_parts(self, frozen: Any) -> TextParts:
        """Where each text encoder's output sits in one sample's text tensors (data.text_encoder_dropout zeroes it)."""

    def encode_images(self, frozen: Any, pixels: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] to the latents the trained module sees (the VAE's mean, scaled and shifted)."""

    def conditioning(self, frozen: Any, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a sample's pixels give the trained module beside their latents, cached with them
        (Wan's image to video: the first frame's latents and CLIP tokens); {} for most families."""

    def storage_dtype(self, key: str) -> torch.dtype | None:
        """The dtype the cache keeps a floating tensor of the batch in (None: float32)."""

    def schedule(self, cfg: DictConfig) -> Any:
        """The training noise schedule."""

    def num_train_timesteps(self, schedule: Any) -> int:
        """The schedule's timesteps (validation scores at evenly spaced ones)."""

    def training_loss(self, cfg: DictConfig, model: Any, schedule: Any, batch: dict[str, torch.Tensor],
                      gens: list[torch.Generator], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Each sample's loss in one micro-batch, its weights applied (the micro-batch's loss is their mean); `gens`
        holds one generator per sample, which draws its noise and timestep."""

    def losses(self, model: Any, schedule: Any, batch: dict[str, torch.Tensor], noise: torch.Tensor,
               t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Each sample's unweighted mean squared error at timestep index `t` with `noise` (validation's measure)."""

    def pipeline(self, cfg: DictConfig, frozen: Any, trained: dict[str, Any]) -> Any:
        """The diffusers pipeline on the frozen parts and `trained` ({component: module}; the trained module is
        built from the source when absent)."""

    def call_kwargs(self, cfg: DictConfig) -> dict[str, Any]:
        """Keyword arguments every pipeline call of this family takes beyond the sampling settings."""

    def guidance_kwargs(self, scale: float, negative: str) -> dict[str, Any]:
        """The pipeline call's arguments for classifier-free guidance at `scale` with the `negative` prompt ("" for
        the family's empty one)."""

    def lora_pipeline(self) -> Any:
        """The pipeline class whose `save_lora_weights` / `load_lora_weights` the LoRA file is written for."""

    def single_file_denoiser(self, denoiser: Any) -> dict[str, torch.Tensor]:
        """The trained module's tensors under its makers' single file's names (train/layouts)."""

    def single_file(self, denoiser: Any, parts: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Its makers' single file: the denoiser and `parts` ({component: module} for each of the spec's
        `single_file_parts`) under the file's names."""

    def context_plan(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """Where its transformer's sequence is split and gathered under parallel.context, where
        diffusers' class carries no plan of its own (None: the class's `_cp_plan`); its attention
        layers made ready for it."""

    def planner_forward(self, model: Any, shape: Shape) -> Callable[[], Any]:
        """A forward of the trained module (on the meta device, for the planner) on random inputs of
        `shape`."""

    def planner_blocks(self) -> tuple[type, ...]:
        """The block classes gradient checkpointing recomputes one at a time (the planner's)."""

    def kohya_parts(self, shapes: Mapping[str, tuple[int, ...]], config: Any) -> list[Part]:
        """The trained module's weights (diffusers' names -> shapes) in the makers' module names of its kohya-layout
        LoRA file (train/layouts/kohya.py; no file prefix)."""


def spec_of(module: Any) -> FamilySpec:
    """The spec of the family a trained module belongs to, by the classes it derives from (FSDP2
    swaps a sharded module's class for a subclass of its own, `FSDPSD3Transformer2DModel`); SDXL's
    for any other."""
    return specs.of_classes(cls.__name__ for cls in type(module).__mro__)


def label_of(module: Any) -> str:
    """What a message calls a trained module: "UNet" or "transformer"."""
    return spec_of(module).module_label


def component_of(module: Any) -> str:
    """The pipeline component a trained module is (`unet`, `transformer`): its name in a diffusers folder and its
    keys' prefix in a LoRA file."""
    return spec_of(module).component
