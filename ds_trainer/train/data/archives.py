"""Sources read from archives: webdataset tar shards (their headers read to the end, each image
read from its offset when it is used; a shard cut short or not a tar is refused naming it) and a
Hugging Face dataset saved with `save_to_disk` (memory-mapped, row by row). Torch-free; datasets
and webdataset are imported for their kinds only.
"""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ds_trainer.errors import DataError
from ds_trainer.train.data import sources, text, video
from ds_trainer.train.data.sources import Item


def webdataset(source: sources.Source) -> list[sources.Item]:
    """Tar shards as webdataset writes them: the members of a sample share a key (the name up to
    its first dot), the image is the member with an image extension, the caption the one with
    `.txt` (or `.<caption_ext>`). Only the headers are read here; an image is read from its offset
    when it is used. A shard that is not a whole tar file is refused, named."""
    out: list[sources.Item] = []
    seen: Counter[str] = Counter()
    for shard in sources.shards(source.path):
        path = Path(shard)
        if not path.is_file():
            raise DataError(f"{source.label}: shard {shard} does not exist; check the path or the "
                            "brace pattern (shards/{000..009}.tar)")
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


def _shard(source: sources.Source, path: Path, seen: Counter[str]) -> list[sources.Item]:
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
            media = ("jpg", "jpeg", "png", "webp", *(CLIP_MEMBERS if source.clips else ()))
            image = next((members[e] for e in media if e in members), None)
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


# A video model's clips: the member extensions read as its media beside the images'
CLIP_MEMBERS = tuple(suffix.lstrip(".") for suffix in video.VIDEO_EXTENSIONS)


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


def hf(source: sources.Source) -> list[sources.Item]:
    """A Hugging Face dataset saved with `save_to_disk` (a DatasetDict: its `split`), memory-mapped:
    its image column (an Image feature, or paths) read row by row."""
    import datasets

    try:
        loaded = datasets.load_from_disk(source.path)
    except Exception as exc:  # noqa: BLE001 - pyarrow and datasets raise many kinds
        said = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DataError(f"{source.label}: {source.path} cannot be read as a dataset saved with "
                        f"save_to_disk ({said}); if it is one, a file of it is damaged: save it "
                        "again") from None
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise DataError(f"{source.label}: {source.path} has no split {source.split!r} (its "
                            f"splits: {', '.join(loaded)}); set {source.key}.split")
        loaded = loaded[source.split]
    columns = list(loaded.column_names)
    image_col = sources.image_column(source, columns)
    caption_col = sources.column(source, columns, source.caption_column, sources.CAPTION_COLUMNS,
                                 "captions", f"{source.key}.caption_column")
    if isinstance(loaded.features[image_col], datasets.Image):
        loaded = loaded.cast_column(image_col, datasets.Image(decode=False))
    elif isinstance(loaded.features[image_col], datasets.Video):  # a video model's clips
        loaded = loaded.cast_column(image_col, datasets.Video(decode=False))
    captions = loaded[caption_col] if caption_col is not None else [""] * len(loaded)
    root = Path(source.path)
    mtime = max((p.stat().st_mtime_ns for p in root.rglob("*.arrow")), default=0)
    return [Item(source.index, f"{source.name}/{n:08d}", str(captions[n] or "").strip(), (n, mtime),
                 _row_reader(loaded, image_col, n, root)) for n in range(len(loaded))]


def _row_reader(table: Any, column: str, row: int, root: Path) -> Callable[[], BinaryIO]:
    def read() -> BinaryIO:
        value = table[row][column]
        if isinstance(value, dict) and value.get("bytes"):
            return io.BytesIO(value["bytes"])
        rel = value.get("path") if isinstance(value, dict) else value
        path = Path(str(rel))
        return (path if path.is_absolute() else root / path).open("rb")

    return read
