"""A table source (`data.sources`): a metadata.jsonl, CSV or parquet file of image paths or bytes
and captions, read row by row; a damaged row is an Item that says so (skipped and counted), a table
that cannot be read is refused naming it. Torch-free; pyarrow and pandas are imported for their
kinds only."""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ds_trainer.errors import DataError
from ds_trainer.train.data import sources, text
from ds_trainer.train.data.sources import Item


def read(source: sources.Source) -> list[sources.Item]:
    """A metadata.jsonl, CSV or parquet file: one row per image, the image a path (relative to the
    file's folder) or its bytes (a parquet column of {bytes, path}, as Hugging Face writes images),
    the caption a column. A parquet file's image bytes are read a batch of rows at a time to list
    them, then each image again from its row group when it is used: the file is never held in memory
    whole."""
    path = Path(source.path)
    if not path.is_file():
        raise DataError(f"{source.label}: {path} is not a file; point it at the .jsonl, .csv or "
                        ".parquet file")
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
    image_col = sources.image_column(source, columns)
    caption_col = sources.column(source, columns, source.caption_column, sources.CAPTION_COLUMNS,
                                 "captions", f"{source.key}.caption_column")
    control_col = None
    if source.control_column:
        control_col = sources.column(source, columns, source.control_column, (), "reference images",
                                     f"{source.key}.control_column")
    st = path.stat()
    listed = (0, st.st_mtime_ns)
    out = [Item(source.index, f"{source.name}/line{n:08d}", "", listed, sources.file_reader(path),
                damaged=f"damaged row in {path.name} ({why})") for n, why in damaged]
    for n, row in rows(image_col, caption_col, [control_col] if control_col else []):
        reference = row.get(control_col) if control_col else None
        control: tuple[Any, Any] = (None, None)
        # One path, or a list of them for a model that takes several references
        listed_refs = [str(r) for r in reference] if isinstance(reference, list | tuple) else []
        more = sources.more_readers([sources.beside(path, r) for r in listed_refs[1:]])
        if listed_refs or reference:
            first = listed_refs[0] if listed_refs else reference
            control = sources.control_reader(sources.beside(path, first))
        value = row.get(image_col)
        caption = "" if row.get(caption_col) is None else str(row[caption_col]).strip()
        if isinstance(value, dict) and "read" in value:  # a parquet image's bytes, read when used
            out.append(Item(source.index, f"{source.name}/{n:08d}", caption,
                            (value["size"], st.st_mtime_ns), value["read"], control=control[0],
                            control_stat=control[1], more_controls=more))
            continue
        rel = value.get("path") if isinstance(value, dict) else value
        if not rel:  # skipped and counted like a damaged row
            out.append(Item(source.index, f"{source.name}/line{n:08d}", "", listed,
                            sources.file_reader(path), damaged=f"a row of {path.name} without an "
                            f"image (its {image_col} is empty)"))
            continue
        image = sources.beside(path, rel)
        size = image.stat().st_size if image.exists() else 0
        out.append(Item(source.index, f"{source.name}/{rel}", caption, (size, st.st_mtime_ns),
                        sources.file_reader(image), control=control[0], control_stat=control[1],
                        more_controls=more))
    return out




# (image column, caption column, other columns) -> (row number, row) pairs
Rows = Callable[[str, str | None, list[str]], Any]


def _rows(path: Path, seen: Counter[str]) -> tuple[Rows, list[str], list[tuple[int, str]]]:
    """A JSON-lines or CSV table's rows, its columns and its damaged rows (line number, why)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        numbered, damaged = sources.jsonl_rows(path, seen)
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
    """A parquet file's rows, read a batch at a time, the image column's bytes replaced by their
    size and a reader of their row group (one group kept at a time: the cache build and the check
    read in row order)."""
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
                table = group.file.read_row_group(index, columns=wanted, use_threads=False)
            except (pa.ArrowException, OSError) as exc:
                why = str(exc).splitlines()[0][:200]
                raise DataError(f"data.sources: {path}: its row group {index} cannot be read "
                                f"({why}): damaged; write it again") from None
            for offset, row in enumerate(table.to_pylist()):
                value = row.get(image_col)
                if isinstance(value, dict) and value.get("bytes"):
                    read = group.reader(index, offset, image_col)
                    row[image_col] = {"size": len(value["bytes"]), "read": read}
                yield n, row
                n += 1
            del table

    return rows, columns


class _RowGroups:
    """A parquet file's row groups read on demand, the last one kept (a lock: the prefetch thread
    reads too)."""

    def __init__(self, path: Path) -> None:
        import threading

        import pyarrow.parquet as pq

        # pre_buffer=False: pre-buffering keeps a read group's pages alive; each group is read with
        # use_threads=False: one column at a time, its pages decoded and freed in the calling thread
        self.file = pq.ParquetFile(path, pre_buffer=False)
        self._lock = threading.Lock()
        self._kept: tuple[tuple[int, str], Any] | None = None

    def reader(self, index: int, offset: int, column: str) -> Callable[[], BinaryIO]:
        def read() -> BinaryIO:
            with self._lock:
                if self._kept is None or self._kept[0] != (index, column):
                    group = self.file.read_row_group(index, columns=[column],
                                                       use_threads=False).column(0)
                    self._kept = ((index, column), group)
                value = self._kept[1][offset].as_py()
            return io.BytesIO(value["bytes"])

        return read
