"""A video model's samples as pixels: a window of a video file's frames (train/data/video.py), each
frame resized and cropped as an image is (the same crop and flip for every frame of the window), an
image as a clip of one frame, and synthetic clips (a coloured shape moving across a coloured
background) for a run without data."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from ds_trainer.train.data import video

_COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 60, 190),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
_MOTIONS = ("left", "right", "up", "down")


def stacked(frames: list[torch.Tensor]) -> torch.Tensor:
    """Frames (3, H, W) as a clip (3, F, H, W)."""
    return torch.stack(frames, dim=1)


def window_pixels(
    read: Callable[[], Any],
    window: video.Window,
    fit: Callable[[Image.Image], tuple[Image.Image, list[int]]],
    pixels: Callable[[Image.Image], torch.Tensor],
) -> tuple[torch.Tensor, list[int]]:
    """A window's frames decoded, each fitted by `fit` (the sample's resize, crop and flip) and
    turned into pixels by `pixels`; the clip (3, F, H, W) and the first frame's time ids."""
    fitted = [fit(frame) for frame in video.frames(read, window)]
    return stacked([pixels(image) for image, _ in fitted]), fitted[0][1]


def synthetic(
    index: int, seed: int, width: int, height: int, frames: int
) -> tuple[torch.Tensor, str]:
    """Clip `index` of the synthetic data (a function of the seed and the index): a shape of one
    colour moving on a background of another, with noise, in [-1, 1] (3, F, H, W); and its caption.
    """
    rng = random.Random(seed * 1_000_003 + index)
    bg, fg = rng.sample(sorted(_COLORS), 2)
    motion = rng.choice(_MOTIONS)
    w, h = max(2, width // 3), max(2, height // 3)
    x, y = rng.randint(0, width - w), rng.randint(0, height - h)
    dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[motion]
    speed = max(1, min(width, height) // 16)
    out = []
    for k in range(frames):
        image = Image.new("RGB", (width, height), _COLORS[bg])
        left = min(max(0, x + dx * speed * k), width - w)
        top = min(max(0, y + dy * speed * k), height - h)
        image.paste(_COLORS[fg], (left, top, left + w, top + h))
        data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(
            height, width, 3
        )
        out.append(data.permute(2, 0, 1).float() / 127.5 - 1.0)
    clip = stacked(out)
    noise = torch.Generator().manual_seed(seed * 7919 + index)
    clip = (clip + 0.05 * torch.randn(clip.shape, generator=noise)).clamp(-1, 1)
    return clip, f"a {fg} square moving {motion} on a {bg} background"


def windows_of(
    cfg: Any, checks: dict[str, list[Any]], usable: list[Any], skip: Callable[[Any, str], None]
) -> dict[str, list[video.Window]]:
    """Each usable clip's training windows by key (an image has none: it trains as one frame); a
    clip shorter than every frame count of data.video.frames is skipped with `skip(item, why)`, its
    windows empty."""
    out: dict[str, list[video.Window]] = {}
    fewest = min(int(n) for n in cfg.data.video.frames)
    for item in usable:
        info = checks[item.key][-1]
        if not isinstance(info, dict):
            continue
        out[item.key] = video.windows(info, cfg)
        if not out[item.key]:
            length, _ = video.resampled(info, cfg)
            skip(
                item,
                f"too short ({length} frame(s) at {float(cfg.model.video.fps):g} fps, fewer than "
                f"data.video.frames' fewest, {fewest})",
            )
    return out
