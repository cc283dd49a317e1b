"""Where DeepSpeed's compiled ops live, and the CPU description their loader asks for. Torch-free.

Two start-up costs that are not the run's own:

- torch's JIT loader builds every op into one folder per op name (`<TORCH_EXTENSIONS_DIR>/<op>/`) and rebuilds
  it whenever the sources or flags differ from the last build. Two Python environments with their own
  DeepSpeed (or torch) therefore rebuild each other's ops in turn: minutes at a start, each time the other one
  ran in between (one start took 146 s). `use_environment_folder` gives each environment a folder of its own
  under the usual root, named after what decides the build: Python, torch, DeepSpeed and the environment.
- DeepSpeed asks py-cpuinfo for the CPU architecture and SIMD width each time it loads an op, built or not
  (`cpu_arch()` and `simd_width()`, two calls of about 1.1 s each: py-cpuinfo starts a process to probe the
  CPU). `cache_cpu_info` answers from a file kept per CPU model and flags after the first time.
- DeepSpeed compiles its ops with `-g`: debug information nobody running them reads, which made each op's
  compile about 40% longer here (cpu_adam 50 s -> 30 s without it; the op is the same code at the same -O3).
  `lean_builds` leaves it out. Every process that loads ops from this environment's folder must do the same
  (torch rebuilds an op whose flags changed).
- torch's loader builds with the `ninja` first on PATH, and ninja 1.11 (Debian's) and 1.13 (the environment's,
  from PyPI) hash the commands in the build log differently: each reads the other's log as out of date and
  rebuilds every op it loads (measured here: fused_adam and the CPU comm op rebuilt 4 and 6 times in an hour,
  1-2 minutes each, when runs started with and without the environment's bin/ on PATH took turns). `own_ninja`
  puts the environment's bin/ first on PATH where it has a ninja.
`prepare` does all four, and every entry point calls it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "ds_trainer-"


def cache_home() -> Path:
    """`~/.cache/ds_trainer` (or under XDG_CACHE_HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_trainer"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def environment_tag() -> str:
    """A folder name for this environment's ops: what torch's loader compares, in a readable form.

    The environment's path is in it because torch's include paths (part of each op's build flags) are.
    """
    where = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{PREFIX}{python}-torch{_version('torch')}-ds{_version('deepspeed')}-{where}"


def use_environment_folder() -> Path:
    """Point TORCH_EXTENSIONS_DIR at this environment's folder under the usual root (the user's own
    TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions), in this process and the ones it starts; returns it.

    Idempotent: a process started by another ds_trainer process keeps the folder it inherited.
    """
    folder = environment_folder()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    return folder


def environment_folder() -> Path:
    """This environment's ops folder, without changing anything (see `use_environment_folder`)."""
    tag = environment_tag()
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given and Path(given).name == tag:
        return Path(given)
    root = Path(given) if given else Path.home() / ".cache" / "torch_extensions"
    return root / tag


def _cpu_key() -> str:
    """The CPU model and flags (first processor of /proc/cpuinfo), py-cpuinfo's version and Python's."""
    lines = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            if line.split(":")[0].strip() in ("vendor_id", "cpu family", "model", "model name", "flags"):
                lines.append(line)
    except OSError:
        lines.append("no /proc/cpuinfo")
    lines += [_version("py-cpuinfo"), sys.version]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def cache_cpu_info() -> None:
    """Answer py-cpuinfo's `get_cpu_info()` from memory, and from a file after the first process on this kind
    of CPU. The frequency fields it returns are then those of the first call (nothing in DeepSpeed reads them)."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "ds_trainer_cached", False):
        return
    probe: Callable[[], dict[str, Any]] = cpuinfo.get_cpu_info
    path = cache_home() / f"cpuinfo-{_cpu_key()}.json"
    memo: list[dict[str, Any]] = []

    def get_cpu_info() -> dict[str, Any]:
        if not memo:
            try:
                memo.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                memo.append(probe())
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(memo[0]))
                    os.replace(tmp, path)
                except OSError:
                    pass  # a read-only home: probe again next time
        return dict(memo[0])

    get_cpu_info.ds_trainer_cached = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info
    if hasattr(cpuinfo, "cpuinfo"):
        cpuinfo.cpuinfo.get_cpu_info = get_cpu_info


def lean_builds() -> None:
    """Compile DeepSpeed's ops without `-g` (see the module docstring); nothing else about them changes."""
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        return
    strip = OpBuilder.strip_empty_entries
    if getattr(strip, "ds_trainer_lean", False):
        return

    def strip_empty_entries(self: Any, args: list[str]) -> list[str]:
        return [a for a in strip(self, args) if a != "-g"]

    strip_empty_entries.ds_trainer_lean = True  # type: ignore[attr-defined]
    OpBuilder.strip_empty_entries = strip_empty_entries  # type: ignore[method-assign]


def own_ninja() -> None:
    """The environment's own `ninja` (beside its python) first on PATH, in this process and those it starts."""
    here = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (here / "ninja").exists() and path.split(os.pathsep)[0] != str(here):
        os.environ["PATH"] = os.pathsep.join([str(here), path]) if path else str(here)


def prepare() -> Path:
    """Everything above, once per process before DeepSpeed loads an op; returns the ops' folder."""
    folder = use_environment_folder()
    cache_cpu_info()
    lean_builds()
    own_ninja()
    return folder
