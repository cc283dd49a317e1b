"""Model families: what the recipe needs of a model, named once per family.

A family provides its frozen parts and how they encode images and captions into what a batch carries, the module
that trains (a UNet, a transformer), its noise schedule and loss, the diffusers pipeline that samples and is
exported, and the LoRA file's pipeline class. The recipe, the step, validation, samples, the export and the LoRA
file ask `of(cfg)` (or `of_module`) and never name a model class. Which families there are, and their torch-free
facts, is the registry's (config/families/: one spec each, whose `implementation` names the class here); base.py
says what each provides.
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import families as specs
from ds_trainer.config.families import FamilySpec
from ds_trainer.train.families.base import Family, component_of, label_of, spec_of

__all__ = ["Family", "component_of", "label_of", "named", "of", "of_module", "spec_of"]


def of(cfg: DictConfig) -> Family:
    """The family of `cfg.model` (`model.family`)."""
    return _build(specs.of(cfg), cfg)


def named(name: str) -> Family:
    """The family registered as `name` (model.family's value), without a config."""
    return _build(specs.spec(name), None)


def of_module(module: Any) -> Family:
    """The family a trained module belongs to, by its class (a LoRA file's pipeline class). By the classes it derives
    from: FSDP2 swaps a sharded module's class for a subclass of its own (`FSDPSD3Transformer2DModel`)."""
    return _build(spec_of(module), None)


def _build(spec: FamilySpec, cfg: DictConfig | None) -> Family:
    module, _, name = spec.implementation.partition(":")
    family: Family = getattr(importlib.import_module(module), name)(cfg)
    return family
