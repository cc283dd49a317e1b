"""Each kind of data source's reader, and the items of a source: `config/source_kinds.py` has the
rest of what a kind is (a test holds the two to the same kinds)."""

from __future__ import annotations

from collections.abc import Callable

from ds_trainer.train.data import archives, sources, tables
from ds_trainer.train.data.sources import Item, Source

READERS: dict[str, Callable[[Source], list[Item]]] = {
    "folder": sources.folder, "table": tables.read, "webdataset": archives.webdataset,
    "hf": archives.hf}


def items(source: Source) -> list[Item]:
    """The items of a source, sorted by key (none: the caller says so, naming the source); a missing
    source or a column that is not there is a DataError naming the source, what was found and the
    fix."""
    return sorted(READERS[source.kind](source), key=lambda item: item.key)
