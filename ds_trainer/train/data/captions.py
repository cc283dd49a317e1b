"""What a sample's caption trains as: dropped whole (so that classifier-free guidance keeps working), its tags
shuffled and dropped (`data.tag_shuffle`, `keep_tokens`, `tag_dropout`), and a text encoder's part of the
conditioning dropped (`data.text_encoder_dropout`).

Every draw is a fixed function of the seed and the sample's position in the run's sample sequence (which fixes the
epoch and the image), so a resume, under any world size or micro batch, trains the captions an uninterrupted run
would have. A dropped caption is the empty prompt's encoding, cached once beside the latents (`EMPTY`), so the text
cache still serves every other sample; captions whose tags vary are encoded when their batch is read.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

EMPTY = "empty-prompt.safetensors"


@dataclass(frozen=True)
class Policy:
    """A source's caption policy (its own settings, else data's)."""

    dropout: float = 0.0
    shuffle: bool = False
    keep_tokens: int = 0
    tag_dropout: float = 0.0
    separator: str = ","

    @property
    def varies(self) -> bool:
        """Whether a caption's text changes from sample to sample (the cached embeddings of it cannot serve)."""
        return self.shuffle or self.tag_dropout > 0.0


def dropped(seed: int, position: int, probability: float, what: str = "") -> bool:
    """Whether the sample at `position` trains with an empty caption (or, `what` naming a text encoder, without that
    encoder's part), with `probability`."""
    if probability <= 0.0:
        return False
    name = f"caption-dropout:{seed}:{position}" if not what else f"encoder-dropout:{what}:{seed}:{position}"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < probability


def text(caption: str, policy: Policy, seed: int, position: int) -> str:
    """The caption the sample at `position` trains with under `policy` (before caption dropout): its tags split at the
    separator, the first `keep_tokens` in place, the others shuffled and each dropped with `tag_dropout`, joined by
    the separator and a space."""
    if not policy.varies:
        return caption
    tags = [tag.strip() for tag in caption.split(policy.separator) if tag.strip()]
    kept, rest = tags[:policy.keep_tokens], tags[policy.keep_tokens:]
    rng = random.Random(f"tags:{seed}:{position}")
    if policy.shuffle:
        rng.shuffle(rest)
    if policy.tag_dropout > 0.0:
        rest = [tag for tag in rest if rng.random() >= policy.tag_dropout]
    return f"{policy.separator} ".join(kept + rest)
