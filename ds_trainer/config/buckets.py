"""Aspect-ratio bucket geometry: which WIDTHxHEIGHT sizes a run trains at. Torch-free, so the config
checks and the planner use it before a run; `train/buckets.py` assigns images and plans the batches.

Buckets keep about the resolution's area (px1024: about 1024x1024 pixels), with sides multiples of
`step` (data.bucket_step and the model's downsampling factor), between a min and a max side and
within a max aspect ratio: for every width the tallest height that keeps the area, and the same with
the axes swapped (the NovelAI/kohya construction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig

from ds_trainer.config.problems import Problem

Bucket = tuple[int, int]  # (width, height) in pixels


@dataclass(frozen=True)
class Spec:
    """The bucket settings of a run, with defaults filled in from the resolution."""

    area: int
    min_side: int
    max_side: int
    max_ratio: float
    step: int


def name(bucket: Bucket) -> str:
    """`1216x832`: WIDTHxHEIGHT, as SDXL users name buckets."""
    return f"{bucket[0]}x{bucket[1]}"


def enabled(cfg: DictConfig) -> bool:
    return bool(cfg.data.source.value != "synthetic" and cfg.data.buckets)


def spec(cfg: DictConfig, resolution: int | None = None) -> Spec:
    """The settings of `cfg` (of a source's `resolution`, the side of its area, where it has one): min side defaults to
    half the resolution's side, max side to twice it."""
    d, width, height = cfg.data, int(cfg.resolution.width), int(cfg.resolution.height)
    if resolution is not None:
        width = height = int(resolution)
    step = math.lcm(max(1, int(d.bucket_step)), max(1, int(cfg.model.downsample_factor)))
    side = math.isqrt(width * height)
    min_side = int(d.bucket_min_side) if d.bucket_min_side is not None else max(step, side // 2 // step * step)
    max_side = int(d.bucket_max_side) if d.bucket_max_side is not None else side * 2
    return Spec(width * height, min_side, max_side, float(d.bucket_max_aspect_ratio), step)


def source_resolutions(cfg: DictConfig) -> list[int | None]:
    """Each data.sources entry's own resolution (None: the run's); one None for any other data option."""
    if cfg.data.source.value != "sources" or not len(cfg.data.sources):
        return [None]
    return [None if s.resolution is None else int(s.resolution) for s in cfg.data.sources]


def generate_all(cfg: DictConfig) -> list[Bucket]:
    """The buckets of the run's resolution and of every source's own, together, sorted as `generate` sorts."""
    found = {b for side in dict.fromkeys(source_resolutions(cfg)) for b in generate(spec(cfg, side))}
    return sorted(found, key=lambda b: (b[0] / b[1], b[0]))


def generate(s: Spec) -> list[Bucket]:
    """All buckets of `s`, sorted by aspect ratio (portrait first); empty when the limits exclude all."""
    found: set[Bucket] = set()
    low = -(-s.min_side // s.step) * s.step  # the smallest multiple of step >= min_side
    for w in range(low, s.max_side + 1, s.step):
        h = min(s.area // w // s.step * s.step, s.max_side // s.step * s.step)
        if h >= s.min_side and max(w / h, h / w) <= s.max_ratio + 1e-9:
            found.update({(w, h), (h, w)})
    return sorted(found, key=lambda b: (b[0] / b[1], b[0]))


def largest(cfg: DictConfig) -> Bucket:
    """The size that bounds memory: the largest-area bucket (the resolution when buckets are off)."""
    if not enabled(cfg):
        return int(cfg.resolution.width), int(cfg.resolution.height)
    found = generate_all(cfg)
    if not found:
        return int(cfg.resolution.width), int(cfg.resolution.height)
    return max(found, key=lambda b: (b[0] * b[1], max(b)))


def problems(cfg: DictConfig) -> list[Problem]:
    """Bucket settings that cannot work; `config.checks` asks it before a run."""
    sides = source_resolutions(cfg)
    if not enabled(cfg):
        index = next((i for i, side in enumerate(sides) if side is not None), None)
        return [] if index is None else [Problem(
            f"data.sources[{index}].resolution", sides[index], "trains the source in buckets of its own area, and "
            "data.buckets=false trains every image at one size", "data.buckets=true, or drop the source's resolution")]
    d, out = cfg.data, []
    if d.bucket_step < 8 or d.bucket_step % 8:
        out.append(Problem("data.bucket_step", d.bucket_step, "must be a positive multiple of 8 (the VAE's factor)",
                           "data.bucket_step=64"))
    if d.bucket_max_aspect_ratio < 1:
        out.append(Problem("data.bucket_max_aspect_ratio", d.bucket_max_aspect_ratio,
                           "is width/height of the most elongated bucket, at least 1",
                           "data.bucket_max_aspect_ratio=4.0"))
    for key in ("bucket_min_side", "bucket_max_side"):
        if d[key] is not None and d[key] < 1:
            out.append(Problem(f"data.{key}", d[key], "must be a positive number of pixels", f"data.{key}=null"))
    if out:
        return out
    for index, side in enumerate(sides):
        if side is not None and not generate(spec(cfg, side)):
            s = spec(cfg, side)
            out.append(Problem(f"data.sources[{index}].resolution", side, f"no bucket of about {side}x{side} pixels "
                               f"has both sides in [{s.min_side}, {s.max_side}] as multiples of {s.step}",
                               f"data.sources[{index}].resolution=<a multiple of {s.step}>, or data.bucket_min_side="
                               "null data.bucket_max_side=null"))
    s = spec(cfg)
    if not generate(s):
        out.append(Problem("data.bucket_min_side", s.min_side,
                           f"no bucket of about {s.area} pixels (resolution "
                           f"{cfg.resolution.width}x{cfg.resolution.height}) has both sides in [{s.min_side}, "
                           f"{s.max_side}] as multiples of {s.step} and an aspect ratio within {s.max_ratio}",
                           "data.bucket_min_side=null data.bucket_max_side=null (the defaults)"))
    return out
