"""An editing model's reference images (model.reference_images): why an image cannot train for its
references (none paired, more than model.references), a reference read and cut as its image is, and
the synthetic data's references (the picture with its shape in other colours)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image


def paired(usable: list[Any], sources: list[Any], most: int,
           skip: Callable[[Any, str], None]) -> list[Any]:
    """The items of `usable` paired with their references (1 to `most`), the others `skip`ped with
    the reason."""
    where = [s.control_path or s.control_column for s in sources]
    why = {i.key: unpaired(i, where[i.source], most) for i in usable}
    for item in usable:
        if why[item.key]:
            skip(item, str(why[item.key]))
    return [item for item in usable if not why[item.key]]


def unpaired(item: Any, where: str | None, most: int) -> str | None:
    """Why `item` (a sources.Item) cannot train for its references, or None: no reference paired
    with it (in `where`, its control folder or column), or more than `most`."""
    count = 1 + len(item.more_controls)
    if item.control is None:
        return f"no reference image (in {where})"
    if count > most:
        return f"{count} reference images (in {where}), model.references={most}"
    return None


def read(opener: Callable[[], Any], to_rgb: Callable[[Image.Image], Image.Image],
         fit: Callable[[Image.Image], Image.Image]) -> Image.Image:
    """A reference file (`opener` opens it) as an RGB picture cut as its image is (`fit`)."""
    with opener() as f, Image.open(f) as raw:
        return fit(to_rgb(raw))


def synthetic(picture: Image.Image, box: tuple[int, int, int, int], rng: random.Random,
              pool: dict[str, tuple[int, int, int]], count: int,
              pixels: Callable[[Image.Image], torch.Tensor]) -> list[torch.Tensor]:
    """The synthetic data's `count` references of a picture: the picture with the shape's `box` in
    colours drawn from `pool` by `rng` (one: as single-reference runs always drew it)."""
    names = sorted(pool)
    drawn = [rng.choice(names)] if count == 1 else rng.sample(names, count)
    out = []
    for colour in (pool[name] for name in drawn):
        reference = picture.copy()
        reference.paste(colour, box)
        out.append(pixels(reference))
    return out
