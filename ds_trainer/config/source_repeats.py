"""How a run's sources are sampled, decided from the configuration alone (torch-free): how fractional repeats make
an epoch, and whether captions vary from sample to sample. The checks, the planner and the run read these."""

from __future__ import annotations

import math
from fractions import Fraction

from omegaconf import DictConfig

MAX_PASSES = 20  # an epoch of more passes makes the sample list (and the cache's names) that many times longer


def fraction(repeats: float) -> Fraction:
    """A source's repeats as the fraction the epoch is counted in: 0.5 is 1/2, 0.333 is 1/3 (denominator <= 20)."""
    return Fraction(repeats).limit_denominator(MAX_PASSES)


def epoch_passes(repeats: list[float]) -> int:
    """The passes over the sources that see each a whole number of times: the least common multiple of the repeats'
    denominators."""
    return math.lcm(*(fraction(r).denominator for r in repeats))


def tags_vary(cfg: DictConfig) -> bool:
    """Whether a source's captions change from sample to sample (tags shuffled or dropped): they are encoded batch by
    batch, so the frozen text encoders stay on the device (the planner counts them). A source's own tag_shuffle and
    tag_dropout where set, else data's, as the run resolves each source's policy."""
    data = cfg.data

    def varies(shuffle: object, dropout: object) -> bool:
        return bool(data.tag_shuffle if shuffle is None else shuffle) or float(
            data.tag_dropout if dropout is None else dropout) > 0  # type: ignore[arg-type]

    if data.source.value == "sources":
        return any(varies(s.get("tag_shuffle"), s.get("tag_dropout")) for s in data.sources)
    return varies(None, None)
