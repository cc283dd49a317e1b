"""The damaged forms of a file, as people's disks and tools leave them: cut short at several points,
empty, a header that lies, another format's magic, plain text, a folder or a symlink loop where
the file should be, and an image that declares huge dimensions. tests/test_damaged_inputs.py runs
them over every input surface (ds_trainer/config/surfaces.py)."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path


def forms(good: bytes) -> dict[str, bytes]:
    """The damaged byte forms of the file whose whole bytes are `good`."""
    n = len(good)
    return {"empty": b"", "cut at 4 bytes": good[:4], "cut at 20 bytes": good[:20],
            "cut in half": good[: n // 2], "cut one byte short": good[: n - 1],
            "a header that lies": (1 << 40).to_bytes(8, "little") + good[8:],
            "another format's magic": b"GIF89a" + good[6:],
            "plain text": b"not this kind of file, a note someone saved here\n" * 8,
            "bytes of no encoding": bytes(range(128, 256)) * 4}


def places(path: Path) -> dict[str, Callable[[], None]]:
    """Things that are not a file where `path` should be one."""
    return {"a folder": lambda: path.mkdir(), "a symlink loop": lambda: os.symlink(path, path)}


def cases(path: Path, good: bytes) -> Iterator[str]:
    """Puts each damaged form of `good` at `path` in turn (removing the last), yielding its name."""
    for name, content in forms(good).items():
        _clear(path)
        path.write_bytes(content)
        yield name
    for name, make in places(path).items():
        _clear(path)
        make()
        yield name
    _clear(path)


def huge_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header declares `width` x `height` (its pixels never follow): a decompression bomb's
    shape, and what a legal but very large scan looks like before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) \
        + chunk(b"IEND", b"")


def _clear(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        path.rmdir()
