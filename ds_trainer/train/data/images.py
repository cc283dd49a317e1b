"""Training images and captions: synthetic ones or a folder of captioned images (checked before a run), with
SDXL's micro-conditioning."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from PIL import Image, ImageOps, UnidentifiedImageError

from ds_trainer.config import buckets as bucket_geometry
from ds_trainer.config import holdout
from ds_trainer.errors import DataError
from ds_trainer.train.data import buckets

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
_COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
           "purple": (140, 60, 190), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (15, 15, 15)}
_SHAPES = ("square", "bar", "block")


@dataclass
class Example:
    """One training image at the target size, with its caption and SDXL time ids."""

    pixels: torch.Tensor  # 3 x H x W in [-1, 1]
    caption: str
    time_ids: torch.Tensor  # original (h, w), crop top-left (y, x), target (h, w)


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

    def __len__(self) -> int:
        return self.n

    def identity(self) -> dict[str, Any]:
        return {"source": "synthetic", "n": self.n, "seed": self.seed, **({"first": self.first} if self.first else {})}

    def names(self) -> list[str]:
        return [f"synthetic #{self.first + i}" for i in range(self.n)]

    def __getitem__(self, index: int) -> Example:
        index += self.first
        rng = random.Random(self.seed * 1_000_003 + index)
        bg, fg = rng.sample(sorted(_COLORS), 2)
        shape = rng.choice(_SHAPES)
        image = Image.new("RGB", (self.width, self.height), _COLORS[bg])
        w = self.width // (2 if shape != "bar" else 6)
        h = self.height // 2
        x, y = rng.randint(0, self.width - w), rng.randint(0, self.height - h)
        image.paste(_COLORS[fg], (x, y, x + w, y + h))
        pixels = _pixels(image)
        noise = torch.Generator().manual_seed(self.seed * 7919 + index)
        pixels = (pixels + 0.05 * torch.randn(pixels.shape, generator=noise)).clamp(-1, 1)
        caption = f"a {fg} {shape} on a {bg} background"
        return Example(pixels, caption, torch.tensor([self.height, self.width, 0, 0, self.height, self.width]))


class FolderImages:
    """jpg/png/webp files in a folder (recursively), captions from same-name .txt files or metadata.jsonl.

    Unreadable files are skipped with a count in the log; a folder with no usable image is a DataError.
    """

    def __init__(self, cfg: DictConfig, accelerator: Any = None, part: str = "all", root: str | None = None) -> None:
        """`part`: `all` images of the folder, or those `validation.split` leaves to `train` or holds out for
        `validation` (config/holdout.py); `root`: another folder than data.path (validation.path)."""
        key = "validation.path" if root is not None else "data.path"
        self.root = Path(root if root is not None else cfg.data.path)
        self.width, self.height = int(cfg.resolution.width), int(cfg.resolution.height)
        self.center, self.flip, self.seed = bool(cfg.data.center_crop), bool(cfg.data.random_flip), int(cfg.train.seed)
        self.caption_ext = str(cfg.data.caption_ext)
        self.metadata = self._metadata()
        folder_key = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:16]
        record = Path(cfg.data.cache_dir) / f"scan-{folder_key}.json"
        checks, checked_now = _check_images(self.root, record, accelerator)
        self.files = [self.root / rel for rel, (_, _, problem) in sorted(checks.items()) if problem is None]
        self.stats = {rel: (size, mtime) for rel, (size, mtime, _) in checks.items()}
        self.skipped = Counter(problem for _, _, problem in checks.values() if problem is not None)
        if part == "all" or part == "train":  # the held-out part says nothing new about the folder
            log.info("%s=%s: %d image file(s); %d decoded now to check them, %d known from %s", key, self.root,
                     len(checks), checked_now, len(checks) - checked_now, record)
            for reason, count in sorted(self.skipped.items()):
                log.warning("%s=%s: skipped %d file(s): %s", key, self.root, count, reason)
        if not self.files:
            found = f"{len(checks)} image file(s), none readable" if checks else "no jpg/png/webp files"
            raise DataError(f"{key}={self.root}: {found}; nothing to {'score' if root else 'train on'}")
        if part != "all":
            self.files = self._split(cfg, part)
        missing = sum(1 for f in self.files if not self._caption(f))
        if missing and part != "validation":
            log.warning("%s=%s: %d image(s) have no caption; %s them with an empty prompt", key, self.root, missing,
                        "scoring" if root else "training")
        self.layout: buckets.Layout | None = None
        self.plan: buckets.Plan | None = None
        if bucket_geometry.enabled(cfg):
            self.layout, self.files = buckets.layout(cfg, self.root, self.files)
            if part == "validation" or root is not None:
                return  # scored image by image at its bucket's size: no epochs to plan
            world = accelerator.num_processes if accelerator else 1
            batch = int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps) * world
            self.plan = buckets.Plan(self.layout, batch, self.seed, cfg.data.bucket_remainder.value == "repeat")
            if accelerator is None or accelerator.is_main_process:
                for line in self.plan.report():
                    log.info("bucket %s", line)

    def _split(self, cfg: DictConfig, part: str) -> list[Path]:
        """The files `validation.split` leaves to training (`train`) or holds out (`validation`)."""
        relative = [str(f.relative_to(self.root)) for f in self.files]
        split = float(cfg.validation.split)
        if holdout.count(split, len(relative)) >= len(relative):
            raise DataError(f"validation.split={cfg.validation.split}: holds out {holdout.count(split, len(relative))} "
                            f"of the {len(relative)} usable images of data.path={self.root}, leaving none to train on; "
                            "hold out fewer (validation.split=0.05 or a count below the images), or score a folder "
                            "of other images with validation.path=")
        trained, held = holdout.split_files(relative, split)
        return [self.root / rel for rel in (held if part == "validation" else trained)]

    def names(self) -> list[str]:
        return [str(f.relative_to(self.root)) for f in self.files]

    def _metadata(self) -> dict[str, str]:
        path = self.root / "metadata.jsonl"
        captions: dict[str, str] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    captions[str(row.get("file_name", ""))] = str(row.get("text", row.get("caption", "")))
        return captions

    def _caption(self, path: Path) -> str:
        text = path.with_suffix(f".{self.caption_ext}")
        if text.exists():
            return text.read_text().strip()
        return self.metadata.get(str(path.relative_to(self.root)), self.metadata.get(path.name, ""))

    def __len__(self) -> int:
        return len(self.files)

    def identity(self) -> dict[str, Any]:
        stats = [(str(f.relative_to(self.root)), f.stat().st_size, int(f.stat().st_mtime)) for f in self.files]
        return {"source": "folder", "root": str(self.root.resolve()), "files": stats, "center": self.center,
                "flip": self.flip, "seed": self.seed, "captions": self.caption_ext}

    def _target(self, index: int) -> tuple[tuple[int, int], random.Random]:
        """The size sample `index` is trained at and the generator of its random crop and flip (keyed by the
        file's name with buckets, so the cache of an image survives files added to the folder)."""
        if self.layout is None:
            return (self.width, self.height), random.Random(self.seed * 1_000_003 + index)
        return self.layout.bucket(index), random.Random(f"{self.seed}:{self.files[index].relative_to(self.root)}")

    def cache_names(self) -> list[str] | None:
        """Per-sample cache file names keyed by image, caption, bucket and crop (None without buckets)."""
        if self.layout is None:
            return None
        names = []
        for index, path in enumerate(self.files):
            target, rng = self._target(index)
            crop = buckets.crop_of(self.layout.sizes[index], target, self.center, self.flip, rng)
            rel = str(path.relative_to(self.root))
            identity = f"{rel}|{self.stats[rel]}|{self.layout.sizes[index]}|{self._caption(path)}"
            names.append(buckets.cache_name(target, identity, crop))
        return names

    def __getitem__(self, index: int) -> Example:
        path = self.files[index]
        with Image.open(path) as raw:
            image = _to_rgb(raw)
        (width, height), rng = self._target(index)
        image, time_ids = _fit(image, width, height, self.center, self.flip, rng)
        return Example(_pixels(image), self._caption(path), torch.tensor(time_ids))


def _problem(path: Path) -> str | None:
    """Why an image file cannot be trained on (decoding it whole), or None."""
    if path.stat().st_size == 0:
        return "empty file"
    try:
        with Image.open(path) as image:
            image.load()
    except UnidentifiedImageError:
        return "not an image (unrecognized format)"
    except Exception:  # noqa: BLE001 - PIL raises many types for damaged files
        return "truncated or corrupt image"
    return None


def _check_images(root: Path, record: Path, accelerator: Any) -> tuple[dict[str, list[Any]], int]:
    """{relative path: [size, mtime_ns, problem or None]} of every image file under `root`, and how many
    were decoded now.

    Decoding every image is the only sure check, and slow on a large folder, so it is done once: the
    results are kept in `record` (under data.cache_dir) and only new or changed files are decoded on a
    later start (a resumed or requeued job). The ranks split that work. Rank 0 lists the folder and reads
    the record for all of them, so every rank ends with the same list of files.
    """
    from ds_trainer.train.backends import accelerator as accel

    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    listing: tuple[dict[str, list[int]], dict[str, list[Any]]] = ({}, {})
    if rank == 0:
        stats = {}
        for path in sorted(root.rglob("*")):
            if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file():
                st = path.stat()
                stats[str(path.relative_to(root))] = [st.st_size, st.st_mtime_ns]
        try:
            known = json.loads(record.read_text())
        except (OSError, ValueError):
            known = {}
        listing = (stats, known)
    stats, known = accel.from_main(accelerator, listing) if world > 1 else listing
    checks = {rel: known[rel] for rel, stat in stats.items() if known.get(rel, [None, None])[:2] == stat}
    todo = [rel for rel in stats if rel not in checks]
    mine = {rel: [*stats[rel], _problem(root / rel)] for rel in todo[rank::world]}
    if world > 1:
        from accelerate.utils import gather_object

        for part in gather_object([mine]):
            checks.update(part)
    else:
        checks.update(mine)
    if rank == 0 and todo:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(checks))
        tmp.replace(record)
    return checks, len(todo)


def dataset(cfg: DictConfig, accelerator: Any = None) -> SyntheticImages | FolderImages:
    """The images to train on (with validation on, without those it holds out); `accelerator` (optional) lets
    the ranks share the work of checking a folder."""
    if cfg.data.source.value == "synthetic":
        return SyntheticImages(cfg)
    held_out = cfg.validation.enabled and cfg.validation.path is None
    return FolderImages(cfg, accelerator, "train" if held_out else "all")


def validation_set(cfg: DictConfig, accelerator: Any = None) -> SyntheticImages | FolderImages:
    """The images the validation loss scores: validation.path's folder, the part of data.path that
    validation.split holds out, or for synthetic data as many images again after the training ones."""
    if cfg.validation.path is not None:
        return FolderImages(cfg, accelerator, "all", root=str(cfg.validation.path))
    if cfg.data.source.value == "synthetic":
        n = int(cfg.data.num_samples)
        return SyntheticImages(cfg, holdout.count(float(cfg.validation.split), n), first=n)
    return FolderImages(cfg, accelerator, "validation")
