"""The on-disk cache of VAE latents and text embeddings, as the model family encodes them."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from omegaconf import DictConfig, OmegaConf

from ds_trainer.train.data import captions, order
from ds_trainer.train.data.images import SourceImages, SyntheticImages
from ds_trainer.train.families import common, text_encoders
from ds_trainer.train.families.base import Family

log = logging.getLogger(__name__)


class LatentCache:
    """VAE latents and text embeddings, one file per image under `data.cache_dir/<key>`.

    For synthetic data the key hashes the model, resolution and data, so a change to any of them makes a new cache.
    For images of sources the key hashes the model alone and each image's file, under its size's folder, is named by
    a hash of its image, caption and crop: a later run, or a run on a source with images added, encodes only what it
    has not seen, and an image a source repeats is one file. A cache is complete when its manifest exists; files are
    written atomically, so an interrupted build resumes where it stopped.
    """

    def __init__(self, cfg: DictConfig, data: SyntheticImages | SourceImages, family: Family, kind: str) -> None:
        self.names = data.cache_names() if isinstance(data, SourceImages) else None
        self.keys = data.names()  # what orders the build's shares: a source's files and shards, in order
        model: Any = OmegaConf.to_container(cfg.model, resolve=True)
        # The encoders' dtype is part of what a latent is: a cache built on a GPU in bf16 and one built on a CPU
        # in float32 must not be mixed in a shared cache_dir. `kind` is the device torch confirmed, which the
        # encoders run on (the torch-free guess in resolved.platform says "cuda" where a CPU-only torch sees none).
        model["encoders_dtype"] = common.frozen_dtype_name(cfg, kind)
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
        bucketed = getattr(data, "layout", None) is not None
        size = "buckets" if bucketed else f"{cfg.resolution.width}x{cfg.resolution.height}"
        self.dir = Path(cfg.data.cache_dir) / f"{cfg.model.name}-{size}-{key}"
        self.manifest = self.dir / "manifest.json"
        if self.names is not None:  # one manifest per set of samples: the folder is shared by many sets
            self.manifest = self.dir / f"manifest-{hashlib.sha256('|'.join(self.names).encode()).hexdigest()[:16]}.json"
        self.n = len(data)
        self.family = family
        # Each file and the first sample it holds (a repeated image's samples share one): fixed by the names.
        self._files: dict[Path, int] = {}
        for i in range(self.n):
            self._files.setdefault(self.path(i), i)
        self._empty: dict[str, torch.Tensor] | None = None  # the empty prompt's tensors, read once when first dropped

    @property
    def complete(self) -> bool:
        return self.manifest.exists()

    def path(self, index: int) -> Path:
        return self.dir / (f"{self.names[index]}.pt" if self.names is not None else f"{index:08d}.pt")

    def build(self, data: SyntheticImages | SourceImages, frozen: Any, rank: int, world: int,
              device: torch.device, batch_size: int = 8) -> int:
        """Encode this rank's share of the samples not cached yet; returns how many it encoded.
        Samples are encoded in batches of one shape (one bucket folder)."""
        family = self.family
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.dir / captions.EMPTY).exists():  # what a dropped caption trains with (data.caption_dropout)
            empty = family.text_inputs(frozen, [""], device)
            tmp = self.dir / f".{captions.EMPTY}.tmp{os.getpid()}"
            safetensors.torch.save_file({key: on_cpu(value[0], family.storage_dtype(key)).contiguous()
                                         for key, value in empty.items()}, str(tmp))
            tmp.replace(self.dir / captions.EMPTY)
        # Each rank a contiguous block of the files in key order (a run of shards), then by bucket to batch them.
        mine = order.share(sorted(self._files.values(), key=lambda i: self.keys[i]), rank, world)
        todo = sorted((i for i in mine if not self.path(i).exists()), key=lambda i: (self.path(i).parent.name, i))
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
                            **{key: on_cpu(value[j], family.storage_dtype(key)) for key, value in text.items()},
                            "time_ids": chunk[j].time_ids.clone(), **_mask(chunk[j], latents[j])}
                    _save_atomic(item, self.path(index))
        return len(todo)

    def files(self) -> int:
        """How many files the samples take (a repeated image's samples share one)."""
        return len(self._files)

    def disk_bytes(self) -> int:
        """What the cached samples take on disk."""
        return sum(path.stat().st_size for path in self._files if path.exists())

    def finish(self) -> None:
        """Mark the cache complete (rank 0, after every rank built its share)."""
        missing = [path for path in self._files if not path.exists()]
        if missing:
            raise RuntimeError(f"latent cache {self.dir} lacks {len(missing)} samples after building")
        tmp = self.dir / f".manifest.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"samples": self.n}))
        tmp.replace(self.manifest)

    def load(self, indices: list[int], drop: list[bool] | None = None) -> dict[str, torch.Tensor]:
        """The samples' tensors; those `drop` marks with the empty prompt's text tensors."""
        items = [torch.load(self.path(i), map_location="cpu", weights_only=True) for i in indices]
        if drop and any(drop):
            if self._empty is None:
                self._empty = safetensors.torch.load_file(str(self.dir / captions.EMPTY))
            items = [{**item, **self._empty} if gone else item for item, gone in zip(items, drop, strict=True)]
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def encode_batch(data: SyntheticImages | SourceImages, frozen: Any, indices: list[int],
                 device: torch.device, family: Family | None = None,
                 drop: list[bool] | None = None, texts: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The same tensors as LatentCache.load, computed now (data.cache=false), as `family` encodes them (SDXL's
    when not given); the samples `drop` marks with an empty caption, or each with its caption in `texts`."""
    if family is None:
        from ds_trainer.train.families.sdxl import SDXL

        family = SDXL()
    examples = [data[i] for i in indices]
    drop = drop or [False] * len(examples)
    latents = family.encode_images(frozen, torch.stack([e.pixels for e in examples]))
    if texts is None:
        texts = ["" if gone else e.caption for e, gone in zip(examples, drop, strict=True)]
    text = family.text_inputs(frozen, texts, device)
    # On the CPU in float32, as the cache holds them: the step draws its noise on the CPU, and on a GPU the
    # encoders' CUDA tensors would meet it there (diffusers' add_noise moves only the schedule's tensors).
    masks = [_mask(e, latents[j]) for j, e in enumerate(examples)]
    return {"latents": latents.to("cpu", torch.float32),
            **{key: on_cpu(value, family.storage_dtype(key)) for key, value in text.items()},
            "time_ids": torch.stack([e.time_ids for e in examples]),
            **({"mask": torch.stack([m["mask"] for m in masks])} if masks[0] else {})}


def _mask(example: Any, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"mask": the image's mask at the latents' resolution (each latent pixel the mean of the pixels it covers)},
    or nothing without a mask (data.masked_loss=false)."""
    if example.mask is None:
        return {}
    mask = torch.nn.functional.interpolate(example.mask[None].float(), size=tuple(latents.shape[-2:]), mode="area")
    return {"mask": mask[0].clone()}


def _save_atomic(item: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(item, tmp)
    tmp.replace(path)


def on_cpu(value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor as the cache holds it: on the CPU, float32 if floating (or the family's `dtype` for it: SD3's long
    text sequence in bf16), token ids as integers, not a view."""
    floating = dtype or torch.float32
    return value.to("cpu", floating if value.is_floating_point() else value.dtype).clone()
