"""`parallel.context` against the run: the ranks it divides, the family's module (a sequence to
split), its heads (Ulysses splits them), every sequence it splits at every size the run trains (a
multiple of the context size), the attention kernel and the levers that do not compose with it.
Torch-free, read-only: the transformer's heads are read from its config.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from omegaconf import DictConfig

from ds_trainer.config import buckets, families
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig) -> list[Problem]:
    """The context size, the family, the heads and the lengths, the kernel."""
    context = int(cfg.parallel.context)
    if context == 1:
        return []
    if context < 1:
        return [Problem("parallel.context", context, "is how many ranks split one sample's "
                        "sequence, at least 1", "parallel.context=1")]
    world = int(cfg.resolved.world_size or cfg.world_size or 1)
    if world % context:
        sizes = [n for n in range(1, world + 1) if world % n == 0 and n > 1]
        listed = ", ".join(map(str, sizes)) or "none above 1"
        return [Problem("parallel.context", context, f"splits the {world} ranks into groups of "
                        f"{context}, which does not divide them", f"parallel.context="
                        f"{sizes[-1] if sizes else 1} (a divisor of the world size: {listed})")]
    spec = families.of(cfg)
    if spec.context_lengths is None:
        return [_cannot_split(spec, context)]
    return _heads(cfg, context) + _lengths(cfg, context) + _levers(cfg, context)


def _cannot_split(spec: families.FamilySpec, context: int) -> Problem:
    """A UNet has no sequence; a transformer without a plan (diffusers' class carries none and
    ds_trainer writes none) cannot split its own."""
    fix = ("parallel.context=1 (ZeRO-3 or FSDP2 shard the weights; gradient checkpointing cuts "
           "the activations)")
    if spec.component == "unet":
        return Problem("parallel.context", context, f"model.family={spec.name}'s UNet has no "
                       "sequence to split: its convolutions mix each pixel with its neighbours at "
                       "every level, so its activations cannot be cut along tokens", fix)
    return Problem("parallel.context", context, f"model.family={spec.name}'s transformer "
                   f"({spec.module_classes[0]}) has no context-parallel plan: diffusers carries "
                   "none for it and ds_trainer has not written one, so nothing says where its "
                   "tokens (and their masks or positions) are split and gathered", fix)


def _heads(cfg: DictConfig, context: int) -> list[Problem]:
    """Ulysses gives each rank of the group its share of the attention heads."""
    path = Path(str(cfg.model.architecture)) / "transformer" / "config.json"
    try:
        heads = int(json.loads(path.read_text())["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if cfg.parallel.attention.value != "ulysses" or heads % context == 0:
        return []
    fits = [n for n in range(2, heads + 1) if heads % n == 0]
    return [Problem("parallel.context", context, f"Ulysses attention gives each of the {context} "
                    f"ranks of a group its share of model={cfg.model.name}'s {heads} attention "
                    f"heads, which {context} does not divide", f"parallel.context="
                    f"{_nearest(context, fits)} (a divisor of {heads}: "
                    f"{', '.join(map(str, fits[:8]))})")]


def _lengths(cfg: DictConfig, context: int) -> list[Problem]:
    """Each sequence the plan splits, at every size and frame count the run trains, a multiple of
    the context size (the largest bucket and the smallest tell most; all are checked)."""
    spec = families.of(cfg)
    assert spec.context_lengths is not None
    sizes = [(int(cfg.resolution.width), int(cfg.resolution.height))]
    if buckets.enabled(cfg):
        sizes = buckets.generate_all(cfg)
    frames = sorted({int(n) for n in cfg.data.video.frames}) if spec.video else [1]
    for width, height in sizes:
        for count in frames:
            for what, length in spec.context_lengths(cfg, width, height, count).items():
                if length % context == 0:
                    continue
                where = f"{width}x{height}" + (f", {count} frame(s)" if spec.video else "")
                fits = [n for n in range(2, context * 2 + 1) if length % n == 0] or [1]
                return [Problem("parallel.context", context, f"splits {what} into {context} "
                                f"equal parts: at {where} there are {length}, which {context} does "
                                f"not divide", f"parallel.context={_nearest(context, fits)}, or a "
                                "size whose tokens it divides (resolution, data.video.frames, "
                                "data.buckets=false)")]
    return []


def _levers(cfg: DictConfig, context: int) -> list[Problem]:
    """The attention kernel and what is not built to compose with a split sequence."""
    out = []
    if cfg.parallel.attention.value == "ring":
        out.append(Problem("parallel.attention", "ring", "ring attention merges each rank's "
                           "partial attention by its log-sum-exp, which only CUDA kernels return "
                           "(diffusers' _native_cudnn, flash); it cannot be tested on this "
                           "project's machines and is not offered", "parallel.attention=ulysses"))
    if cfg.train.attention.value != "sdpa":
        out.append(Problem("train.attention", cfg.train.attention.value, "holds each attention "
                           "layer to one torch kernel; under parallel.context diffusers' attention "
                           "dispatch runs the all-to-all around its own kernel choice",
                           "train.attention=sdpa"))
    if cfg.model.get("reference_images"):
        out.append(Problem("parallel.context", context, "is not built for an editing model: its "
                           "reference's tokens (and Qwen-Image-Edit's vision tokens in the "
                           "caption) change the split sequences' lengths image by image",
                           "parallel.context=1"))
    return out


def _nearest(context: int, fits: list[int]) -> int:
    """The size among `fits` nearest `context` (the smaller on a tie)."""
    return min(fits, key=lambda n: (abs(math.log(n / context)), n))
