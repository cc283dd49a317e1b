"""A write that ran out of space, wherever in the run it happened (DeepSpeed's files, the FSDP shards, the portable
state, the EMA, the LoRA file, the export, the latent cache, the metrics, the samples): one message that says
where, how much is free, which checkpoint is intact, and how to go on.

Libraries report a full disk in several ways: an OSError with ENOSPC (Python's own writes), its text inside
another exception ("No space left on device (os error 28)" from safetensors' Rust writer, raised by DeepSpeed or
torch.distributed.checkpoint on a rank), and torch's zip writer without any errno ("PytorchStreamWriter failed
writing file", "unexpected pos"): that one counts when the folder it wrote to is (nearly) full.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

NO_SPACE = "No space left on device"
# torch.save's zip writer, when a write comes up short: no errno, no "No space" text.
ZIP_WRITER = ("PytorchStreamWriter failed", "unexpected pos", "iostream error")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _existing(folder: Path) -> Path:
    """`folder`, or its closest parent that exists (a failed write may not have made it)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def nearly_full(folder: Path) -> bool:
    """Less than 256 MiB or 1% of the disk left where `folder` (or its closest existing parent) lives."""
    usage = shutil.disk_usage(_existing(folder))
    return usage.free < max(256 * 2**20, usage.total // 100)


def where(exc: BaseException) -> Path | None:
    """The file a full disk refused, where the exception names it."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.filename:
            return Path(str(e.filename))
    return None


def is_full(exc: BaseException, folder: Path) -> bool:
    """Whether `exc` (or what it was raised from) is a write that ran out of space; `folder`: where the failed
    write went, asked when the library gave no errno."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or NO_SPACE in str(e):
            return True
    if any(marker in str(e) for e in _chain(exc) for marker in ZIP_WRITER):
        return nearly_full(where(exc) or folder)
    return False


def message(exc: BaseException, folder: Path, what: str, intact: str | None) -> str:
    """The one-screen message: what was being written, where, how much is free there, the checkpoint a resume
    continues from (`intact`, a folder name; None: no checkpoint was completed), and the way on."""
    target = where(exc) or folder
    free = shutil.disk_usage(_existing(target)).free / 2**20
    kept = f"the last checkpoint, {intact}, is intact" if intact else "no checkpoint was completed before it"
    return (f"disk full while {what} ({target}: {free:.0f} MiB free on its disk); {kept}. Free space, or move "
            "paths.outputs (and data.cache_dir, where the latent cache is) to a larger disk or lower "
            "train.checkpoints_to_keep, then run again with resume=latest")
