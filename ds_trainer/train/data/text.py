"""Text files as people write them (captions, tables, metadata): UTF-8 with or without a byte-order
mark, UTF-16 with one (Windows tools write it), else the Windows code page most Latin-1 text is in
(cp1252), else Latin-1, which decodes any byte. Which one a file was read in is returned, so a
source can say it once. Torch-free."""

from __future__ import annotations

import codecs
import logging
from collections import Counter
from pathlib import Path

log = logging.getLogger("ds_trainer")

UTF8 = "utf-8"
_MARKS = (
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


def decode(data: bytes) -> tuple[str, str]:
    """(the text, the encoding it was read in): a byte-order mark's, else UTF-8 if it is valid,
    else cp1252, else Latin-1."""
    for mark, encoding in _MARKS:
        if data.startswith(mark):
            try:
                return data.decode(encoding), encoding
            except UnicodeDecodeError:
                break  # a mark on bytes that are not that encoding: read as what they are
    for encoding in (UTF8, "cp1252"):
        try:
            return data.decode(encoding), encoding
        except UnicodeDecodeError:
            continue
    return data.decode("latin-1"), "latin-1"


def read(path: Path, seen: Counter[str] | None = None) -> str:
    """A text file's text; `seen` counts the encodings read in."""
    text, encoding = decode(path.read_bytes())
    if seen is not None:
        seen[encoding] += 1
    return text


def report(label: str, seen: Counter[str]) -> None:
    """Say once for a source which of its text files were not plain UTF-8, and how they were
    read."""
    other = {encoding: n for encoding, n in sorted(seen.items()) if encoding != UTF8}
    if other:
        log.warning(
            "%s: read %s (not plain UTF-8: decoded by their byte-order mark, else as Windows' "
            "cp1252, else Latin-1)",
            label,
            ", ".join(f"{n} text file(s) as {encoding}" for encoding, n in other.items()),
        )
