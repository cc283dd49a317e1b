"""Model families: what the recipe needs of a model, named once per family.

A family provides its frozen parts and how they encode images and captions into what a batch carries, the module
that trains (a UNet, a transformer), its noise schedule and loss, the diffusers pipeline that samples and is
exported, and the LoRA file's pipeline class. The recipe, the step, validation, samples, the export and the LoRA
file ask `of(cfg)` (or `of_module`) and never name a model class. `sdxl` (UNet, DDPM noise), `sd3` (SD3 and
SD3.5's MMDiT, flow matching), `flux` (Flux.1, flow matching on packed latents) and `qwen_image` (Qwen-Image's MMDiT
on a video VAE's packed latents, captions by Qwen2.5-VL) are the families; base.py says what each provides.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from ds_trainer.train.families.base import Family, component_of, label_of

__all__ = ["Family", "component_of", "label_of", "of", "of_module"]


def of(cfg: DictConfig) -> Family:
    """The family of `cfg.model` (`model.family`)."""
    family = cfg.model.get("family", "sdxl")
    name = family.value if hasattr(family, "value") else str(family)
    if name == "sd3":
        from ds_trainer.train.families.sd3 import SD3

        return SD3(cfg)
    if name == "flux":
        from ds_trainer.train.families.flux import Flux

        return Flux(cfg)
    if name == "qwen_image":
        from ds_trainer.train.families.qwen_image import QwenImage

        return QwenImage(cfg)
    from ds_trainer.train.families.sdxl import SDXL

    return SDXL()


def of_module(module: Any) -> Family:
    """The family a trained module belongs to, by its class (a LoRA file's pipeline class). By the classes it derives
    from: FSDP2 swaps a sharded module's class for a subclass of its own (`FSDPSD3Transformer2DModel`)."""
    kinds = {cls.__name__ for cls in type(module).__mro__}
    if "SD3Transformer2DModel" in kinds:
        from ds_trainer.train.families.sd3 import SD3

        return SD3()
    if "FluxTransformer2DModel" in kinds:
        from ds_trainer.train.families.flux import Flux

        return Flux()
    if "QwenImageTransformer2DModel" in kinds:
        from ds_trainer.train.families.qwen_image import QwenImage

        return QwenImage()
    from ds_trainer.train.families.sdxl import SDXL

    return SDXL()
