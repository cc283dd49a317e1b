"""The micro-batches of one rank, read from the cache (or encoded now) in the run's sample order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.config import source_repeats
from ds_trainer.train.data import captions
from ds_trainer.train.data.cache import LatentCache, encode_batch, on_cpu
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
        # The data's coordinates: a context group's ranks read one stream (parallel.context)
        self.rank, self.world = run.mesh.data_rank, run.mesh.data_world
        self.micro, self.seed = int(cfg.train.micro_batch_size), int(cfg.train.seed)
        self.plan = data.plan if isinstance(data, SourceImages) else None
        self.policy = policy_of(cfg, data)
        # Tags shuffled or dropped: each batch's captions are encoded when it is read (the cached text cannot serve).
        self.varies = source_repeats.tags_vary(cfg)
        self.encoder_dropout = {str(k): float(v) for k, v in cfg.data.text_encoder_dropout.items() if float(v) > 0}
        self.parts = run.family.text_parts(run.frozen) if self.encoder_dropout else {}
        if accelerator.is_main_process:
            self._say(data)
        self.unmasked = float(cfg.data.unmasked_weight)
        self.weighed = isinstance(data, SourceImages) and any(
            s.regularization or s.loss_weight != 1.0 for s in data.sources)
        step, self.offset = start or (0, 0)
        self.accumulation = int(cfg.train.gradient_accumulation_steps)
        self.first = step * self.accumulation
        # The cache read of micro-batch b+1 runs in a thread while b trains (files, unpickling: no GPU work).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ds_trainer-prefetch") if cache is not None else None
        self._next: tuple[int, Future[tuple[dict[str, torch.Tensor], list[int], list[bool]]]] | None = None

    def _say(self, data: SyntheticImages | SourceImages) -> None:
        for source in data.sources if isinstance(data, SourceImages) and self.varies else []:
            policy = source.captions
            if policy.varies:
                log.info("%s: tags %s at %r, the first %d kept in place, each other dropped with %s", source.label,
                         "shuffled" if policy.shuffle else "in order", policy.separator, policy.keep_tokens,
                         policy.tag_dropout)
        if self.varies:
            log.info("captions whose tags vary are encoded batch by batch (%s); the latents %s",
                     "the frozen text encoders stay on the device", "stay cached" if self.cache else "too")
        if self.encoder_dropout:
            log.info("text encoder dropout: %s (that encoder's part of the conditioning is zeros for the sample, as "
                     "a pipeline without it feeds the model)", ", ".join(f"{k} {v}" for k, v in
                                                                       self.encoder_dropout.items()))

    def position(self, b: int) -> int:
        """The first sample position of this rank's part of micro-batch `b`."""
        return self.offset + ((b - self.first) * self.world + self.rank) * self.micro

    def __call__(self, b: int) -> dict[str, torch.Tensor]:
        if self._pool is None:
            batch, indices, drop = self._load(b)
        else:
            ahead = self._next
            if ahead is not None and ahead[0] == b:
                batch, indices, drop = ahead[1].result()
            else:  # not the batch read ahead (the first call): one reader at a time
                if ahead is not None:
                    wait([ahead[1]])
                batch, indices, drop = self._load(b)
            self._next = (b + 1, self._pool.submit(self._load, b + 1))
        position = self.position(b)
        if self.varies and self.cache is not None:  # on this thread: the text encoders may be on the GPU
            text = self.family.text_inputs(self.frozen, self._texts(position, indices, drop), self.device)
            batch.update({key: on_cpu(value, self.family.storage_dtype(key)) for key, value in text.items()})
        if self.encoder_dropout:
            self._drop_encoders(batch, position)
        return batch

    def seen(self, step: int) -> list[dict[str, Any]]:
        """Per source, what the run has trained on by the end of `step` (every rank, resumes included)."""
        total = self.offset + (step * self.accumulation - self.first) * self.world * self.micro
        return seen(self.data, self.seed, total, self.policy, self.encoder_dropout)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _samples(self, position: int) -> tuple[list[int], list[bool]]:
        """The dataset indices of the samples from `position` on, and which of them train with an empty caption."""
        if self.plan is not None:  # one bucket per global batch: every rank gets the same shape
            indices = self.plan.samples(position, self.micro)
        else:
            indices = sample_indices(position, self.micro, len(self.data), self.seed)
        return indices, [captions.dropped(self.seed, position + j, self.policy(index).dropout)
                         for j, index in enumerate(indices)]

    def _texts(self, position: int, indices: list[int], drop: list[bool]) -> list[str]:
        """The captions the samples train with: empty where dropped, their tags shuffled and dropped by policy."""
        data = self.data
        assert isinstance(data, SourceImages)
        return ["" if gone else captions.text(data.caption(index), self.policy(index), self.seed, position + j)
                for j, (index, gone) in enumerate(zip(indices, drop, strict=True))]

    def _drop_encoders(self, batch: dict[str, torch.Tensor], position: int) -> None:
        """data.text_encoder_dropout: zeros in place of an encoder's part of a sample's conditioning, as a pipeline
        without that encoder feeds the model."""
        for j in range(self.micro):
            for name, probability in self.encoder_dropout.items():
                if captions.dropped(self.seed, position + j, probability, name):
                    for key, where in self.parts[name]:
                        batch[key][j][where] = 0

    def _load(self, b: int) -> tuple[dict[str, torch.Tensor], list[int], list[bool]]:
        """Micro-batch `b`, its samples' dataset indices and which of them train with an empty caption."""
        position = self.position(b)
        indices, drop = self._samples(position)
        if self.cache is not None:  # with captions that vary, the text is encoded on the training thread
            batch = self.cache.load(indices, drop, text=not self.varies)
        else:
            texts = self._texts(position, indices, drop) if self.varies else None
            batch = encode_batch(self.data, self.frozen, indices, self.device, self.family, drop, texts)
        batch["position"] = torch.arange(position, position + self.micro)
        if self.weighed:  # data.sources: each sample's loss weight, and which are regularisation images
            sources = [self.data.sources[self.data.source_of(i)] for i in indices]  # type: ignore[union-attr]
            batch["loss_weight"] = torch.tensor([s.loss_weight for s in sources])
            batch["regularization"] = torch.tensor([s.regularization for s in sources])
        if "mask" in batch:  # data.masked_loss: the loss's weight, unmasked_weight outside the mask
            batch["weight_map"] = self.unmasked + (1.0 - self.unmasked) * batch["mask"]
        return batch, indices, drop


def policy_of(cfg: DictConfig, data: SyntheticImages | SourceImages) -> Callable[[int], captions.Policy]:
    """A sample's caption policy: its source's (data.sources[i]), else data's (caption_dropout alone for synthetic
    images, whose captions are not tags)."""
    if not isinstance(data, SourceImages):
        default = captions.Policy(float(cfg.data.caption_dropout))
        return lambda _index: default
    by_source = [source.captions for source in data.sources]
    return lambda index: by_source[data.source_of(index)]


def describe(data: SyntheticImages | SourceImages) -> list[dict[str, Any]]:
    """Per source: its name, kind, path, images found, files skipped (by reason), repeats and caption policy."""
    if not isinstance(data, SourceImages):
        return [{"name": "synthetic", "kind": "synthetic", "images": len(data), "skipped": {}, "repeats": 1,
                 "samples_seen": 0, "captions_dropped": 0}]
    return [{"name": source.name, "kind": source.kind, "path": source.path,
             "images": data.found[source.index],
             "skipped": {why: n for (index, why), n in sorted(data.skipped_by_source.items()) if index == source.index},
             "skipped_files": {why: names[:50] for (index, why), names
                               in sorted(data.skipped_names.items()) if index == source.index},
             "repeats": source.repeats, "caption_dropout": source.caption_dropout,
             **({"tags": {"shuffle": source.captions.shuffle, "keep_tokens": source.captions.keep_tokens,
                          "dropout": source.captions.tag_dropout}} if source.captions.varies else {}),
             **({"resolution": source.resolution} if source.resolution is not None else {}),
             **({"regularization": True} if source.regularization else {}),
             **({"loss_weight": source.loss_weight} if source.loss_weight != 1.0 else {}), "samples_seen": 0,
             "captions_dropped": 0} for source in data.sources]


def seen(data: SyntheticImages | SourceImages, seed: int, total: int, policy: Callable[[int], captions.Policy],
         encoder_dropout: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Per source, the first `total` samples of the run's sample sequence: its images, skipped files, repeats, samples
    seen, captions dropped, and each text encoder's part dropped (summary.json's `sources`)."""
    plan = data.plan if isinstance(data, SourceImages) else None
    sources = describe(data)
    for entry in sources if encoder_dropout else []:
        entry["encoders_dropped"] = dict.fromkeys(encoder_dropout or {}, 0)
    for start in range(0, total, 4096):
        count = min(4096, total - start)
        indices = plan.samples(start, count) if plan is not None else sample_indices(start, count, len(data), seed)
        for j, index in enumerate(indices):
            entry = sources[data.source_of(index) if isinstance(data, SourceImages) else 0]
            entry["samples_seen"] += 1
            entry["captions_dropped"] += captions.dropped(seed, start + j, policy(index).dropout)
            for name, probability in (encoder_dropout or {}).items():
                entry["encoders_dropped"][name] += captions.dropped(seed, start + j, probability, name)
    return sources
