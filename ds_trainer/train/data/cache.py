"""The on-disk cache of VAE latents and text embeddings, as the model family encodes them."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import rundir
from ds_trainer.train.data import captions, order
from ds_trainer.train.data.images import SourceImages, SyntheticImages
from ds_trainer.train.families import common, text_encoders
from ds_trainer.train.families.base import Family

log = logging.getLogger(__name__)


# A pack is written when it holds data.cache_pack samples or this many bytes: what a build killed in the middle loses
# at most, per rank (256 samples: about 13 s of an H100's SDXL encoding), and what it holds in host memory meanwhile.
PACK_BYTES = 256 * 2**20
PACK_GLOB = "pack-*.safetensors"
FORMAT = "ds_trainer-latents-1"
# What a family's `conditioning` adds to a sample beside its latents (not text: kept when the
# captions are encoded anew)
IMAGE_KEYS = ("condition_latents", "image_embeds")
OPEN_PACKS = 16  # packs kept open for reading (their headers parsed); the least recently read is closed beyond it


class LatentCache:
    """VAE latents and text embeddings of each sample, in pack files under `data.cache_dir/<key>`.

    For synthetic data the key hashes the model, resolution and data, so a change to any of them makes a new cache.
    For images of sources the key hashes the model alone and each image is named by its size's folder and a hash of
    its image, caption and crop: a later run, or a run on a source with images added, encodes only what it has not
    seen, and an image a source repeats is cached once.

    Each rank encodes a contiguous block of the images (a run of a source's files or shards) and writes it as packs:
    safetensors files of up to data.cache_pack samples, each tensor keyed `<name>/<key>`, named by a hash of the names
    they hold, written atomically. What a cache holds is read from the packs' headers, so any later layout reads
    any earlier one's packs, a build killed in the middle resumes after its last whole pack, and images added later
    go to new packs of their own. A cache is complete when its manifest exists. One `.pt` file per image (the layout
    before packs) is still read where a pack lacks the image.
    """

    def __init__(self, cfg: DictConfig, data: SyntheticImages | SourceImages, family: Family, kind: str) -> None:
        names = data.cache_names() if isinstance(data, SourceImages) else None
        self.keys = data.names()  # what orders the build's shares: a source's files and shards, in order
        model: Any = OmegaConf.to_container(cfg.model, resolve=True)
        # The encoders' dtype is part of what a latent is: a cache built on a GPU in bf16 and one built on a CPU
        # in float32 must not be mixed in a shared cache_dir. `kind` is the device torch confirmed, which the
        # encoders run on (the torch-free guess in resolved.platform says "cuda" where a CPU-only torch sees none).
        model["encoders_dtype"] = common.frozen_dtype_name(cfg, kind)
        model.pop("about", None)  # what the model is called and licensed as: not what a latent is
        # Which expert trains beside which: not what a latent is (expert=both's phases share one)
        for key in ("expert", "other_expert"):
            (model.get("video") or {}).pop(key, None)
        if family.spec.cache_key_without_family:  # SDXL's keys as before families
            model.pop("family", None)
            model.pop("flow", None)
        # A trained encoder's samples hold its token ids instead of its embeddings: another cache. (Absent when
        # both are frozen, so the caches built before text-encoder training keep their keys.)
        trained = text_encoders.trained(cfg)
        if trained:
            model["trained_text_encoders"] = list(trained)
        q = cfg.get("quantize")
        if q is not None and q.kind.value != "none" and q.text_encoders:  # embeddings of quantized encoders
            model["text_encoders_quantized"] = q.kind.value + (f" {float(q.threshold)}" if q.kind.value == "int8"
                                                               else "")
        identity = {"model": model, "resolution": [int(cfg.resolution.width), int(cfg.resolution.height)],
                    "data": data.identity()} if names is None else {"model": model}
        key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
        bucketed = getattr(data, "layout", None) is not None
        size = "buckets" if bucketed else f"{cfg.resolution.width}x{cfg.resolution.height}"
        self.dir = Path(cfg.data.cache_dir) / f"{cfg.model.name}-{size}-{key}"
        self.manifest = self.dir / "manifest.json"
        if names is not None:  # one manifest per set of samples: the folder is shared by many sets
            self.manifest = self.dir / f"manifest-{hashlib.sha256('|'.join(names).encode()).hexdigest()[:16]}.json"
        self.n = len(data)
        self.names = names if names is not None else [f"{i:08d}" for i in range(self.n)]
        self.family, self.pack_samples = family, int(cfg.data.cache_pack)
        # Each cached name and the first sample it holds (a repeated image's samples share one): fixed by the names.
        self._first: dict[str, int] = {}
        for i, name in enumerate(self.names):
            self._first.setdefault(name, i)
        self._index: dict[str, tuple[Path, tuple[str, ...]]] | None = None  # name -> its pack (or file), its keys
        self._open: OrderedDict[Path, Any] = OrderedDict()
        self._lock = threading.Lock()  # the prefetch thread reads while the training thread may
        self._empty: dict[str, torch.Tensor] | None = None  # the empty prompt's tensors, read once when first dropped

    @property
    def complete(self) -> bool:
        return self.manifest.exists()

    def build(self, data: SyntheticImages | SourceImages, frozen: Any, rank: int, world: int,
              device: torch.device, batch_size: int = 8) -> int:
        """Encode this rank's share of the samples not cached yet into packs; returns how many it encoded.
        Samples are encoded in batches of one shape (one bucket)."""
        family = self.family
        self.dir.mkdir(parents=True, exist_ok=True)
        # What a dropped caption trains with (data.caption_dropout; refused where a caption is encoded with its
        # reference image, whose empty prompt is each image's own)
        if not (self.dir / captions.EMPTY).exists() and not family.text_sees_reference:
            empty = family.text_inputs(frozen, [""], device)
            tmp = self.dir / f".{captions.EMPTY}.tmp{os.getpid()}"
            safetensors.torch.save_file({key: on_cpu(value[0], family.storage_dtype(key)).contiguous()
                                         for key, value in empty.items()}, str(tmp))
            rundir.follow_umask(tmp)  # a shared cache: teammates read it
            tmp.replace(self.dir / captions.EMPTY)
        # Each rank a contiguous block of the images in key order (a run of shards), then by bucket to batch them.
        index = self._scan()
        mine = order.share(sorted(self._first.values(), key=lambda i: self.keys[i]), rank, world)
        todo = sorted((i for i in mine if self.names[i] not in index), key=lambda i: (self._folder(i), i))
        pack = _Pack(self.dir, self.pack_samples)
        for _, grouped in itertools.groupby(todo, key=self._folder):
            group = list(grouped)
            for start in range(0, len(group), batch_size):
                part = group[start:start + batch_size]
                chunk = [data[i] for i in part]
                pixels = torch.stack([e.pixels for e in chunk])
                latents = family.encode_images(frozen, pixels)
                conditioning = family.conditioning(frozen, pixels)
                references = _references(family, frozen, chunk)
                text = family.text_inputs(frozen, [e.caption for e in chunk], device, _seen(family, chunk))
                for j, i in enumerate(part):
                    pack.add(self.names[i], {
                        "latents": latents[j].to("cpu", torch.float32).clone(),
                        **{key: on_cpu(value[j], family.storage_dtype(key)) for key, value in text.items()},
                        "time_ids": chunk[j].time_ids.clone(), **_mask(chunk[j], latents[j]),
                        **{key: on_cpu(value[j], family.storage_dtype(key))
                           for key, value in conditioning.items()},
                        **{key: value[j].to("cpu", torch.float32).clone()
                           for key, value in references.items()}})
                    if pack.full:
                        pack.write()
        pack.write()
        self._index = None  # the other ranks' packs: read again when next asked
        return len(todo)

    def files(self) -> int:
        """How many images the samples are (a repeated image's samples share one cached entry)."""
        return len(self._first)

    def packs(self) -> list[Path]:
        """The files that hold the samples."""
        index = self._scan()
        return sorted({index[name][0] for name in self._first if name in index})

    def disk_bytes(self) -> int:
        """What the files holding the samples take on disk (a pack shared with another set of samples whole)."""
        return sum(path.stat().st_size for path in self.packs())

    def finish(self) -> None:
        """Mark the cache complete (rank 0, after every rank built its share)."""
        self._index = None
        index = self._scan()
        missing = [name for name in self._first if name not in index]
        if missing:
            raise RuntimeError(f"latent cache {self.dir} lacks {len(missing)} samples after building")
        tmp = self.dir / f".manifest.tmp{os.getpid()}"
        tmp.write_text(json.dumps({"samples": self.n, "images": len(self._first), "packs": len(self.packs())}))
        tmp.replace(self.manifest)

    def load(self, indices: list[int], drop: list[bool] | None = None, text: bool = True) -> dict[str, torch.Tensor]:
        """The samples' tensors; those `drop` marks with the empty prompt's text tensors; without the text tensors
        where `text` is false (captions encoded now replace them)."""
        wanted = None if text else ("latents", "time_ids", "mask", *common.reference_keys(8), *IMAGE_KEYS)
        with self._lock:
            index = self._scan()
            items = [self._read(self.names[i], index, wanted) for i in indices]
        if text and drop and any(drop):
            if self._empty is None:
                self._empty = safetensors.torch.load_file(str(self.dir / captions.EMPTY))
            items = [{**item, **self._empty} if gone else item for item, gone in zip(items, drop, strict=True)]
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}

    def _folder(self, i: int) -> str:
        return self.names[i].rpartition("/")[0]

    def _scan(self) -> dict[str, tuple[Path, tuple[str, ...]]]:
        """Every cached name in the folder: the packs' headers, then the one-file-per-image layout's files."""
        if self._index is not None:
            return self._index
        index: dict[str, tuple[Path, tuple[str, ...]]] = {}
        shapes: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple of keys shared by the names that have it
        for path in sorted(self.dir.glob(PACK_GLOB)) if self.dir.is_dir() else []:
            try:
                held = _header(path)
            except (OSError, ValueError) as error:  # a pack cut short outside ds_trainer: its samples encode again
                log.warning("latent cache: %s is unreadable (%s); its samples are encoded again", path, error)
                continue
            for name, keys in held.items():
                index.setdefault(name, (path, shapes.setdefault(keys, keys)))
        if self.dir.is_dir() and next(self.dir.glob("**/*.pt"), None) is not None:  # the layout before packs
            for name in self._first:
                if name not in index and (self.dir / f"{name}.pt").exists():
                    index[name] = (self.dir / f"{name}.pt", ())
        self._index = index
        return index

    def _read(self, name: str, index: dict[str, tuple[Path, tuple[str, ...]]],
              wanted: tuple[str, ...] | None) -> dict[str, torch.Tensor]:
        path, keys = index[name]
        if path.suffix == ".pt":
            item = torch.load(path, map_location="cpu", weights_only=True)
            return item if wanted is None else {k: v for k, v in item.items() if k in wanted}
        reader = self._open.get(path)
        if reader is None:
            reader = self._open[path] = _Reader(path)
            if len(self._open) > OPEN_PACKS:
                self._open.popitem(last=False)[1].close()
        self._open.move_to_end(path)
        return {key: reader.tensor(f"{name}/{key}") for key in keys if wanted is None or key in wanted}


# safetensors' dtype names (its format's header)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _Reader:
    """An open pack: each tensor read by its offsets with one `pread` into memory of its own. Not memory-mapped, so
    what a run holds is the tensors it reads (a mapped pack's touched pages would count in the process's RSS)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.header, self.start = _raw_header(self.fd)

    def tensor(self, key: str) -> torch.Tensor:
        entry = self.header[key]
        begin, end = entry["data_offsets"]
        data = bytearray(os.pread(self.fd, end - begin, self.start + begin))
        if not data:
            return torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        return torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a cache dropped with its packs open (at most OPEN_PACKS of them)
        self.close()


class _Pack:
    """The samples a rank encoded and has not written yet."""

    def __init__(self, folder: Path, samples: int) -> None:
        self.folder, self.samples = folder, samples
        self.tensors, self.names, self.bytes = dict[str, torch.Tensor](), list[str](), 0

    def add(self, name: str, item: dict[str, torch.Tensor]) -> None:
        self.names.append(name)
        for key, value in item.items():
            self.tensors[f"{name}/{key}"] = value.contiguous()
            self.bytes += value.numel() * value.element_size()

    @property
    def full(self) -> bool:
        return len(self.names) >= self.samples or self.bytes >= PACK_BYTES

    def write(self) -> None:
        """The pack, named by the samples it holds, written atomically (a kill leaves it whole or absent)."""
        if not self.names:
            return
        digest = hashlib.sha256("|".join(self.names).encode()).hexdigest()[:16]
        path = self.folder / f"pack-{digest}.safetensors"
        tmp = self.folder / f".{path.name}.tmp{os.getpid()}"
        safetensors.torch.save_file(self.tensors, str(tmp), metadata={"format": FORMAT})
        rundir.follow_umask(tmp)  # a shared cache: teammates read it
        tmp.replace(path)
        self.tensors, self.names, self.bytes = {}, [], 0


def _raw_header(fd: int) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (8 bytes of length, then JSON) and where its data starts;
    ValueError for a file cut short, a length past its end, or a header that is no JSON object."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ValueError(f"cut short ({size} bytes, no header)")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
        raise ValueError(f"its header declares {length} bytes, the file has {size - 8} after it")
    header = json.loads(os.pread(fd, length, 8))  # ValueError (JSON's, or its UTF-8's) if damaged
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header, 8 + length


def _header(path: Path) -> dict[str, tuple[str, ...]]:
    """The names a pack holds and each one's keys, from its header; ValueError for a pack that is
    not one of ours or whose tensors do not fit in it (cut short: its samples are encoded again)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header, start = _raw_header(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} pack")
    held: dict[str, list[str]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if _bytes(entry) is None or start + entry["data_offsets"][1] > size:
            raise ValueError(f"its tensor {key} does not fit in the file (cut short?)")
        name, _, tensor = key.rpartition("/")
        held.setdefault(name, []).append(tensor)
    return {name: tuple(sorted(keys)) for name, keys in held.items()}


def _bytes(entry: Any) -> int | None:
    """A header entry's byte count when its dtype, shape and offsets agree, else None."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
        return None
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return None
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)):
        return None
    count = 1
    for d in shape:
        count *= d
    need = count * _DTYPES[entry["dtype"]].itemsize
    return need if 0 <= offsets[0] and offsets[1] - offsets[0] == need else None


def read(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every sample a cache folder's packs hold, by name (for tests and inspection: the whole folder in memory)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(folder.glob(PACK_GLOB)):
        tensors = safetensors.torch.load_file(str(path))
        for key, value in tensors.items():
            name, _, tensor = key.rpartition("/")
            out.setdefault(name, {})[tensor] = value
    return out


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
    pixels = torch.stack([e.pixels for e in examples])
    latents = family.encode_images(frozen, pixels)
    conditioning = family.conditioning(frozen, pixels)
    if texts is None:
        texts = ["" if gone else e.caption for e, gone in zip(examples, drop, strict=True)]
    text = family.text_inputs(frozen, texts, device, _seen(family, examples))
    # On the CPU in float32, as the cache holds them: the step draws its noise on the CPU, and on a GPU the
    # encoders' CUDA tensors would meet it there (diffusers' add_noise moves only the schedule's tensors).
    masks = [_mask(e, latents[j]) for j, e in enumerate(examples)]
    references = _references(family, frozen, examples)
    return {"latents": latents.to("cpu", torch.float32),
            **{key: on_cpu(value, family.storage_dtype(key)) for key, value in text.items()},
            "time_ids": torch.stack([e.time_ids for e in examples]),
            **{key: on_cpu(value, family.storage_dtype(key))
               for key, value in conditioning.items()},
            **({"mask": torch.stack([m["mask"] for m in masks])} if masks[0] else {}),
            **{key: value.to("cpu", torch.float32) for key, value in references.items()}}


def _references(family: Family, frozen: Any, examples: list[Any]) -> dict[str, torch.Tensor]:
    """The reference images' latents (model.reference_images), encoded as the images are, by key (a
    model of several references: one key each; a batch's examples have as many); {} without them."""
    if examples[0].control is None:
        return {}
    keys = common.reference_keys(1 + len(examples[0].more))
    stacked = [torch.stack([(e.control, *e.more)[n] for e in examples]) for n in range(len(keys))]
    return {key: family.encode_images(frozen, refs) for key, refs in zip(keys, stacked, strict=True)}


def _seen(family: Family, examples: list[Any]) -> torch.Tensor | None:
    """The reference images a family encodes with their captions (Qwen-Image-Edit), else None:
    (B, 3, H, W), or (B, R, 3, H, W) for R references each."""
    if not family.text_sees_reference:
        return None
    if not examples[0].more:
        return torch.stack([e.control for e in examples])
    return torch.stack([torch.stack([e.control, *e.more]) for e in examples])


def _mask(example: Any, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"mask": the image's mask at the latents' resolution (each latent pixel the mean of the pixels it covers)},
    or nothing without a mask (data.masked_loss=false)."""
    if example.mask is None:
        return {}
    mask = torch.nn.functional.interpolate(example.mask[None].float(), size=tuple(latents.shape[-2:]), mode="area")
    return {"mask": mask[0].clone()}


def on_cpu(value: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor as the cache holds it: on the CPU, float32 if floating (or the family's `dtype` for it: SD3's long
    text sequence in bf16), token ids as integers, not a view."""
    floating = dtype or torch.float32
    return value.to("cpu", floating if value.is_floating_point() else value.dtype).clone()
