"""Caption dropout: which samples train with an empty caption (so that classifier-free guidance keeps working).

A draw is a fixed function of the seed and the sample's position in the run's sample sequence (which fixes the
epoch and the image), so a resume, under any world size or micro batch, drops the captions an uninterrupted run
would have. A dropped caption is the empty prompt's encoding, cached once beside the latents (`EMPTY`), so the text
cache still serves every other sample.
"""

from __future__ import annotations

import hashlib

EMPTY = "empty-prompt.safetensors"


def dropped(seed: int, position: int, probability: float) -> bool:
    """Whether the sample at `position` trains with an empty caption, with `probability`."""
    if probability <= 0.0:
        return False
    digest = hashlib.blake2b(f"caption-dropout:{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < probability
