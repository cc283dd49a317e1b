"""The micro-batches of one rank, read from the cache (or encoded now) in the run's sample order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.train.data import captions
from ds_trainer.train.data.cache import LatentCache, encode_batch
from ds_trainer.train.data.images import SourceImages, SyntheticImages
from ds_trainer.train.data.order import sample_indices

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

log = logging.getLogger(__name__)


class Loader:
    """The micro-batches of one rank: `loader(b)` is this rank's part of global micro-batch `b`, from the
    latent cache, or encoded now when there is none (`data.cache=false`).

    `start` (step, samples) is where a resumed run continues: micro-batch `step * accumulation` begins at
    sample `samples` of the sample sequence, so a resume under another world size or micro batch goes on
    with the samples an uninterrupted run would have seen. Each batch carries its samples' positions
    (`position`), which seed their noise.
    """

    def __init__(self, run: Run, data: SyntheticImages | SourceImages, cache: LatentCache | None,
                 start: tuple[int, int] | None = None) -> None:
        cfg, accelerator = run.cfg, run.accelerator
        self.data, self.cache, self.frozen, self.device = data, cache, run.frozen, accelerator.device
        self.family = run.family
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.micro, self.seed = int(cfg.train.micro_batch_size), int(cfg.train.seed)
        self.plan = data.plan if isinstance(data, SourceImages) else None
        self.dropout = dropout_of(cfg, data)
        self.unmasked = float(cfg.data.unmasked_weight)
        self.weighed = isinstance(data, SourceImages) and any(
            s.regularization or s.loss_weight != 1.0 for s in data.sources)
        step, self.offset = start or (0, 0)
        self.accumulation = int(cfg.train.gradient_accumulation_steps)
        self.first = step * self.accumulation
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

    def seen(self, step: int) -> list[dict[str, Any]]:
        """Per source, what the run has trained on by the end of `step` (every rank, resumes included)."""
        total = self.offset + (step * self.accumulation - self.first) * self.world * self.micro
        return seen(self.data, self.seed, total, self.dropout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _load(self, b: int) -> dict[str, torch.Tensor]:
        position = self.position(b)
        if self.plan is not None:  # one bucket per global batch: every rank gets the same shape
            indices = self.plan.samples(position, self.micro)
        else:
            indices = sample_indices(position, self.micro, len(self.data), self.seed)
        drop = [captions.dropped(self.seed, position + j, self.dropout(index)) for j, index in enumerate(indices)]
        batch = self.cache.load(indices, drop) if self.cache is not None else \
            encode_batch(self.data, self.frozen, indices, self.device, self.family, drop)
        batch["position"] = torch.arange(position, position + self.micro)
        if self.weighed:  # data.sources: each sample's loss weight, and which are regularisation images
            sources = [self.data.sources[self.data.source_of(i)] for i in indices]  # type: ignore[union-attr]
            batch["loss_weight"] = torch.tensor([s.loss_weight for s in sources])
            batch["regularization"] = torch.tensor([s.regularization for s in sources])
        if "mask" in batch:  # data.masked_loss: the loss's weight, unmasked_weight outside the mask
            batch["weight_map"] = self.unmasked + (1.0 - self.unmasked) * batch["mask"]
        return batch


def dropout_of(cfg: DictConfig, data: SyntheticImages | SourceImages) -> Callable[[int], float]:
    """A sample's caption dropout: its source's (data.sources[i].caption_dropout), else data.caption_dropout."""
    default = float(cfg.data.caption_dropout)
    if not isinstance(data, SourceImages):
        return lambda _index: default
    by_source = [source.caption_dropout for source in data.sources]
    return lambda index: by_source[data.source_of(index)]


def describe(data: SyntheticImages | SourceImages) -> list[dict[str, Any]]:
    """Per source: its name, kind, path, images found, files skipped (by reason), repeats and caption dropout."""
    if not isinstance(data, SourceImages):
        return [{"name": "synthetic", "kind": "synthetic", "images": len(data), "skipped": {}, "repeats": 1,
                 "samples_seen": 0, "captions_dropped": 0}]
    return [{"name": source.name, "kind": source.kind, "path": source.path,
             "images": data.found[source.index],
             "skipped": {why: n for (index, why), n in sorted(data.skipped_by_source.items()) if index == source.index},
             "repeats": source.repeats, "caption_dropout": source.caption_dropout,
             **({"regularization": True} if source.regularization else {}),
             **({"loss_weight": source.loss_weight} if source.loss_weight != 1.0 else {}), "samples_seen": 0,
             "captions_dropped": 0} for source in data.sources]


def seen(data: SyntheticImages | SourceImages, seed: int, total: int,
         dropout: Callable[[int], float]) -> list[dict[str, Any]]:
    """Per source, the first `total` samples of the run's sample sequence: its images, skipped files, repeats, samples
    seen and captions dropped (summary.json's `sources`)."""
    plan = data.plan if isinstance(data, SourceImages) else None
    sources = describe(data)
    for start in range(0, total, 4096):
        count = min(4096, total - start)
        indices = plan.samples(start, count) if plan is not None else sample_indices(start, count, len(data), seed)
        for j, index in enumerate(indices):
            entry = sources[data.source_of(index) if isinstance(data, SourceImages) else 0]
            entry["samples_seen"] += 1
            entry["captions_dropped"] += captions.dropped(seed, start + j, dropout(index))
    return sources
