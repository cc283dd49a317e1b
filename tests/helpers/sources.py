"""Data as people keep it, built for real at a tiny size: a folder with caption files, a metadata.jsonl, a CSV, a
parquet file of image bytes (as Hugging Face writes images), webdataset tar shards, a dataset saved with
`save_to_disk`. Every image is a distinct small PNG, its caption names its source and number."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

KINDS = ("folder", "jsonl", "csv", "parquet", "webdataset", "hf")


def png(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A distinct small image (colour from `seed`), as PNG bytes."""
    from PIL import Image

    image = Image.new("RGB", size, ((seed * 53) % 256, (seed * 97) % 256, (seed * 31) % 256))
    image.paste(((seed * 13) % 256, 255 - (seed * 7) % 256, 90), (4, 4, 4 + seed % 20, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def masked(root: Path) -> None:
    """Masks for a folder's first two images: img000's alpha channel keeps its left half, img001.mask.png its top
    half (the others have none: the whole image counts)."""
    from PIL import Image

    with Image.open(root / "img000.png") as image:
        rgba = image.convert("RGBA")
    alpha = Image.new("L", rgba.size, 0)
    alpha.paste(255, (0, 0, rgba.width // 2, rgba.height))
    rgba.putalpha(alpha)
    rgba.save(root / "img000.png")
    with Image.open(root / "img001.png") as image:
        mask = Image.new("L", image.size, 0)
    mask.paste(255, (0, 0, mask.width, mask.height // 2))
    mask.save(root / "img001.mask.png")


def caption(kind: str, n: int) -> str:
    """A sentence, or for the folder tags as kohya's users write them (the trigger word first)."""
    return f"{kind}, picture number {n}, small, bright, square" if kind == "folder" else f"a {kind} picture number {n}"


def make(kind: str, root: Path, n: int = 4, first: int = 0) -> str:
    """A source of `kind` with `n` images under `root`; returns the path to give `data.sources[i].path`."""
    root.mkdir(parents=True, exist_ok=True)
    seeds = [first + i for i in range(n)]
    if kind == "folder":
        for i, seed in enumerate(seeds):
            (root / f"img{i:03d}.png").write_bytes(png(seed))
            (root / f"img{i:03d}.txt").write_text(caption(kind, i))
        masked(root)
        return str(root)
    if kind in ("jsonl", "csv"):
        (root / "images").mkdir(exist_ok=True)
        rows = []
        for i, seed in enumerate(seeds):
            (root / "images" / f"{i:03d}.png").write_bytes(png(seed))
            rows.append({"file_name": f"images/{i:03d}.png", "text": caption(kind, i)})
        table = root / f"metadata.{kind}"
        if kind == "jsonl":
            table.write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            with table.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=["file_name", "text"])
                writer.writeheader()
                writer.writerows(rows)
        return str(table)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        images = [{"bytes": png(seed), "path": f"{i:03d}.png"} for i, seed in enumerate(seeds)]
        pq.write_table(pa.table({"image": images, "text": [caption(kind, i) for i in range(n)]}),
                       root / "train.parquet", row_group_size=2)  # several row groups, as large files have
        return str(root / "train.parquet")
    if kind == "webdataset":
        import webdataset as wds

        shards = 2
        for s in range(shards):
            with wds.TarWriter(str(root / f"shard-{s:03d}.tar")) as sink:
                for i in range(s, n, shards):
                    sink.write({"__key__": f"sample{i:04d}", "png": png(seeds[i]), "txt": caption(kind, i)})
        return str(root / f"shard-{{000..{shards - 1:03d}}}.tar")
    if kind == "hf":
        import datasets

        columns = {"image": [{"bytes": png(seed), "path": None} for seed in seeds],
                   "text": [caption(kind, i) for i in range(n)]}
        table = datasets.Dataset.from_dict(
            columns, features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")}))
        datasets.DatasetDict({"train": table}).save_to_disk(str(root))
        return str(root)
    raise ValueError(kind)


def override(entries: list[dict[str, object]]) -> str:
    """`data.sources=[...]` for Hydra's command line."""
    def value(v: object) -> str:
        return f"'{v}'" if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    return "data.sources=[" + ",".join("{" + ",".join(f"{k}:{value(v)}" for k, v in e.items()) + "}"
                                       for e in entries) + "]"
