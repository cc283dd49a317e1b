"""What a checkpoint's COMPLETE marker records of each file, and the check before a resume loads it.

A failing disk or a bad copy between clusters can truncate or corrupt a file of a checkpoint that has
its marker; loading it would fail deep inside torch, or worse, load damaged weights. `manifest` lists
every file of the folder (whatever wrote it: DeepSpeed shards, EMA, portable state files) with its
size and a content hash; `damage` compares the folder with it. Torch-free.

The hash is xxHash's XXH3-128 when `xxhash` is installed (faster than writing the file: measured
0.25 s per 64 MiB against 0.50 s for torch.save + fsync on a loaded 2-core machine; blake2b took
0.72 s, sha256 0.48 s), else blake2b; the marker names the one it used.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

CHUNK = 8 << 20


def _hasher(name: str) -> Any:
    if name == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.blake2b(digest_size=16)


def default_hash() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b"
    return "xxh3_128"


def file_hash(path: Path, name: str) -> str:
    h = _hasher(name)
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return str(h.hexdigest())


def manifest(folder: Path, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """{"hash": algorithm, "files": {relative path: {"size", "hash"}}} of every file under `folder`."""
    name = default_hash()
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel not in skip:
            files[rel] = {"size": path.stat().st_size, "hash": file_hash(path, name)}
    return {"hash": name, "files": files}


def damage(folder: Path, recorded: dict[str, Any], hashes: bool = True) -> str | None:
    """Why `folder` no longer matches what its marker recorded, or None (also for checkpoints written
    before markers recorded files: nothing to compare)."""
    files = recorded.get("files")
    if not isinstance(files, dict):
        return None
    name = str(recorded.get("hash", "blake2b"))
    for rel, want in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} is {size} bytes, {want['size']} when it was written (truncated or cut short)"
    if hashes:
        for rel, want in files.items():
            if file_hash(folder / rel, name) != want["hash"]:
                return f"{rel} has changed since it was written (its {name} content hash differs)"
    return None
