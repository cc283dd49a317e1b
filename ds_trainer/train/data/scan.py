"""Each image's check: decoded once, the result kept in a record under data.cache_dir, so a later
start (a resumed or requeued job) decodes only what is new or changed; the ranks share the work.
Before Accelerate's set-up a run may check headers only (`decode=False`: the format, the size, an
empty or unreadable file), which is not recorded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from PIL import Image, UnidentifiedImageError

from ds_trainer.config import families, inputs
from ds_trainer.errors import DataError
from ds_trainer.train.data import order, readers, sources, video

HEADER_BYTES = 1 << 20  # what a header-only check reads of a file: every format's header fits


def problem(item: sources.Item, limit: int, decode: bool = True,
            parts: tuple[str, ...] = (), clips: bool = False) -> str | dict[str, Any] | None:
    """Why an image cannot be trained on (decoding it whole; with `decode=False` its header only),
    or None; an entry damaged in its listing (a table's row) says so itself; one above `limit`
    pixels is too large. `parts`: the files it trains with that are checked too, its `mask`
    (data.masked_loss) and its `control` (a reference image). `clips` (a video model's run): a
    video file (by its name, or a table's bytes no image decoder knows) is described instead, its
    frames, rate and size (train/data/video.py), or says why it cannot train."""
    if item.damaged is not None:
        return item.damaged
    if clips and video.is_video_name(item.key):
        return video.check(item.read, limit, decode)
    why = _decodes(item.read, limit, decode)
    if clips and why == NOT_AN_IMAGE:
        clip = video.check(item.read, limit, decode)
        return clip if isinstance(clip, dict) else why
    for part in parts:
        reader = getattr(item, part)
        if why is None and reader is not None and (found := _decodes(reader, limit, decode)):
            why = f"its {PARTS[part]}: {found}"
    if why is None and "control" in parts:  # a model's further references, decoded as its first
        return _further(item, limit, decode)
    return why


def _further(item: sources.Item, limit: int, decode: bool) -> str | None:
    """Why one of an item's further references (after its first) does not decode, or None."""
    for n, (reader, _) in enumerate(item.more_controls, start=2):
        if found := _decodes(reader, limit, decode):
            return f"its reference image {n}: {found}"
    return None


NOT_AN_IMAGE = "not an image (unrecognized format)"
PARTS = {"mask": f"mask ({sources.MASK_SUFFIX})", "control": "reference image"}


def _decodes(read: Any, limit: int, decode: bool) -> str | None:
    """Why the image file `read` opens does not decode, or None."""
    try:
        with read() as f:
            data = f.read() if decode else f.read(HEADER_BYTES)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not data:
        return "empty file"
    # The size is read from the header, then judged here (Pillow's guard put back after).
    guard, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        with warnings.catch_warnings(), Image.open(io.BytesIO(data)) as image:
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            width, height = image.size
            if width * height > limit:
                return f"too large ({width}x{height}, above data.max_image_pixels={limit})"
            if decode:
                image.load()
    except UnidentifiedImageError:
        return NOT_AN_IMAGE
    except Exception:  # noqa: BLE001 - PIL raises many types for damaged files
        return "truncated or corrupt image"
    finally:
        Image.MAX_IMAGE_PIXELS = guard
    return None


# {key: [size, mtime_ns, (the parts' too,) problem, or None, or a clip's description (a dict)]}
Checks = dict[str, list[Any]]


def listed_and_checked(cfg: DictConfig, found: list[sources.Source], accelerator: Any,
                       decode: bool = True) -> tuple[dict[str, sources.Item], Checks, int]:
    """The sources' items by key, each one's check (`check_items`) and how many were decoded now."""
    items = {item.key: item for source in found for item in readers.items(source)}
    limit = int(cfg.data.max_image_pixels)
    # Pillow's own guard (an error at twice it) raised for a limit above its default, never lowered:
    # the scan skips what is above a lower limit, and our own files (samples) open as before
    Image.MAX_IMAGE_PIXELS = max(limit, inputs.PILLOW_PIXELS // 2)
    wanted = {"mask": bool(cfg.data.masked_loss),
              "control": bool(cfg.model.get("reference_images"))}
    parts = tuple(part for part, used in wanted.items() if used)
    clips = families.of(cfg).video
    checks, checked_now = check_items(items, record(cfg, found), accelerator, limit, decode, parts,
                                      clips)
    return items, checks, checked_now


def _stat(item: sources.Item, parts: tuple[str, ...]) -> list[int]:
    """What identifies an item's bytes: its image's size and time, and its checked parts'."""
    out = list(item.stat)
    for part in parts:
        stat = getattr(item, f"{part}_stat")
        out += list(stat) if stat is not None else []
    if "control" in parts:
        out += [n for _, stat in item.more_controls for n in stat]
    return out


def record(cfg: DictConfig, found: list[sources.Source]) -> Path:
    """Where the checks of these sources are kept (data=folder's record is named as before sources
    existed)."""
    text = "|".join(f"{s.kind}:{Path(s.path).resolve()}" for s in found)
    if len(found) == 1 and not found[0].keyed:
        text = str(Path(found[0].path).resolve())
    if int(cfg.data.max_image_pixels) != inputs.PILLOW_PIXELS:  # another limit: all checked again
        text += f"|pixels:{int(cfg.data.max_image_pixels)}"
    if families.of(cfg).video:  # videos described, where an image model's run finds none
        text += "|clips"
    return Path(cfg.data.cache_dir) / f"scan-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def check_items(found: dict[str, sources.Item], kept: Path, accelerator: Any, limit: int,
                decode: bool = True, parts: tuple[str, ...] = (),
                clips: bool = False) -> tuple[Checks, int]:
    """{key: [size, mtime_ns, (`parts`' sizes and times,) problem or None]} of every item, and how
    many were decoded now.

    Decoding every image is the only sure check, and slow on a large source, so it is done once: the
    results are kept in `kept` (`record`'s file) and only new or changed items are decoded on a
    later start (a resumed or requeued job). The ranks split that work. Rank 0's listing and record
    are every rank's, so every rank ends with the same items.
    """
    from ds_trainer.train.backends import accelerator as accel

    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    listing: tuple[dict[str, list[int]], dict[str, list[Any]]] = ({}, {})
    if rank == 0:
        try:
            known = json.loads(kept.read_text())
        except (OSError, ValueError):
            known = {}
        listing = ({key: _stat(item, parts) for key, item in found.items()}, known)
    stats, known = accel.from_main(accelerator, listing) if world > 1 else listing
    if unseen := [key for key in stats if key not in found]:
        raise DataError(f"rank {rank} does not see {len(unseen)} image(s) rank 0 lists (e.g. "
                        f"{unseen[0]}): every node must see the same data; put it on a shared file "
                        "system or the same path on each node")
    checks = {key: known[key] for key, stat in stats.items() if known.get(key, [None])[:-1] == stat}
    todo = [key for key in stats if key not in checks]
    mine = {key: [*stats[key], problem(found[key], limit, decode, parts, clips)]
            for key in order.share(todo, rank, world)}
    if world > 1:
        from accelerate.utils import gather_object

        for part in gather_object([mine]):
            checks.update(part)
    else:
        checks.update(mine)
    if rank == 0 and todo and decode:  # a header's check is not the whole check: not kept
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f".{kept.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(checks))
        tmp.replace(kept)
    return checks, len(todo)
