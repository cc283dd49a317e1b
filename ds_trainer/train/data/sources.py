"""Where images and captions come from (`data.sources`): a folder, a table of paths or image bytes (metadata.jsonl,
CSV, parquet), webdataset tar shards, a Hugging Face dataset saved to disk. Each source becomes a list of `Item`s:
a stable key, the caption, what identifies its bytes, and a way to read them on demand, so a dataset of any size is
read image by image (the latent cache build and a run without a cache), never held in memory.

Torch-free; pyarrow, pandas and datasets are imported only for a source of their kind.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import tarfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import source_kinds
from ds_trainer.errors import DataError
from ds_trainer.train.data import text
from ds_trainer.train.data.captions import Policy

log = logging.getLogger("ds_trainer")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
MASK_SUFFIX = ".mask.png"  # `photo.jpg`'s mask is `photo.mask.png` beside it (data.masked_loss)
TABLE_SUFFIXES = source_kinds.TABLE_SUFFIXES
IMAGE_COLUMNS = ("image", "file_name", "path", "jpg", "png")
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

    @property
    def caption_dropout(self) -> float:
        return self.captions.dropout

    @property
    def label(self) -> str:
        return f"{self.key} ({self.name})" if self.keyed else self.key


def of(cfg: DictConfig) -> list[Source]:
    """The run's sources: `data.sources`, or for `data=folder` the one folder of data.path."""
    if cfg.data.source.value == "folder":
        return [Source(0, Path(str(cfg.data.path)).name or str(cfg.data.path), str(cfg.data.path), "folder", 1,
                       policy(cfg.data, {}), str(cfg.data.caption_ext), key="data.path", keyed=False,
                       control_path=cfg.data.get("control_path"))]
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
                          control_path=spec.get("control_path"), control_column=spec.get("control_column")))
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
                  key="validation.path", keyed=False)


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


def items(source: Source) -> list[Item]:
    """The items of a source, sorted by key (none: the caller says so, naming the source); a missing source or a
    column that is not there is a DataError naming the source, what was found and the fix."""
    return sorted(READERS[source.kind](source), key=lambda item: item.key)


def what_is_read(kind: str) -> str:
    """What a source of `kind` holds images as (for "no ..." when it holds none)."""
    return source_kinds.KINDS[kind].holds if kind in source_kinds.KINDS else kind


def _file_reader(path: Path) -> Callable[[], BinaryIO]:
    return lambda: path.open("rb")


def _folder(source: Source) -> list[Item]:
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
        if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file() and not path.name.lower().endswith(MASK_SUFFIX):
            if controls is not None and path.resolve().is_relative_to(controls):
                continue  # a reference image inside the images' folder is no training image
            rel = str(path.relative_to(root))
            st = path.stat()
            mask = path.with_name(path.stem + MASK_SUFFIX)
            found = mask.is_file()
            control = _control_file(controls, Path(rel)) if controls is not None else None
            caption = _folder_caption(path, rel, source.caption_ext, metadata, seen)
            out.append(Item(source.index, prefix + rel, caption,
                            (st.st_size, st.st_mtime_ns), _file_reader(path), _file_reader(mask) if found else None,
                            (mask.stat().st_size, mask.stat().st_mtime_ns) if found else None,
                            *_control(control)))
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


def _control(path: Path | None) -> tuple[Callable[[], BinaryIO] | None, tuple[int, int] | None]:
    """An Item's (control, control_stat) for a reference image file, or none."""
    if path is None or not path.is_file():
        return None, None
    st = path.stat()
    return _file_reader(path), (st.st_size, st.st_mtime_ns)


def _folder_metadata(source: Source, root: Path, seen: Counter[str]) -> dict[str, str]:
    """A folder's metadata.jsonl captions by file name; a line that is not a JSON object is left
    out, named."""
    path = root / "metadata.jsonl"
    captions: dict[str, str] = {}
    if path.is_file():
        rows, damaged = _jsonl(path, seen)
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


def _jsonl(path: Path, seen: Counter[str]) -> tuple[Numbered, list[tuple[int, str]]]:
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


def _column(source: Source, columns: list[str], asked: str | None, candidates: tuple[str, ...], what: str,
            key: str) -> str | None:
    """The column holding `what`: the one asked for (a DataError when absent), else the first usual name found."""
    if asked is not None:
        if asked not in columns:
            raise DataError(f"{source.label}: {source.path} has no column {asked!r} ({key}={asked}); its columns: "
                            f"{', '.join(columns)}; set {key} to the column holding the {what}")
        return asked
    return next((c for c in candidates if c in columns), None)


def _image_column(source: Source, columns: list[str]) -> str:
    key = f"{source.key}.image_column"
    found = _column(source, columns, source.image_column, IMAGE_COLUMNS, "images", key)
    if found is None:
        raise DataError(f"{source.label}: {source.path} has none of the columns {', '.join(IMAGE_COLUMNS)} for the "
                        f"images; its columns: {', '.join(columns)}; set {key}")
    return found


def _table(source: Source) -> list[Item]:
    """A metadata.jsonl, CSV or parquet file: one row per image, the image a path (relative to the file's folder) or
    its bytes (a parquet column of {bytes, path}, as Hugging Face writes images), the caption a column. A parquet
    file's image bytes are read a batch of rows at a time to list them, then each image again from its row group
    when it is used: the file is never held in memory whole."""
    path = Path(source.path)
    if not path.is_file():
        raise DataError(f"{source.label}: {path} is not a file; point it at the .jsonl, .csv or .parquet file")
    seen: Counter[str] = Counter()
    damaged: list[tuple[int, str]] = []
    if path.suffix.lower() == ".parquet":
        rows, columns = _parquet_rows(path)
    else:
        rows, columns, damaged = _rows(path, seen)
        text.report(f"{source.label}={source.path}", seen)
    if not columns:
        lines = "; ".join(f"line {n}: {why}" for n, why in damaged[:3]) or "no lines"
        raise DataError(f"{source.label}: {path} has no rows with columns (empty, or every line "
                        f"damaged: {lines}); point it at a table of images and captions")
    image_col = _image_column(source, columns)
    caption_col = _column(source, columns, source.caption_column, CAPTION_COLUMNS, "captions",
                          f"{source.key}.caption_column")
    control_col = _column(source, columns, source.control_column, (), "reference images",
                          f"{source.key}.control_column") if source.control_column else None
    st = path.stat()
    out = [Item(source.index, f"{source.name}/line{n:08d}", "", (0, st.st_mtime_ns),
                _file_reader(path),
                damaged=f"damaged row in {path.name} ({why})") for n, why in damaged]
    for n, row in rows(image_col, caption_col, [control_col] if control_col else []):
        reference = row.get(control_col) if control_col else None
        control = _control(_beside(path, reference)) if reference else (None, None)
        value = row.get(image_col)
        caption = "" if caption_col is None or row.get(caption_col) is None else str(row[caption_col]).strip()
        if isinstance(value, dict) and "read" in value:  # a parquet image's bytes, read when it is used
            out.append(Item(source.index, f"{source.name}/{n:08d}", caption, (value["size"], st.st_mtime_ns),
                            value["read"], control=control[0], control_stat=control[1]))
            continue
        rel = value.get("path") if isinstance(value, dict) else value
        if not rel:  # skipped and counted like a damaged row
            out.append(Item(source.index, f"{source.name}/line{n:08d}", "", (0, st.st_mtime_ns),
                            _file_reader(path), damaged=f"a row of {path.name} without an image "
                            f"(its {image_col} is empty)"))
            continue
        image = _beside(path, rel)
        size = image.stat().st_size if image.exists() else 0
        out.append(Item(source.index, f"{source.name}/{rel}", caption, (size, st.st_mtime_ns), _file_reader(image),
                        control=control[0], control_stat=control[1]))
    return out


def _beside(table: Path, value: object) -> Path:
    """A path a table names: absolute, or relative to the table's folder."""
    named = Path(str(value))
    return named if named.is_absolute() else table.parent / named


# (image column, caption column, other columns) -> (row number, row) pairs
Rows = Callable[[str, str | None, list[str]], Any]


def _rows(path: Path, seen: Counter[str]) -> tuple[Rows, list[str], list[tuple[int, str]]]:
    """A JSON-lines or CSV table's rows, its columns and its damaged rows (line number, why)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        numbered, damaged = _jsonl(path, seen)
        rows = [row for _, row in numbered]
        return lambda *_: enumerate(rows), sorted({k for row in rows for k in row}), damaged
    if suffix == ".csv":
        try:
            reader = csv.DictReader(io.StringIO(text.read(path, seen), newline=""))
            table = list(reader)
        except csv.Error as exc:
            raise DataError(f"data.sources: {path} is not a CSV table ({exc}, near line "
                            f"{reader.line_num}); "
                            "write it with a header row and one row per image") from None
        return lambda *_: enumerate(table), list(reader.fieldnames or []), []
    raise DataError(f"data.sources: {path} is not a .jsonl, .csv or .parquet file")


def _parquet_rows(path: Path) -> tuple[Rows, list[str]]:
    """A parquet file's rows, read a batch at a time, the image column's bytes replaced by their size and a reader of
    their row group (one group kept at a time: the cache build and the check read in row order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        columns = list(pq.ParquetFile(path).schema_arrow.names)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"data.sources: {path} is not a readable parquet file "
                        f"({str(exc).splitlines()[0][:200]}): "
                        "damaged or cut short; write it again (pyarrow's write_table, or datasets' "
                        "to_parquet)",
                        ) from None
    group = _RowGroups(path)

    def rows(image_col: str, caption_col: str | None, others: list[str]) -> Any:
        wanted = [image_col, *([caption_col] if caption_col else []), *others]
        n = 0
        for index in range(group.file.num_row_groups):
            try:
                table = group.file.read_row_group(index, columns=wanted)
            except (pa.ArrowException, OSError) as exc:
                why = str(exc).splitlines()[0][:200]
                raise DataError(f"data.sources: {path}: its row group {index} cannot be read "
                                f"({why}): damaged; write it again") from None
            for offset, row in enumerate(table.to_pylist()):
                value = row.get(image_col)
                if isinstance(value, dict) and value.get("bytes"):
                    row[image_col] = {"size": len(value["bytes"]), "read": group.reader(index, offset, image_col)}
                yield n, row
                n += 1
            del table

    return rows, columns


class _RowGroups:
    """A parquet file's row groups read on demand, the last one kept (a lock: the prefetch thread reads too)."""

    def __init__(self, path: Path) -> None:
        import threading

        import pyarrow.parquet as pq

        self.file = pq.ParquetFile(path, pre_buffer=False)  # pre-buffering keeps a read group's pages alive
        self._lock = threading.Lock()
        self._kept: tuple[tuple[int, str], Any] | None = None

    def reader(self, index: int, offset: int, column: str) -> Callable[[], BinaryIO]:
        def read() -> BinaryIO:
            with self._lock:
                if self._kept is None or self._kept[0] != (index, column):
                    self._kept = ((index, column), self.file.read_row_group(index, columns=[column]).column(0))
                value = self._kept[1][offset].as_py()
            return io.BytesIO(value["bytes"])

        return read


def _webdataset(source: Source) -> list[Item]:
    """Tar shards as webdataset writes them: the members of a sample share a key (the name up to its first dot), the
    image is the member with an image extension, the caption the one with `.txt` (or `.<caption_ext>`). Only the
    headers are read here; an image is read from its offset when it is used. A shard that is not a
    whole tar file is refused, named."""
    out: list[Item] = []
    seen: Counter[str] = Counter()
    for shard in shards(source.path):
        path = Path(shard)
        if not path.is_file():
            raise DataError(f"{source.label}: shard {shard} does not exist; check the path or the brace pattern "
                            f"(shards/{{000..009}}.tar)")
        try:
            out += _shard(source, path, seen)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise DataError(f"{source.label}: shard {shard} is not a whole tar file "
                            f"({exc or type(exc).__name__}): "
                            "cut short or not a tar at all; fetch or write it again, or leave it "
                            "out of the "
                            "pattern") from None
    text.report(f"{source.label}={source.path}", seen)
    return out


def _shard(source: Source, path: Path, seen: Counter[str]) -> list[Item]:
    """A tar shard's samples: its headers read to the end (a shard cut short raises), captions
    decoded."""
    from webdataset.tariterators import base_plus_ext

    out = []
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if member.isfile():
                prefix, suffix = base_plus_ext(member.name)
                if prefix is not None:
                    samples.setdefault(prefix, {})[suffix.lower()] = member
        ends = [m.offset_data + m.size for ms in samples.values() for m in ms.values()]
        end = max(ends, default=0)
        if end > path.stat().st_size:
            raise EOFError(f"its last member ends at byte {end}, the file has "
                           f"{path.stat().st_size}")
        _check_end(tar)
        st = path.stat()
        for key, members in samples.items():
            image = next((members[e] for e in ("jpg", "jpeg", "png", "webp") if e in members), None)
            if image is None:
                continue
            named = members.get(source.caption_ext) or members.get("txt") or members.get("caption")
            caption = ""
            if named is not None:
                data = tar.extractfile(named).read()  # type: ignore[union-attr]
                caption, encoding = text.decode(data)
                seen[encoding] += 1
            out.append(Item(source.index, f"{source.name}/{path.name}/{key}", caption.strip(),
                            (image.size, st.st_mtime_ns),
                            _member_reader(path, image.offset_data, image.size)))
    return out


def _check_end(tar: tarfile.TarFile) -> None:
    """A tar ends in two zero blocks after its last member: without them it was cut at a member's
    boundary, which the tar reader takes for its end (the members after it lost unseen)."""
    f = tar.fileobj
    assert f is not None
    f.seek(tar.offset)
    tail = f.read(1024)
    if len(tail) < 1024 or tail.strip(b"\0"):
        raise EOFError(f"no end-of-archive blocks after its last member (at byte {tar.offset}): "
                       "cut short at a member's boundary")


def _member_reader(path: Path, offset: int, size: int) -> Callable[[], BinaryIO]:
    def read() -> BinaryIO:
        with path.open("rb") as f:
            f.seek(offset)
            return io.BytesIO(f.read(size))

    return read


def _hf(source: Source) -> list[Item]:
    """A Hugging Face dataset saved with `save_to_disk` (a DatasetDict: its `split`), memory-mapped: its image column
    (an Image feature, or paths) read row by row."""
    import datasets

    try:
        loaded = datasets.load_from_disk(source.path)
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"{source.label}: {source.path} is not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DataError(f"{source.label}: {source.path} has no split {source.split!r} (its splits: "
                            f"{', '.join(loaded)}); set {source.key}.split")
        loaded = loaded[source.split]
    columns = list(loaded.column_names)
    image_col = _image_column(source, columns)
    caption_col = _column(source, columns, source.caption_column, CAPTION_COLUMNS, "captions",
                          f"{source.key}.caption_column")
    if isinstance(loaded.features[image_col], datasets.Image):
        loaded = loaded.cast_column(image_col, datasets.Image(decode=False))
    captions = loaded[caption_col] if caption_col is not None else [""] * len(loaded)
    mtime = max(p.stat().st_mtime_ns for p in Path(source.path).rglob("*.arrow")) if Path(source.path).is_dir() else 0
    return [Item(source.index, f"{source.name}/{n:08d}", str(captions[n] or "").strip(), (n, mtime),
                 _row_reader(loaded, image_col, n, Path(source.path))) for n in range(len(loaded))]


def _row_reader(table: Any, column: str, row: int, root: Path) -> Callable[[], BinaryIO]:
    def read() -> BinaryIO:
        value = table[row][column]
        if isinstance(value, dict) and value.get("bytes"):
            return io.BytesIO(value["bytes"])
        rel = value.get("path") if isinstance(value, dict) else value
        path = Path(str(rel))
        return (path if path.is_absolute() else root / path).open("rb")

    return read


# Each kind's reader (config/source_kinds.py has the rest of what a kind is; a test holds the two to the same kinds).
READERS: dict[str, Callable[[Source], list[Item]]] = {"folder": _folder, "table": _table, "webdataset": _webdataset,
                                                      "hf": _hf}
