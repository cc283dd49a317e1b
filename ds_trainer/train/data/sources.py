"""Where images and captions come from (`data.sources`): a folder, a table of paths or image bytes (metadata.jsonl,
CSV, parquet), webdataset tar shards, a Hugging Face dataset saved to disk. Each source becomes a list of `Item`s:
a stable key, the caption, what identifies its bytes, and a way to read them on demand, so a dataset of any size is
read image by image (the latent cache build and a run without a cache), never held in memory.

Torch-free; pyarrow, pandas and datasets are imported only for a source of their kind.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import families, source_kinds
from ds_trainer.errors import DataError
from ds_trainer.train.data import text, video
from ds_trainer.train.data.captions import Policy

log = logging.getLogger("ds_trainer")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
MASK_SUFFIX = ".mask.png"  # `photo.jpg`'s mask is `photo.mask.png` beside it (data.masked_loss)
TABLE_SUFFIXES = source_kinds.TABLE_SUFFIXES
IMAGE_COLUMNS = ("image", "file_name", "path", "jpg", "png")
# A video model's table: the column of its clips, looked for before the images'
VIDEO_COLUMNS = ("video", "mp4", "clip")
CAPTION_COLUMNS = ("text", "caption", "prompt", "txt")


@dataclass(frozen=True)
class Item:
    """One image of a source: `key` is unique across the sources and stable across runs (the check record and the
    cache are keyed by it), `stat` identifies its bytes (a changed file gets checked and encoded again)."""

    source: int
    key: str
    caption: str
    stat: tuple[int, int]
    read: Callable[[], BinaryIO] = field(compare=False, repr=False)
    mask: Callable[[], BinaryIO] | None = field(default=None, compare=False, repr=False)  # a <name>.mask.png
    mask_stat: tuple[int, int] | None = None
    # Its reference (control) image, for a model that edits one (model.reference_images): paired by name
    control: Callable[[], BinaryIO] | None = field(default=None, compare=False, repr=False)
    control_stat: tuple[int, int] | None = None
    # Its further references, after `control`, for a model that takes several (model.references):
    # (open, stat) of <name>_1, <name>_2, ... or of a table cell's list
    more_controls: tuple[tuple[Callable[[], BinaryIO], tuple[int, int]], ...] = field(
        default=(), compare=False, repr=False)
    # Why this entry cannot train, found while listing it (a table's damaged row): skipped and
    # counted as an image that does not decode is
    damaged: str | None = None


@dataclass(frozen=True)
class Source:
    """One entry of `data.sources` (or data=folder's data.path, or validation.path), its kind resolved. `keyed`: its
    items' keys start with its name (the one-folder cases keep their images' paths as keys)."""

    index: int
    name: str
    path: str
    kind: str
    repeats: float
    captions: Policy
    caption_ext: str = "txt"
    image_column: str | None = None
    caption_column: str | None = None
    split: str = "train"
    key: str = ""  # the setting a message names: data.sources[i], data.path, validation.path
    keyed: bool = True
    regularization: bool = False
    loss_weight: float = 1.0
    resolution: int | None = None  # its buckets' side (None: the run's resolution)
    control_path: str | None = None  # folder: its reference images' folder (model.reference_images)
    control_column: str | None = None  # table: the column of its reference images' paths
    references: int = 1  # the most references an image may have (model.references)
    clips: bool = False  # a video model's source: its video files are read beside its images

    @property
    def caption_dropout(self) -> float:
        return self.captions.dropout

    @property
    def label(self) -> str:
        return f"{self.key} ({self.name})" if self.keyed else self.key


def of(cfg: DictConfig) -> list[Source]:
    """The run's sources: `data.sources`, or for `data=folder` the one folder of data.path."""
    clips, references = families.of(cfg).video, int(cfg.model.get("references") or 1)
    if cfg.data.source.value == "folder":
        return [Source(0, Path(str(cfg.data.path)).name or str(cfg.data.path), str(cfg.data.path), "folder", 1,
                       policy(cfg.data, {}), str(cfg.data.caption_ext), key="data.path", keyed=False,
                       control_path=cfg.data.get("control_path"), clips=clips,
                       references=references)]
    out, names = [], [_name_of(str(entry.path)) for entry in cfg.data.sources]
    for index, entry in enumerate(cfg.data.sources):
        spec: dict[str, Any] = OmegaConf.to_container(entry, resolve=True)  # type: ignore[assignment]
        path = str(spec["path"])
        # Named by the path's last part; two alike (a/images, b/images) by their place in the list too.
        name = spec.get("name") or (names[index] if names.count(names[index]) == 1 else f"{names[index]}-{index}")
        out.append(Source(index, name, path, kind_of(path, str(getattr(spec["kind"], "value", spec["kind"]))),
                          float(spec["repeats"]), policy(cfg.data, spec), str(spec.get("caption_ext") or "txt"),
                          spec.get("image_column"), spec.get("caption_column"), str(spec.get("split") or "train"),
                          f"data.sources[{index}]", regularization=bool(spec.get("regularization")),
                          loss_weight=float(spec.get("loss_weight", 1.0)), resolution=spec.get("resolution"),
                          control_path=spec.get("control_path"),
                          control_column=spec.get("control_column"), clips=clips,
                          references=references))
    return out


def policy(data: DictConfig, spec: dict[str, Any]) -> Policy:
    """A source's caption policy: its own caption_dropout, tag_shuffle, keep_tokens and tag_dropout where set, else
    data's."""
    def own(key: str) -> Any:
        value = spec.get(key)
        return data[key] if value is None else value

    return Policy(float(own("caption_dropout")), bool(own("tag_shuffle")), int(own("keep_tokens")),
                  float(own("tag_dropout")), str(data.tag_separator))


def for_validation(cfg: DictConfig) -> Source:
    """validation.path: a folder of other images the validation loss scores."""
    return Source(0, "validation", str(cfg.validation.path), "folder", 1, Policy(), str(cfg.data.caption_ext),
                  key="validation.path", keyed=False, clips=families.of(cfg).video)


def _name_of(path: str) -> str:
    """A folder by its name, a file or a pattern of shards by the folder they are in."""
    p = Path(path.rstrip("/"))
    named = p.parent if "{" in path or p.is_file() else p
    return named.name or path


def kind_of(path: str, kind: str) -> str:
    """`auto`: the kind its record recognises (config/source_kinds.py)."""
    return source_kinds.kind_of(path, kind)


def shards(path: str) -> list[str]:
    """A webdataset source's tar files: a path, or a brace pattern (`shards/{000..063}.tar`), expanded as webdataset
    expands it."""
    return source_kinds.shards(path)


def what_is_read(kind: str) -> str:
    """What a source of `kind` holds images as (for "no ..." when it holds none)."""
    return source_kinds.KINDS[kind].holds if kind in source_kinds.KINDS else kind


def file_reader(path: Path) -> Callable[[], BinaryIO]:
    return lambda: path.open("rb")


def folder(source: Source) -> list[Item]:
    """Images under a folder (recursively); captions from same-name .<caption_ext> files (`.caption` too), else a
    metadata.jsonl beside them (file_name, text or caption)."""
    root = Path(source.path)
    if not root.is_dir():
        raise DataError(f"{source.label}: {root} is not a folder; point it at the folder of images")
    seen: Counter[str] = Counter()
    metadata = _folder_metadata(source, root, seen)
    prefix = f"{source.name}/" if source.keyed else ""
    controls = Path(source.control_path).resolve() if source.control_path else None
    out = []
    for path in sorted(root.rglob("*")):
        media = IMAGE_EXTENSIONS + (video.VIDEO_EXTENSIONS if source.clips else ())
        is_mask = path.name.lower().endswith(MASK_SUFFIX)
        if path.suffix.lower() in media and path.is_file() and not is_mask:
            if controls is not None and path.resolve().is_relative_to(controls):
                continue  # a reference image inside the images' folder is no training image
            rel = str(path.relative_to(root))
            st = path.stat()
            mask = path.with_name(path.stem + MASK_SUFFIX)
            found = mask.is_file()
            control = control_files(controls, Path(rel), source.references) if controls else []
            caption = _folder_caption(path, rel, source.caption_ext, metadata, seen)
            out.append(Item(source.index, prefix + rel, caption,
                            (st.st_size, st.st_mtime_ns), file_reader(path), file_reader(mask) if found else None,
                            (mask.stat().st_size, mask.stat().st_mtime_ns) if found else None,
                            *control_reader(control[0] if control else None),
                            more_controls=more_readers(control[1:])))
    text.report(f"{source.label}={source.path}", seen)
    return out


def _control_file(controls: Path, rel: Path) -> Path | None:
    """The reference image of the image at `rel`: the same relative path and name under `controls`, any image
    extension (photo.jpg's may be photo.png)."""
    for suffix in (rel.suffix, *IMAGE_EXTENSIONS):
        candidate = controls / rel.with_suffix(suffix)
        if candidate.is_file():
            return candidate
    return None


def control_files(controls: Path, rel: Path, references: int = 1) -> list[Path]:
    """The reference images of the image at `rel`: its own name under `controls`, or for a model
    that takes several the numbered ones, `<name>_0`, `<name>_1`, ... (or `<name>_0000`, ...: the
    layout of musubi-tuner's control folders), in order, as many as there are."""
    own = _control_file(controls, rel)
    if own is not None or references == 1:
        return [own] if own is not None else []
    out: list[Path] = []
    for index in range(100):
        names = (rel.with_name(f"{rel.stem}_{n}{rel.suffix}") for n in (str(index), f"{index:04d}"))
        found = next(filter(None, map(partial(_control_file, controls), names)), None)
        if found is None:
            break
        out.append(found)
    return out


def more_readers(paths: list[Path]) -> tuple[tuple[Callable[[], BinaryIO], tuple[int, int]], ...]:
    """An Item's `more_controls` for reference image files after its first."""
    readers = (control_reader(path) for path in paths)
    return tuple((read, stat) for read, stat in readers if read is not None and stat is not None)


def control_reader(path: Path | None) -> tuple[Callable[[], BinaryIO] | None, tuple[int, int] | None]:
    """An Item's (control, control_stat) for a reference image file, or none."""
    if path is None or not path.is_file():
        return None, None
    st = path.stat()
    return file_reader(path), (st.st_size, st.st_mtime_ns)


def _folder_metadata(source: Source, root: Path, seen: Counter[str]) -> dict[str, str]:
    """A folder's metadata.jsonl captions by file name; a line that is not a JSON object is left
    out, named."""
    path = root / "metadata.jsonl"
    captions: dict[str, str] = {}
    if path.is_file():
        rows, damaged = jsonl_rows(path, seen)
        for _, row in rows:
            captions[str(row.get("file_name", ""))] = str(row.get("text", row.get("caption", "")))
        if damaged:
            log.warning("%s: %s: left out %d line(s) that are not a JSON object (%s): their images "
                        "train without "
                        "those captions unless a caption file names "
                        "them", source.label, path, len(damaged),
                        "; ".join(f"line {n}: {why}" for n, why in damaged[:5]))
    return captions


def _folder_caption(path: Path, rel: str, ext: str, metadata: dict[str, str],
                    seen: Counter[str]) -> str:
    for suffix in (f".{ext}", ".caption"):
        caption = path.with_suffix(suffix)
        if caption.is_file():
            return text.read(caption, seen).strip()
    return metadata.get(rel, metadata.get(path.name, ""))


Numbered = list[tuple[int, dict[str, Any]]]  # (line number, row)


def jsonl_rows(path: Path, seen: Counter[str]) -> tuple[Numbered, list[tuple[int, str]]]:
    """A JSON-lines file's rows as (line number, object), and its damaged lines as (line number,
    why)."""
    rows, damaged = [], []
    for n, line in enumerate(text.read(path, seen).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            damaged.append((n, f"not JSON: {exc.msg}, column {exc.colno}"))
            continue
        if not isinstance(row, dict):
            damaged.append((n, f"a JSON {type(row).__name__}, not an object"))
            continue
        rows.append((n, row))
    return rows, damaged


def column(source: Source, columns: list[str], asked: str | None, candidates: tuple[str, ...], what: str,
            key: str) -> str | None:
    """The column holding `what`: the one asked for (a DataError when absent), else the first usual name found."""
    if asked is not None:
        if asked not in columns:
            raise DataError(f"{source.label}: {source.path} has no column {asked!r} ({key}={asked}); its columns: "
                            f"{', '.join(columns)}; set {key} to the column holding the {what}")
        return asked
    return next((c for c in candidates if c in columns), None)


def image_column(source: Source, columns: list[str]) -> str:
    """The column of a table's images (a video model's: of its videos or images)."""
    key = f"{source.key}.image_column"
    candidates = (*VIDEO_COLUMNS, *IMAGE_COLUMNS) if source.clips else IMAGE_COLUMNS
    found = column(source, columns, source.image_column, candidates, "images", key)
    if found is None:
        raise DataError(f"{source.label}: {source.path} has none of the columns "
                        f"{', '.join(candidates)} for the images; its columns: "
                        f"{', '.join(columns)}; set {key}")
    return found


def beside(table: Path, value: object) -> Path:
    """A path a table names: absolute, or relative to the table's folder."""
    named = Path(str(value))
    return named if named.is_absolute() else table.parent / named
