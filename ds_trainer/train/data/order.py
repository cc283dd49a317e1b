"""The order the run reads samples in: a fixed function of the seed and the sample's position, so a resumed run
sees exactly what an uninterrupted one would, under any world size or micro batch."""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


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


def share(items: list[Any], rank: int, world: int) -> list[Any]:
    """Rank `rank`'s part of `items` (in key order) for work done once per item (the images' check, the latent
    cache's build): a contiguous block, so that each rank reads its own run of a source's files and shards rather
    than a stride through all of them."""
    return items[rank * len(items) // world:(rank + 1) * len(items) // world]


_perm_cache: dict[tuple[int, int, int], list[int]] = {}


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _perm_cache:
        _perm_cache.clear()
        _perm_cache[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 10_007 + epoch)).tolist()
    return _perm_cache[key]
