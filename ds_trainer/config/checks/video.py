"""A video model's settings (`model.video`, `data.video`, `samples.frames`) against its family and
the rest of the run: the frame counts its VAE takes, what an image model has no use for, what a
video model cannot train with yet. Torch-free, read-only.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ds_trainer.config import families
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig) -> list[Problem]:
    """model.video against the family, then the clips' frames and what video cannot combine with."""
    spec, video = families.of(cfg), cfg.model.get("video")
    if not spec.video:
        if video is None:
            return []
        return [
            Problem(
                "model.video",
                "{...}",
                f"model.family={spec.name} trains on images; model.video sets a video "
                "model's frame rate, conditioning and experts",
                "drop the video block from the model's "
                "yaml, or a video model (model=wan_tiny shows the block)",
            )
        ]
    if video is None:
        return [
            Problem(
                "model.video",
                None,
                f"model.family={spec.name} trains on clips, whose frame rate and "
                "conditioning model.video sets",
                f"model={spec.name}_tiny shows the block "
                f"(conf/model/{spec.name}_tiny.yaml); copy it into your model's yaml",
            )
        ]
    return _frames(cfg, spec.temporal_factor) + _settings(cfg) + _unsupported(cfg)


def valid_frames(count: int, factor: int) -> bool:
    """Whether a clip of `count` frames fits a VAE that compresses `factor` frames into one after
    the first."""
    return count >= 1 and (count - 1) % factor == 0


def nearest_frames(count: int, factor: int) -> int:
    """The frame count nearest `count` that the VAE takes (k * factor + 1)."""
    return max(1, round((count - 1) / factor) * factor + 1)


def _frames(cfg: DictConfig, factor: int) -> list[Problem]:
    """data.video.frames and samples.frames: each k * factor + 1 (a clip the VAE takes whole)."""
    out, frames = [], [int(n) for n in cfg.data.video.frames]
    if not frames:
        out.append(
            Problem(
                "data.video.frames",
                "[]",
                "names no frame count to train clips at",
                f"data.video.frames=[{factor * 4 + 1}]",
            )
        )
    bad = [n for n in frames if not valid_frames(n, factor)]
    if bad:
        fixed = sorted({nearest_frames(n, factor) for n in frames})
        out.append(
            Problem(
                "data.video.frames",
                bad[0],
                f"the VAE compresses {factor} frames into one after the "
                f"first, so a clip is k * {factor} + 1 frames "
                f"(1, {factor + 1}, {2 * factor + 1}, ...)",
                f"data.video.frames=[{','.join(map(str, fixed))}]",
            )
        )
    asked = cfg.samples.get("frames")
    if asked is not None and not valid_frames(int(asked), factor):
        out.append(
            Problem(
                "samples.frames",
                asked,
                f"a sample clip is k * {factor} + 1 frames, as the VAE decodes them",
                f"samples.frames={nearest_frames(int(asked), factor)}",
            )
        )
    return out


def _settings(cfg: DictConfig) -> list[Problem]:
    """The frame rate and the extraction's numbers."""
    v, d, out = cfg.model.video, cfg.data.video, []
    if not float(v.fps) > 0:
        out.append(
            Problem(
                "model.video.fps",
                v.fps,
                "is the model's frame rate, a positive number",
                "model.video.fps=16 (Wan 2.1's; 24 for Wan 2.2 TI2V-5B)",
            )
        )
    if int(d.stride) < 1:
        out.append(
            Problem(
                "data.video.stride",
                d.stride,
                "is the frames between two windows' starts (data.video.extraction=slide)",
                "data.video.stride=8",
            )
        )
    if int(d.windows) < 1:
        out.append(
            Problem(
                "data.video.windows",
                d.windows,
                "is how many windows a clip gives (data.video.extraction=uniform)",
                "data.video.windows=2",
            )
        )
    return out


def _unsupported(cfg: DictConfig) -> list[Problem]:
    """What an image model trains with that a video model has no form of yet."""
    out = []
    if cfg.data.masked_loss:
        out.append(
            Problem(
                "data.masked_loss",
                True,
                "masks are images beside images (<name>.mask.png); a clip has "
                "no per-frame mask here",
                "data.masked_loss=false",
            )
        )
    if cfg.model.get("reference_images"):
        out.append(
            Problem(
                "model.reference_images",
                True,
                "pairs each image with a reference image (an editing "
                "model's); a video model is given its clip's first frame (model.video.condition)",
                "model.reference_images=false, and model.video.condition=clip_and_latents|latents|"
                "first_frame for image to video",
            )
        )
    return out
