"""The micro-batches of one rank, read from the cache (or encoded now) in the run's sample order."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from ds_trainer.train.data.cache import LatentCache, encode_batch
from ds_trainer.train.data.images import FolderImages, SyntheticImages
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

    def __init__(self, run: Run, data: SyntheticImages | FolderImages, cache: LatentCache | None,
                 start: tuple[int, int] | None = None) -> None:
        cfg, accelerator = run.cfg, run.accelerator
        self.data, self.cache, self.frozen, self.device = data, cache, run.frozen, accelerator.device
        self.family = run.family
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
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
