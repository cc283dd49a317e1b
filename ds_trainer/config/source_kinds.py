"""The kinds of data source (`data.sources[i].kind`), torch-free: one record each, what both sides
of a run read of a kind, the config checks before it and the readers inside it
(train/data/sources.py, one reader a kind).

A record says how `kind=auto` recognises it from a path, which paths must exist before a run (every
shard of a brace pattern), how an editing model's reference images pair with its images (by a folder
of the same names, by a column of a table, or not at all) and what it holds images as, for the
message when it holds none. Adding a kind: a record here (in the order `auto` tries them), its value
in config/schema.py's `SourceKind`, a reader in train/data/readers.py's `READERS`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TABLE_SUFFIXES = (".jsonl", ".csv", ".parquet")
SAVED_DATASET_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")


def _one(path: str) -> list[str]:
    return [path]


def shards(path: str) -> list[str]:
    """A brace pattern's paths (`shards/{000..063}.tar`), as webdataset expands them; another path
    as it is."""
    if "{" not in path:
        return [path]
    import braceexpand

    return [str(p) for p in braceexpand.braceexpand(path)]


@dataclass(frozen=True)
class SourceKind:
    name: str
    holds: str  # what it holds images as ("no <holds>" when it holds none)
    detect: Callable[[Path, str], bool]  # kind=auto: whether the path (and its text) is one
    paths: Callable[[str], list[str]] = _one  # what must exist before a run
    # How an editing model's references pair: "control_path", "control_column", or "" (not at all)
    references: str = ""


KINDS: dict[str, SourceKind] = {
    k.name: k
    for k in (
        SourceKind(
            "hf",
            "rows",
            lambda p, _: p.is_dir() and any((p / f).exists() for f in SAVED_DATASET_FILES),
        ),
        SourceKind(
            "folder", "jpg/png/webp files", lambda p, _: p.is_dir(), references="control_path"
        ),
        SourceKind(
            "table",
            "rows with an image",
            lambda p, _: p.suffix.lower() in TABLE_SUFFIXES,
            references="control_column",
        ),
        SourceKind(
            "webdataset",
            "tar members with an image extension",
            lambda _, text: ".tar" in text,
            paths=shards,
        ),
    )
}


def kind_of(path: str, kind: str) -> str:
    """`auto`: the first kind whose record recognises the path (a saved dataset's folder is hf,
    another folder folder, a .jsonl/.csv/.parquet file table, a .tar file or a brace pattern of them
    webdataset), else folder."""
    if kind != "auto":
        return kind
    return next((k.name for k in KINDS.values() if k.detect(Path(path), path)), "folder")


def paths_of(path: str, kind: str) -> list[str]:
    """The paths a source of `kind` (auto: recognised from the path) reads, each of which must
    exist."""
    return KINDS[kind_of(path, kind)].paths(path)
