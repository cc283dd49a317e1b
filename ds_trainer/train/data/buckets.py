"""Aspect-ratio buckets inside a run: each image's bucket and crop, and the plan of global batches.

Every global batch (micro batch x accumulation x ranks) comes from one bucket and is split across
the ranks, so all ranks run the same shape at every micro-step and the same number of steps. The plan
is a pure function of (seed, epoch, position): global batch `s` (the one optimizer step `s + 1`
trains) is batch `s % per_epoch` of epoch `s // per_epoch`, and sample position `p` (counted in
samples, `p = s * global_batch`) is sample `p % global_batch` of global batch `p // global_batch`.
A resume therefore continues the same plan, also on another number of ranks that keeps the global
batch size (the plan is built per global batch size).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from omegaconf import DictConfig
from PIL import Image

from ds_trainer.config import buckets as geometry
from ds_trainer.config.buckets import Bucket
from ds_trainer.errors import DataError

if TYPE_CHECKING:
    from ds_trainer.train.data.sources import Item

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Crop:
    """Where an image lands in its bucket: resized to (width, height), cropped at (top, left), maybe mirrored.

    `top`/`left` are in the resized image's pixels; for a mirrored image `left` is measured in the
    mirrored image, so the time ids describe the pixels the model sees."""

    width: int
    height: int
    top: int
    left: int
    flipped: bool


def crop_of(size: tuple[int, int], target: Bucket, center: bool, flip: bool, rng: random.Random) -> Crop:
    """The resize-to-cover and crop of an image of `size` (w, h) for `target` (w, h)."""
    (orig_w, orig_h), (width, height) = size, target
    scale = max(width / orig_w, height / orig_h)
    new_w, new_h = max(width, round(orig_w * scale)), max(height, round(orig_h * scale))
    left = (new_w - width) // 2 if center else rng.randint(0, new_w - width)
    top = (new_h - height) // 2 if center else rng.randint(0, new_h - height)
    flipped = flip and rng.random() < 0.5
    return Crop(new_w, new_h, top, new_w - width - left if flipped else left, flipped)


def source_size(read: Callable[[], BinaryIO]) -> tuple[int, int]:
    """(width, height) as the image `read` opens is seen upright (EXIF orientation applied), from its header only."""
    with read() as f, Image.open(f) as image:
        width, height = image.size
        orientation = image.getexif().get(0x0112, 1)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def nearest(size: tuple[int, int], found: list[Bucket]) -> int:
    """Index of the bucket nearest in aspect ratio (distance of log ratios; ties go to the first)."""
    import math

    ratio = math.log(size[0] / size[1])
    return min(range(len(found)), key=lambda k: abs(math.log(found[k][0] / found[k][1]) - ratio))


@dataclass
class Layout:
    """The buckets of a folder: `of[i]` is sample i's bucket in `buckets`, `sizes[i]` its source
    size, `frames[i]` its frames (a video model's clip; 1 for an image): a global batch is of one
    bucket and one frame count."""

    buckets: list[Bucket]
    of: list[int]
    sizes: list[tuple[int, int]]
    frames: list[int] | None = None
    # each sample's count of reference images, where a model takes several (model.references)
    references: list[int] | None = None

    def bucket(self, index: int) -> Bucket:
        return self.buckets[self.of[index]]

    def key(self, index: int) -> tuple[int, int, int]:
        """What a global batch shares: the bucket, the frame count and the reference count."""
        return (self.of[index], self.frames[index] if self.frames else 1,
                self.references[index] if self.references else 1)

    def label(self, key: tuple[int, int, int]) -> str:
        """`1216x832`, a clip's `832x480x81`, with references `1024x1024, 2 references`."""
        size = geometry.name(self.buckets[key[0]])
        size = size if self.frames is None else f"{size}x{key[1]}"
        return size if self.references is None else f"{size}, {key[2]} references"

    def counts(self) -> dict[str, int]:
        """{WIDTHxHEIGHT[xFRAMES]: samples} of the buckets that hold samples."""
        out: dict[str, int] = {}
        for key in sorted({self.key(i) for i in range(len(self.of))}):
            out[self.label(key)] = sum(1 for i in range(len(self.of)) if self.key(i) == key)
        return out


# A video model's window per sample (train/data/video.py's Window; None for an image)
Windows = list[Any]


def layout(cfg: DictConfig, items: list[Item], sides: list[int | None] | None = None,
           windows: Windows | None = None,
           checks: dict[str, list[Any]] | None = None,
           references: bool = False) -> tuple[Layout, list[Item], Windows]:
    """Assign every image to its bucket (a repeated image's header is read once), among the buckets of its source's
    resolution (`sides[item.source]`, None: the run's); images more elongated than the max aspect ratio fit none and
    are left out (with their sizes in the log); no image left is a DataError naming the sizes.
    A video model's samples (`windows`, their sizes from the clips' `checks`) also keep their
    frame counts; without data.buckets they all train at the run's resolution, in batches of one
    frame count. `references`: a model of several references batches samples of one count."""
    windows = windows if windows is not None else [None] * len(items)
    if not geometry.enabled(cfg):  # a video model's run at one size: buckets of frames alone
        size = (int(cfg.resolution.width), int(cfg.resolution.height))
        sizes = [_size(item, checks) for item in items]
        counts = _references(items, references)
        return Layout([size], [0] * len(items), sizes, _frames(windows), counts), items, windows
    s = geometry.spec(cfg)
    found = geometry.generate_all(cfg)
    sides = sides or [None]
    own = {side: [found.index(b) for b in geometry.generate(geometry.spec(cfg, side))] for side in set(sides)}
    kept, sizes, skipped, known = [], [], [], {}
    for item, window in zip(items, windows, strict=True):
        if item.key not in known:
            known[item.key] = _size(item, checks)
        w, h = known[item.key]
        if max(w / h, h / w) > s.max_ratio + 1e-9:
            skipped.append(f"{item.key} ({w}x{h})")
        else:
            kept.append((item, window))
            sizes.append((w, h))
    skipped = list(dict.fromkeys(skipped))
    if skipped:
        log.warning("%d image(s) fit no bucket (aspect ratio beyond data.bucket_max_aspect_ratio=%s) and are left "
                    "out: %s", len(skipped), s.max_ratio, ", ".join(skipped[:20]))
    if not kept:
        raise DataError(f"data: no image fits a bucket: {', '.join(skipped[:20])} are all more "
                        f"elongated than data.bucket_max_aspect_ratio={s.max_ratio} (buckets "
                        f"{geometry.name(found[0])} to {geometry.name(found[-1])}); raise "
                        f"data.bucket_max_aspect_ratio or train at one size with data.buckets=false")
    of = []
    for (item, _), size in zip(kept, sizes, strict=True):
        choices = own[sides[item.source]]
        of.append(choices[nearest(size, [found[k] for k in choices])])
    left, kept_items = [window for _, window in kept], [item for item, _ in kept]
    counts = _references(kept_items, references)
    return Layout(found, of, sizes, _frames(left), counts), kept_items, left


def _size(item: Item, checks: dict[str, list[Any]] | None) -> tuple[int, int]:
    """A sample's source size: a clip's from its check, an image's from its header."""
    info = checks[item.key][-1] if checks is not None and item.key in checks else None
    if isinstance(info, dict):
        return int(info["width"]), int(info["height"])
    return source_size(item.read)


def _frames(windows: Windows) -> list[int] | None:
    """Each sample's frames where any is a clip's window (an image's: 1), else None."""
    if all(window is None for window in windows):
        return None
    return [1 if window is None else int(window.count) for window in windows]


def _references(items: list[Item], several: bool) -> list[int] | None:
    """Each sample's reference count where the model takes several, else None."""
    return [1 + len(item.more_controls) for item in items] if several else None


def cache_name(bucket: Bucket, identity: str, crop: Crop, frames: int | None = None,
               references: int | None = None) -> str:
    """The cache file of one sample: its bucket's folder (a video model's: and its frames; a model's
    of several references: and their count), a hash of the image, caption and crop."""
    text = f"{identity}|{crop.width}x{crop.height}|{crop.top},{crop.left},{int(crop.flipped)}"
    folder = geometry.name(bucket) if frames is None else f"{geometry.name(bucket)}x{frames}"
    folder = folder if references is None else f"{folder}r{references}"
    return f"{folder}/{hashlib.sha256(text.encode()).hexdigest()[:24]}"


class Plan:
    """The global batches of every epoch, each `global_batch` samples of one bucket."""

    def __init__(self, layout_: Layout, global_batch: int, seed: int, repeat: bool) -> None:
        self.layout, self.global_batch, self.seed, self.repeat = layout_, global_batch, seed, repeat
        keys = sorted({layout_.key(i) for i in range(len(layout_.of))})
        self.members = {k: [i for i in range(len(layout_.of)) if layout_.key(i) == k] for k in keys}
        self.counts = {k: len(m) // global_batch + (1 if repeat and len(m) % global_batch else 0)
                       for k, m in self.members.items()}
        self.per_epoch = sum(self.counts.values())
        self._cached: tuple[int, list[list[int]]] | None = None
        if self.per_epoch == 0:
            sizes = ", ".join(f"{layout_.label(k)}: {len(m)}" for k, m in self.members.items())
            raise DataError(f"every bucket holds fewer images than one global batch of {global_batch} (micro batch x "
                            f"accumulation x ranks) ({sizes}), so data.bucket_remainder=drop leaves nothing to train "
                            f"on; use data.bucket_remainder=repeat, a smaller batch, or data.buckets=false")

    def report(self) -> list[str]:
        """One line per bucket: images, global batches per epoch, images dropped or repeated per epoch."""
        lines = []
        for k, m in self.members.items():
            rest = len(m) % self.global_batch
            extra = (f", {self.global_batch - rest} repeated" if self.repeat else f", {rest} dropped") if rest else ""
            what = "image(s)" if self.layout.frames is None else "sample(s)"
            lines.append(f"{self.layout.label(k)}: {len(m)} {what}, {self.counts[k]} batch(es) "
                         f"per epoch{extra}")
        return lines

    def epoch(self, e: int) -> list[list[int]]:
        """The global batches of epoch `e`, in training order: a function of (seed, epoch) alone."""
        if self._cached is not None and self._cached[0] == e:
            return self._cached[1]
        rng = random.Random(self.seed * 1_000_033 + e)
        batches = []
        g = self.global_batch
        for k, members in self.members.items():
            order = list(members)
            rng.shuffle(order)
            if self.repeat and len(order) % g:
                order += [order[j % len(members)] for j in range(g - len(order) % g)]
            batches += [order[j * g:(j + 1) * g] for j in range(self.counts[k])]
        rng.shuffle(batches)
        self._cached = (e, batches)
        return batches

    def batch(self, s: int) -> list[int]:
        """Global batch `s` (samples s * global_batch ... of the run)."""
        e, position = divmod(s, self.per_epoch)
        return self.epoch(e)[position]

    def samples(self, start: int, count: int) -> list[int]:
        """Samples `start` ... `start + count - 1` of the run's stream (a data position counted in samples)."""
        g = self.global_batch
        return [self.batch(p // g)[p % g] for p in range(start, start + count)]

    def indices(self, b: int, rank: int, world: int, micro: int) -> list[int]:
        """Rank `rank`'s part of global micro-batch `b` (micro-step `b % accumulation` of step `b // accumulation`)."""
        accum = self.global_batch // (micro * world)
        s, m = divmod(b, accum)
        start = (m * world + rank) * micro
        return self.batch(s)[start:start + micro]
