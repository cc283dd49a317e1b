"""Training images and captions: synthetic ones or a folder of captioned images (checked before a run), with
SDXL's micro-conditioning."""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from PIL import Image, ImageOps

from ds_trainer.config import buckets as bucket_geometry
from ds_trainer.config import families, holdout, source_repeats
from ds_trainer.errors import DataError
from ds_trainer.train.backends.mesh import data_world
from ds_trainer.train.data import buckets, clips, references, scan, sources, video

log = logging.getLogger(__name__)

_COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
           "purple": (140, 60, 190), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (15, 15, 15)}
_SHAPES = ("square", "bar", "block")


@dataclass
class Example:
    """One training image at the target size, with its caption and SDXL time ids."""

    pixels: torch.Tensor  # 3 x H x W in [-1, 1]
    caption: str
    time_ids: torch.Tensor  # original (h, w), crop top-left (y, x), target (h, w)
    mask: torch.Tensor | None = None  # 1 x H x W in [0, 1] (data.masked_loss): where the loss counts
    control: torch.Tensor | None = None  # 3 x H x W in [-1, 1]: the reference image (model.reference_images)
    more: tuple[torch.Tensor, ...] = ()  # the further references of a model that takes several


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to RGB as a user expects: alpha composited on white, 16-bit scaled, CMYK converted."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda v: v / 256).convert("L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image.convert("RGB")


def _fit(image: Image.Image, width: int, height: int, center: bool, flip: bool,
         rng: random.Random) -> tuple[Image.Image, list[int]]:
    """Resize so the image covers width x height, crop to it; returns the image and SDXL time ids:
    original size (the source image's), crop top-left (in the resized image), target size."""
    crop = buckets.crop_of(image.size, (width, height), center, flip, rng)
    orig_w, orig_h = image.size
    image = image.resize((crop.width, crop.height), Image.Resampling.LANCZOS)
    left = crop.width - width - crop.left if crop.flipped else crop.left
    image = image.crop((left, crop.top, left + width, crop.top + height))
    if crop.flipped:
        image = ImageOps.mirror(image)
    return image, [orig_h, orig_w, crop.top, crop.left, height, width]


def _pixels(image: Image.Image) -> torch.Tensor:
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)
    return data.permute(2, 0, 1).float() / 127.5 - 1.0


class SyntheticImages:
    """Deterministic images (a colored shape on a colored background, with noise) and matching captions."""

    def __init__(self, cfg: DictConfig, n: int | None = None, first: int = 0) -> None:
        """`n` images from image number `first` on (the validation set: images after the training ones)."""
        self.n, self.seed = int(cfg.data.num_samples) if n is None else n, int(cfg.train.seed)
        self.first = first
        self.width, self.height = int(cfg.resolution.width), int(cfg.resolution.height)
        # An editing model's pairs: the same picture with the shape in another colour is the reference
        # (a model of several references: model.references of them, each in a colour of its own)
        self.reference = bool(cfg.model.get("reference_images"))
        self.references = int(cfg.model.get("references") or 1) if self.reference else 0
        # A video model's: clips of the most frames data.video.frames names, the shape moving
        self.frames = max(int(n) for n in cfg.data.video.frames) if families.of(cfg).video else None

    def __len__(self) -> int:
        return self.n

    def identity(self) -> dict[str, Any]:
        return {"source": "synthetic", "n": self.n, "seed": self.seed, **({"first": self.first} if self.first else {}),
                **({"reference": True} if self.reference else {}),
                **({"references": self.references} if self.references > 1 else {}),
                **({"frames": self.frames} if self.frames else {})}

    def names(self) -> list[str]:
        return [f"synthetic #{self.first + i}" for i in range(self.n)]

    def __getitem__(self, index: int) -> Example:
        index += self.first
        time_ids = torch.tensor([self.height, self.width, 0, 0, self.height, self.width])
        if self.frames:
            clip, caption = clips.synthetic(index, self.seed, self.width, self.height, self.frames)
            return Example(clip, caption, time_ids)
        rng = random.Random(self.seed * 1_000_003 + index)
        bg, fg = rng.sample(sorted(_COLORS), 2)
        shape = rng.choice(_SHAPES)
        image = Image.new("RGB", (self.width, self.height), _COLORS[bg])
        w = self.width // (2 if shape != "bar" else 6)
        h = self.height // 2
        x, y = rng.randint(0, self.width - w), rng.randint(0, self.height - h)
        control = image.copy() if self.reference else None
        image.paste(_COLORS[fg], (x, y, x + w, y + h))
        pixels = _pixels(image)
        noise = torch.Generator().manual_seed(self.seed * 7919 + index)
        pixels = (pixels + 0.05 * torch.randn(pixels.shape, generator=noise)).clamp(-1, 1)
        caption = f"a {fg} {shape} on a {bg} background"
        if control is None:
            return Example(pixels, caption, time_ids)
        pool = {c: rgb for c, rgb in _COLORS.items() if c not in (fg, bg)}  # the shape in another colour
        refs = references.synthetic(control, (x, y, x + w, y + h), rng, pool, self.references, _pixels)
        return Example(pixels, caption, time_ids, control=refs[0], more=tuple(refs[1:]))


class SourceImages:
    """The images of `data.sources` (or data=folder's one folder, or validation.path): folders, tables, tar shards,
    saved Hugging Face datasets (train/data/sources.py), each checked before a run, a source's images repeated
    `repeats` times an epoch.

    Unreadable images are skipped with a count per source and reason in the log; a source with nothing usable is a
    DataError naming it."""

    def __init__(self, cfg: DictConfig, accelerator: Any = None, part: str = "all", root: str | None = None,
                 decode: bool = True, early: bool = False) -> None:
        """`part`: `all` images, or those `validation.split` leaves to `train` or holds out for `validation`
        (config/holdout.py); `root`: validation.path's folder instead of the sources; `decode=False`:
        the new files' headers checked, not their pixels; `early`: only the checks (`early_check`)."""
        self.scoring = root is not None
        self.sources = [sources.for_validation(cfg)] if self.scoring else sources.of(cfg)
        self.width, self.height = int(cfg.resolution.width), int(cfg.resolution.height)
        self.center, self.flip, self.seed = bool(cfg.data.center_crop), bool(cfg.data.random_flip), int(cfg.train.seed)
        self.masked = bool(cfg.data.masked_loss) and part != "validation" and not self.scoring  # validation: unmasked
        self.reference = bool(cfg.model.get("reference_images"))  # each image read with its reference
        self.references = int(cfg.model.get("references") or 1)  # the most (model.references)
        found, checks, checked_now = scan.listed_and_checked(cfg, self.sources, accelerator, decode)
        usable = [found[key] for key, entry in sorted(checks.items())
                  if not isinstance(entry[-1], str)]
        self.found = Counter(found[key].source for key in checks)
        self.skipped_by_source: Counter[tuple[int, str]] = Counter()
        # the files skipped, by source and reason
        self.skipped_names: dict[tuple[int, str], list[str]] = {}
        self.damaged: set[str] = set()  # the reasons that are damage (not a missing reference)
        usable = self._skip_unusable(found, checks, usable)
        # A video model's: each clip's windows (data.video), a clip shorter than all skipped
        self.clip_windows = None
        if families.of(cfg).video:
            self.clip_windows = clips.windows_of(cfg, checks, usable, self._skip)
            usable = [item for item in usable if self.clip_windows.get(item.key, True)]
        if part in ("all", "train"):  # the held-out part says nothing new about the sources
            self._log_found(checks, checked_now)
            if self.masked:
                files = sum(1 for item in found.values() if item.mask is not None)
                log.info("masked loss: %d image(s) with a %s file, and any image's alpha channel; elsewhere the "
                         "whole image (outside a mask the loss counts data.unmasked_weight=%s)", files,
                         sources.MASK_SUFFIX, cfg.data.unmasked_weight)
        self._nothing_usable(usable)
        self._too_damaged(float(cfg.data.max_bad_fraction))
        if early:
            return
        if part != "all":
            usable = self._split(cfg, usable, part)
        self.unique = len(usable)
        # Fractional repeats: the epoch is the passes that see every source a whole number of times.
        self.passes = 1 if part == "validation" else source_repeats.epoch_passes([s.repeats for s in self.sources])
        windows = self.clip_windows or {}
        still: list[video.Window | None] = [None]  # an image, or a clip of no windows
        pairs = [(item, window) for item in usable for window in windows.get(item.key) or still
                 for _ in range(1 if part == "validation" else self._repeats(item))]
        self.items = [item for item, _ in pairs]
        self.windows: list[video.Window | None] = [window for _, window in pairs]
        if self.passes > 1 and part in ("all", "train"):
            log.info("fractional repeats: an epoch is %d passes over the sources, in which %s", self.passes,
                     ", ".join(f"{s.label} is seen {source_repeats.fraction(s.repeats) * self.passes} time(s)"
                               for s in self.sources))
        missing = sum(1 for item in usable if not item.caption)
        if missing and part != "validation":
            log.warning("%d image(s) have no caption; %s them with an empty prompt", missing,
                        "scoring" if self.scoring else "training")
        self.layout: buckets.Layout | None = None
        self.plan: buckets.Plan | None = None
        if bucket_geometry.enabled(cfg) or self.clip_windows is not None or self.references > 1:
            self._arrange(cfg, checks, part, accelerator)

    def _arrange(self, cfg: DictConfig, checks: dict[str, list[Any]], part: str,
                 accelerator: Any) -> None:
        """The samples in their buckets (of size, and of frames for a video model's clips) and, for
        training, the plan of global batches, each of one bucket."""
        self.layout, self.items, self.windows = buckets.layout(
            cfg, self.items, [s.resolution for s in self.sources], self.windows, checks,
            self.reference and self.references > 1)
        if part == "validation" or self.scoring:
            return  # scored image by image at its bucket's size: no epochs to plan
        world = data_world(cfg, accelerator)  # the data's streams: one per context group
        batch = int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps) * world
        repeat = cfg.data.bucket_remainder.value == "repeat"
        self.plan = buckets.Plan(self.layout, batch, self.seed, repeat)
        if accelerator is None or accelerator.is_main_process:
            for line in self.plan.report():
                log.info("bucket %s", line)

    def _skip_unusable(self, found: dict[str, sources.Item], checks: dict[str, list[Any]],
                       usable: list[sources.Item]) -> list[sources.Item]:
        """Count and name what cannot train: what its check found wrong, and for an editing model
        an image without its reference; the usable items left."""
        for key, entry in sorted(checks.items()):
            if isinstance(problem := entry[-1], str):
                self._skip(found[key], problem)
                self.damaged.add(problem)
        if not self.reference:
            return usable
        return references.paired(usable, self.sources, self.references, self._skip)

    def _nothing_usable(self, usable: list[sources.Item]) -> None:
        """A source none of whose files can train stops the run, named."""
        for source in self.sources:
            if not any(item.source == source.index for item in usable):
                n = self.found[source.index]
                what = f"{n} image file(s), none readable" if n else f"no {sources.what_is_read(source.kind)}"
                raise DataError(f"{source.label}={source.path}: {what}; nothing to "
                                f"{'score' if self.scoring else 'train on'}")

    def _too_damaged(self, share: float) -> None:
        """A source with more than `share` (data.max_bad_fraction) of its files damaged stops the
        run: that many is a copy gone wrong or the wrong folder, not a few bad images."""
        for source in self.sources:
            reasons = {why: n for (index, why), n in self.skipped_by_source.items()
                       if index == source.index and why in self.damaged}
            bad, found = sum(reasons.values()), self.found[source.index]
            if found and bad / found > share:
                why, _ = max(reasons.items(), key=lambda kv: kv[1])
                names = self.skipped_names.get((source.index, why), [])[:3]
                raise DataError(f"{source.label}={source.path}: {bad} of its {found} files damaged "
                                f"({bad / found:.0%}, above data.max_bad_fraction={share:g}); most "
                                f"{why} (e.g. {', '.join(names)}). Repair or remove them, or "
                                f"data.max_bad_fraction={min(1.0, round(bad / found + 0.05, 2)):g} "
                                "to train on the rest")

    def _skip(self, item: sources.Item, reason: str) -> None:
        self.skipped_by_source[(item.source, reason)] += 1
        self.skipped_names.setdefault((item.source, reason), []).append(item.key)

    @property
    def skipped(self) -> Counter[str]:
        """Files skipped, by reason, over every source."""
        out: Counter[str] = Counter()
        for (_, reason), count in self.skipped_by_source.items():
            out[reason] += count
        return out

    def _repeats(self, item: sources.Item) -> int:
        """The samples of `item` in an epoch of `passes` passes."""
        return int(source_repeats.fraction(self.sources[item.source].repeats) * self.passes)

    def _log_found(self, checks: dict[str, list[Any]], checked_now: int) -> None:
        for source in self.sources:
            log.info("%s=%s: %d %s, repeated %g time(s) an epoch%s", source.label, source.path,
                     self.found[source.index], self._noun(), source.repeats,
                     "" if source.resolution is None else f", in buckets of about {source.resolution}x"
                                                          f"{source.resolution} pixels")
        for (index, reason), count in sorted(self.skipped_by_source.items()):
            source, names = self.sources[index], self.skipped_names.get((index, reason), [])
            shown = f" ({', '.join(names[:10])}{', ...' * (len(names) > 10)})" if names else ""
            log.warning("%s=%s: skipped %d file(s): %s%s", source.label, source.path, count, reason,
                        shown)
        log.info("checked %d %s: %d decoded now, %d known from an earlier check", len(checks),
                 self._noun(), checked_now, len(checks) - checked_now)

    def _noun(self) -> str:
        """What the sources hold: images, or a video model's files (videos and images)."""
        return "image(s)" if self.clip_windows is None else "file(s)"

    def _split(self, cfg: DictConfig, usable: list[sources.Item], part: str) -> list[sources.Item]:
        """The items `validation.split` leaves to training (`train`) or holds out (`validation`)."""
        keys = [item.key for item in usable]
        split = float(cfg.validation.split)
        if holdout.count(split, len(keys)) >= len(keys):
            raise DataError(f"validation.split={cfg.validation.split}: holds out {holdout.count(split, len(keys))} "
                            f"of the {len(keys)} usable images of the data, leaving none to train on; hold out fewer "
                            "(validation.split=0.05 or a count below the images), or score a folder of other images "
                            "with validation.path=")
        trained, held = holdout.split_files(keys, split)
        chosen = set(held if part == "validation" else trained)
        return [item for item in usable if item.key in chosen]

    def names(self) -> list[str]:
        return [item.key for item in self.items]

    def caption(self, index: int) -> str:
        return self.items[index].caption

    def source_of(self, index: int) -> int:
        return self.items[index].source

    def __len__(self) -> int:
        return len(self.items)

    def identity(self) -> dict[str, Any]:
        return {"source": "sources", "items": [(item.key, *item.stat) for item in self.items], "center": self.center,
                "flip": self.flip, "seed": self.seed}

    def _target(self, index: int) -> tuple[tuple[int, int], random.Random]:
        """The size sample `index` is trained at and the generator of its random crop and flip, keyed by the item (a
        repeated image has one crop, which the cache holds once; files added to a folder change no other crop)."""
        target = (self.width, self.height) if self.layout is None else self.layout.bucket(index)
        return target, random.Random(f"{self.seed}:{self.items[index].key}")

    def cache_names(self) -> list[str]:
        """Per-sample cache file names keyed by the item, its caption, its size and its crop: a repeated image is one
        file, and a later run on a source with images added encodes only the new ones."""
        names, sizes = [], dict[str, tuple[int, int]]()
        for index, item in enumerate(self.items):
            target, rng = self._target(index)
            if self.layout is not None:
                size = self.layout.sizes[index]
            else:
                size = sizes[item.key] = sizes.get(item.key) or buckets.source_size(item.read)
            crop = buckets.crop_of(size, target, self.center, self.flip, rng)
            identity = f"{item.key}|{item.stat}|{size}|{item.caption}"
            window = self.windows[index]  # a clip's window (its frames at the model's rate)
            if window is not None:
                identity += f"|window {window.name()}"
            if self.masked:  # the mask is cached with the latents: its own cache file
                identity += f"|mask {item.mask_stat}"
            if self.reference:  # so is the reference image's latents
                identity += f"|control {item.control_stat}"
                identity += "".join(f"|control {stat}" for _, stat in item.more_controls)
            frames = self.layout.frames if self.layout is not None else None
            counts = self.layout.references if self.layout is not None else None
            group = (frames[index] if frames else None, counts[index] if counts else None)
            names.append(buckets.cache_name(target, identity, crop, *group))
        return names

    def __getitem__(self, index: int) -> Example:
        item, window = self.items[index], self.windows[index]
        if window is not None:  # a video model's clip: its window's frames, each cut as an image is
            (width, height), _ = self._target(index)
            pixels, time_ids = clips.window_pixels(item.read, window, lambda image: _fit(
                image, width, height, self.center, self.flip, self._target(index)[1]), _pixels)
            return Example(pixels, item.caption, torch.tensor(time_ids))
        example = self._image(index)
        if self.clip_windows is not None:  # an image in a video model's run: a clip of one frame
            example.pixels = example.pixels[:, None]
        return example

    def _image(self, index: int) -> Example:
        item = self.items[index]
        with item.read() as f, Image.open(f) as raw:
            upright = ImageOps.exif_transpose(raw)
            mask = _mask_of(upright, item) if self.masked else None
            image = _to_rgb(upright)
        (width, height), rng = self._target(index)
        image, time_ids = _fit(image, width, height, self.center, self.flip, rng)
        size = (width, height)
        control = self._control(item.control, item, size, index) if self.reference else None
        more = tuple(self._control(read, item, size, index) for read, _ in item.more_controls)
        times = torch.tensor(time_ids)
        if mask is None:
            return Example(_pixels(image), item.caption, times, control=control, more=more)
        mask, _ = _fit(mask, width, height, self.center, self.flip, self._target(index)[1])  # the image's crop
        weights = torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8).view(1, height, width)
        return Example(_pixels(image), item.caption, times, weights / 255.0, control, more)

    def _control(self, read: Any, item: sources.Item, size: tuple[int, int], index: int) -> torch.Tensor:
        """A reference image (`read` opens it) at the image's `size`, cut as the image is (its own
        size resized to cover the image's first: a reference of another size is fitted alike)."""
        if read is None:
            raise DataError(f"{item.key}: no reference image (model.reference_images)")
        rng = self._target(index)[1]
        fit = lambda picture: _fit(picture, *size, self.center, self.flip, rng)[0]  # noqa: E731
        return _pixels(references.read(read, _to_rgb, fit))


def _mask_of(image: Image.Image, item: sources.Item) -> Image.Image:
    """An image's mask as an 8-bit image of its size: its alpha channel, else its <name>.mask.png (resized to it),
    else all of it."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").getchannel("A")
    if item.mask is not None:
        with item.mask() as f, Image.open(f) as raw:
            mask = ImageOps.exif_transpose(raw).convert("L")
        return mask if mask.size == image.size else mask.resize(image.size, Image.Resampling.BILINEAR)
    return Image.new("L", image.size, 255)


def early_check(cfg: DictConfig) -> None:
    """Before Accelerate's set-up and any op build, on every rank: the sources listed (a table's
    schema, a shard's index) and each new file checked, decoded and recorded in a one-rank run (its
    later check then decodes nothing), its header only on several ranks (whose later check shares the
    decoding), so a data mistake is refused in seconds. Its log lines are held back unless it refuses:
    the later check says them once."""
    if cfg.data.source.value == "synthetic":
        return
    logger = logging.getLogger("ds_trainer.train.data")
    held: list[logging.LogRecord] = []
    keep, propagate = _Keep(held), logger.propagate
    logger.addHandler(keep)
    logger.propagate = False
    try:
        SourceImages(cfg, None, "all", decode=int(cfg.resolved.world_size or 1) == 1, early=True)
    except DataError:
        logger.removeHandler(keep)
        logger.propagate = propagate
        for record in held:  # what was skipped and why, before the refusal
            logger.handle(record)
        raise
    finally:
        logger.removeHandler(keep)
        logger.propagate = propagate


class _Keep(logging.Handler):
    """Keeps the log records it is handed."""

    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


def dataset(cfg: DictConfig, accelerator: Any = None) -> SyntheticImages | SourceImages:
    """The images to train on (with validation on, without those it holds out); `accelerator` (optional) lets
    the ranks share the work of checking the sources."""
    if cfg.data.source.value == "synthetic":
        return SyntheticImages(cfg)
    held_out = cfg.validation.enabled and cfg.validation.path is None
    return SourceImages(cfg, accelerator, "train" if held_out else "all")


def validation_set(cfg: DictConfig, accelerator: Any = None) -> SyntheticImages | SourceImages:
    """The images the validation loss scores: validation.path's folder, the part of data.path that
    validation.split holds out, or for synthetic data as many images again after the training ones."""
    if cfg.validation.path is not None:
        return SourceImages(cfg, accelerator, "all", root=str(cfg.validation.path))
    if cfg.data.source.value == "synthetic":
        n = int(cfg.data.num_samples)
        return SyntheticImages(cfg, holdout.count(float(cfg.validation.split), n), first=n)
    return SourceImages(cfg, accelerator, "validation")
