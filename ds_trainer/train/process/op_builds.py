"""DeepSpeed's compiled ops during start-up: say when one is being compiled, and clear a build lock that
a killed process left behind.

DeepSpeed builds an op (ZeRO's Adam, the CPU-offload Adam, NVMe's async_io, the CPU communication op)
with torch's JIT extension loader the first time a run uses it: up to minutes, with nothing printed.
Every load, built or not, holds `<TORCH_EXTENSIONS_DIR>/py311_cpu/<op>/lock` for a moment (the loader
asks ninja whether the build is current), and any other process waits for that file to go away, with no
limit. A process killed while it held the lock (kill -9, the OOM killer, a node lost mid-build) leaves
the file, and every later run on that machine then hangs before its first step.

A watcher thread runs from the start of a run to its first step. It looks at the lock files every
second: one held by this process for more than `COMPILING_AFTER_S` means a compile, said once; one that
no process on this machine holds, and that stays so for `STALE_AFTER_S`, is removed with a warning. On
a network file system another node may be building, and another user's processes cannot be looked into,
so there only a lock older than `SHARED_STALE_AFTER_S` is taken for stale.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ds_trainer.train.observe import startup

log = logging.getLogger("ds_trainer")

COMPILING_AFTER_S = 3.0  # a load of a built op holds the lock well under a second
STALE_AFTER_S = 10.0  # torch's loader holds its file open for as long as it holds the lock
SHARED_STALE_AFTER_S = 30 * 60.0  # on a network file system: longer than any build we have seen
POLL_S = 1.0
NETWORK_FILE_SYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse.beegfs", "ceph",
                        "fuse.ceph", "glusterfs", "fuse.glusterfs", "panfs", "wekafs", "9p", "fuse.sshfs"}


def extensions_root() -> Path:
    """Where torch's loader builds DeepSpeed's ops (`<root>/<op>/`), computed as torch 2.x computes it."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    hip, cuda = torch.version.hip, torch.version.cuda  # type: ignore[attr-defined]
    device = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{device}"


def holders(lock: Path) -> set[int]:
    """The processes on this machine that have `lock` open (torch's loader keeps it open while it holds it)."""
    target, found = os.path.realpath(lock), set()  # /proc shows the resolved path
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == target:
                    found.add(int(proc.name))
                    break
        except OSError:  # the process ended, or its fds are not ours to read
            continue
    return found


def on_network_fs(path: Path) -> bool:
    """Whether `path` lives on a file system other machines may write to (from /proc/mounts)."""
    best, kind = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return True  # unknown: be careful
    resolved = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3 and (resolved == fields[1] or resolved.startswith(fields[1].rstrip("/") + "/")) \
                and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind in NETWORK_FILE_SYSTEMS


class Watcher:
    """One pass per `POLL_S` over the ops' lock files; `check()` is one pass (the thread calls it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.shared = on_network_fs(root)
        self.unheld: dict[tuple[Path, int], float] = {}  # (lock, inode) -> first seen held by nobody
        self.mine: dict[tuple[Path, int], float] = {}  # (lock, inode) -> first seen held by this process
        self.said: set[Path] = set()

    def check(self, now: float) -> None:
        seen = set()
        for lock in self.root.glob("*/lock"):
            try:
                stat = lock.stat()
            except FileNotFoundError:
                continue
            key = (lock, stat.st_ino)
            seen.add(key)
            held = holders(lock)
            # Another user's processes' open files are not ours to see: judge their lock by age alone.
            blind = os.geteuid() not in (0, stat.st_uid)
            if os.getpid() in held:
                self._compiling(lock, key, now)
            elif held:
                self.unheld.pop(key, None)
            else:
                self._stale(lock, key, now, now - stat.st_mtime, by_age=self.shared or blind)
        for table in (self.unheld, self.mine):
            for key in set(table) - seen:
                del table[key]

    def _compiling(self, lock: Path, key: tuple[Path, int], now: float) -> None:
        since = self.mine.setdefault(key, now)
        if now - since >= COMPILING_AFTER_S and lock.parent not in self.said:
            self.said.add(lock.parent)
            log.warning("compiling DeepSpeed's op %s (once per machine and op: about 20 s to 3 min; later runs "
                        "load it from %s). Share that folder between nodes (TORCH_EXTENSIONS_DIR) or build the "
                        "ops ahead with `make ops`", lock.parent.name, lock.parent)

    def _stale(self, lock: Path, key: tuple[Path, int], now: float, age: float, by_age: bool) -> None:
        since = self.unheld.setdefault(key, now)
        if now - since < STALE_AFTER_S or (by_age and age < SHARED_STALE_AFTER_S):
            return
        try:
            if lock.stat().st_ino != key[1]:
                return  # replaced since: someone else's lock now
            lock.unlink()
        except FileNotFoundError:
            return
        del self.unheld[key]
        log.warning("removed %s: a build lock of DeepSpeed's op %s that no process holds (%.0f s old; left by a "
                    "process killed while loading or compiling the op). Without this every run would wait for "
                    "it forever", lock, lock.parent.name, age)


def watch() -> Callable[[], None]:
    """Watch the ops' build locks from now until the first training step, in a daemon thread; returns the
    function that stops it sooner (a run that ends before its first step)."""
    stop = threading.Event()
    try:
        watcher = Watcher(extensions_root())
    except Exception as exc:  # noqa: BLE001 - a watcher that cannot start must not stop the run
        log.debug("op build watcher not started: %s", exc)
        return stop.set

    def loop() -> None:
        while not startup.finished() and not stop.is_set():
            try:
                watcher.check(time.time())
            except OSError as exc:
                log.debug("op build watcher: %s", exc)
            stop.wait(POLL_S)

    threading.Thread(target=loop, name="ds_trainer-op-builds", daemon=True).start()
    return stop.set
