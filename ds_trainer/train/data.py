"""Training data: synthetic or a folder of captioned images, SDXL micro-conditioning, and the
on-disk cache of VAE latents and text embeddings (as the model family encodes them) the training loop reads."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image, ImageOps, UnidentifiedImageError

from ds_trainer.config import buckets as bucket_geometry
from ds_trainer.config import holdout
from ds_trainer.errors import DataError
from ds_trainer.train import buckets, families, models, text_encoders
from ds_trainer.train.families.base import Family

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
    from ds_trainer.train import accel

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


def batch_indices(batch: int, rank: int, world: int, micro: int, n: int, seed: int) -> list[int]:
    """Indices of global micro-batch `batch` for `rank`: a fixed function of its arguments, so a resumed
    run sees exactly the data an uninterrupted one would. Epochs are seeded permutations of the data."""
    return sample_indices((batch * world + rank) * micro, micro, n, seed)


def sample_indices(position: int, count: int, n: int, seed: int) -> list[int]:
    """The dataset indices of `count` samples from sample `position` of the run's endless sample sequence
    (one seeded permutation per epoch): the sequence does not depend on ranks or batch sizes."""
    out = []
    for p in range(position, position + count):
        epoch, offset = divmod(p, n)
        out.append(_permutation(n, seed, epoch)[offset])
    return out


_perm_cache: dict[tuple[int, int, int], list[int]] = {}


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _perm_cache:
        _perm_cache.clear()
        _perm_cache[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 10_007 + epoch)).tolist()
    return _perm_cache[key]


class LatentCache:
    """VAE latents and text embeddings, one file per sample under `data.cache_dir/<key>`.

    Without buckets the key hashes the model, resolution and data, so a change to any of them makes a
    new cache. With buckets the key hashes the model alone and each sample's file, under its bucket's
    folder, is named by a hash of its image, caption and crop: a later run, or a run on a folder
    with images added, encodes only what it has not seen. A cache is complete when its manifest
    exists; files are written atomically, so an interrupted build resumes where it stopped.
    """

    def __init__(self, cfg: DictConfig, data: SyntheticImages | FolderImages) -> None:
        self.names = data.cache_names() if isinstance(data, FolderImages) else None
        model: Any = OmegaConf.to_container(cfg.model, resolve=True)
        # The encoders' dtype is part of what a latent is: a cache built on a GPU in bf16 and one built on a CPU
        # in float32 must not be mixed in a shared cache_dir.
        model["encoders_dtype"] = models.frozen_dtype_name(cfg, str(cfg.resolved.platform or "cpu"))
        if str(getattr(cfg.model, "family", "sdxl")).split(".")[-1] == "sdxl":  # SDXL's keys as before families
            model.pop("family", None)
            model.pop("flow", None)
        # A trained encoder's samples hold its token ids instead of its embeddings: another cache. (Absent when
        # both are frozen, so the caches built before text-encoder training keep their keys.)
        trained = text_encoders.trained(cfg)
        if trained:
            model["trained_text_encoders"] = list(trained)
        identity = {"model": model, "resolution": [int(cfg.resolution.width), int(cfg.resolution.height)],
                    "data": data.identity()} if self.names is None else {"model": model}
        key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
        size = "buckets" if self.names is not None else f"{cfg.resolution.width}x{cfg.resolution.height}"
        self.dir = Path(cfg.data.cache_dir) / f"{cfg.model.name}-{size}-{key}"
        self.manifest = self.dir / "manifest.json"
        if self.names is not None:  # one manifest per set of samples: the folder is shared by many sets
            self.manifest = self.dir / f"manifest-{hashlib.sha256('|'.join(self.names).encode()).hexdigest()[:16]}.json"
        self.n = len(data)
        self.family = families.of(cfg)

    @property
    def complete(self) -> bool:
        return self.manifest.exists()

    def path(self, index: int) -> Path:
        return self.dir / (f"{self.names[index]}.pt" if self.names is not None else f"{index:08d}.pt")

    def build(self, data: SyntheticImages | FolderImages, frozen: Any, rank: int, world: int,
              device: torch.device, batch_size: int = 8) -> int:
        """Encode this rank's share of the samples not cached yet; returns how many it encoded.
        Samples are encoded in batches of one shape (one bucket folder)."""
        family = self.family
        self.dir.mkdir(parents=True, exist_ok=True)
        todo = sorted((i for i in range(rank, self.n, world) if not self.path(i).exists()),
                      key=lambda i: (self.path(i).parent.name, i))
        chunks = [list(group) for _, group in itertools.groupby(todo, key=lambda i: self.path(i).parent)]
        for group in chunks:
            self.path(group[0]).parent.mkdir(parents=True, exist_ok=True)
            for start in range(0, len(group), batch_size):
                part = group[start:start + batch_size]
                chunk = [data[i] for i in part]
                latents = family.encode_images(frozen, torch.stack([e.pixels for e in chunk]))
                text = family.text_inputs(frozen, [e.caption for e in chunk], device)
                for j, index in enumerate(part):
                    item = {"latents": latents[j].to("cpu", torch.float32).clone(),
                            **{key: _on_cpu(value[j], family.storage_dtype(key)) for key, value in text.items()},
                            "time_ids": chunk[j].time_ids.clone()}
                    tmp = self.path(index).with_suffix(f".tmp{os.getpid()}")
                    torch.save(item, tmp)
                    tmp.replace(self.path(index))
        return len(todo)

    def disk_bytes(self) -> int:
        """What the cached samples take on disk."""
        return sum(self.path(i).stat().st_size for i in range(self.n) if self.path(i).exists())

    def finish(self) -> None:
        """Mark the cache complete (rank 0, after every rank built its share)."""
        missing = [i for i in range(self.n) if not self.path(i).exists()]
        if missing:
            raise RuntimeError(f"latent cache {self.dir} lacks {len(missing)} samples after building")
        tmp = self.dir / f".manifest.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"samples": self.n}))
        tmp.replace(self.manifest)

    def load(self, indices: list[int]) -> dict[str, torch.Tensor]:
        items = [torch.load(self.path(i), map_location="cpu", weights_only=True) for i in indices]
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def encode_batch(data: SyntheticImages | FolderImages, frozen: Any, indices: list[int],
                 device: torch.device, family: Family | None = None) -> dict[str, torch.Tensor]:
    """The same tensors as LatentCache.load, computed now (data.cache=false), as `family` encodes them (SDXL's
    when not given)."""
    if family is None:
        from ds_trainer.train.families.sdxl import SDXL

        family = SDXL()
    examples = [data[i] for i in indices]
    latents = family.encode_images(frozen, torch.stack([e.pixels for e in examples]))
    text = family.text_inputs(frozen, [e.caption for e in examples], device)
    # On the CPU in float32, as the cache holds them: the step draws its noise on the CPU, and on a GPU the
    # encoders' CUDA tensors would meet it there (diffusers' add_noise moves only the schedule's tensors).
    return {"latents": latents.to("cpu", torch.float32),
            **{key: _on_cpu(value, family.storage_dtype(key)) for key, value in text.items()},
            "time_ids": torch.stack([e.time_ids for e in examples])}


def _on_cpu(value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor as the cache holds it: on the CPU, float32 if floating (or the family's `dtype` for it: SD3's long
    text sequence in bf16), token ids as integers, not a view."""
    floating = dtype or torch.float32
    return value.to("cpu", floating if value.is_floating_point() else value.dtype).clone()


class Loader:
    """The micro-batches of one rank: `loader(b)` is this rank's part of global micro-batch `b`, from the
    latent cache, or encoded now when there is none (`data.cache=false`).

    `start` (step, samples) is where a resumed run continues: micro-batch `step * accumulation` begins at
    sample `samples` of the sample sequence, so a resume under another world size or micro batch goes on
    with the samples an uninterrupted run would have seen. Each batch carries its samples' positions
    (`position`), which seed their noise.
    """

    def __init__(self, cfg: DictConfig, data: SyntheticImages | FolderImages, cache: LatentCache | None,
                 frozen: Any, rank: int, world: int, device: torch.device,
                 start: tuple[int, int] | None = None) -> None:
        self.data, self.cache, self.frozen, self.device = data, cache, frozen, device
        self.family = families.of(cfg)
        self.rank, self.world = rank, world
        self.micro, self.seed = int(cfg.train.micro_batch_size), int(cfg.train.seed)
        self.plan = data.plan if isinstance(data, FolderImages) else None
        step, self.offset = start or (0, 0)
        self.first = step * int(cfg.train.gradient_accumulation_steps)
        # The cache read of micro-batch b+1 runs in a thread while b trains (files, unpickling: no GPU work).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ds_trainer-prefetch") if cache is not None else None
        self._next: tuple[int, Future[dict[str, torch.Tensor]]] | None = None

    def position(self, b: int) -> int:
        """The first sample position of this rank's part of micro-batch `b`."""
        return self.offset + ((b - self.first) * self.world + self.rank) * self.micro

    def __call__(self, b: int) -> dict[str, torch.Tensor]:
        if self._pool is None:
            return self._load(b)
        ahead = self._next
        if ahead is not None and ahead[0] == b:
            batch = ahead[1].result()
        else:  # not the batch read ahead (the first call): one reader at a time
            if ahead is not None:
                wait([ahead[1]])
            batch = self._load(b)
        self._next = (b + 1, self._pool.submit(self._load, b + 1))
        return batch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _load(self, b: int) -> dict[str, torch.Tensor]:
        position = self.position(b)
        if self.plan is not None:  # one bucket per global batch: every rank gets the same shape
            indices = self.plan.samples(position, self.micro)
        else:
            indices = sample_indices(position, self.micro, len(self.data), self.seed)
        batch = self.cache.load(indices) if self.cache is not None else \
            encode_batch(self.data, self.frozen, indices, self.device, self.family)
        batch["position"] = torch.arange(position, position + self.micro)
        return batch
