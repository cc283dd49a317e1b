"""Run directories: names shared by all ranks of a run, distinct between runs, and the files written there.

Under torchrun every rank runs `@hydra.main` and would compute its own `${now:}` directory; the stamp
here is derived from the launcher process instead, so the ranks of one run agree. Two runs started
in the same second still differ by a random suffix.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from ds_trainer import ASSETS_DIR
from ds_trainer.config import distributed, runlock


def since_boot(pid: int) -> float | None:
    """When `pid` started, in seconds after the machine booted (Linux), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _process_start(pid: int) -> float | None:
    """Start time of `pid` in seconds since the epoch (Linux), or None. The same value in every process that
    asks (the boot time in whole seconds, not the uptime), so that the ranks' run stamps agree."""
    started = since_boot(pid)
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return None if started is None else boot + started


@cache
def stamp() -> str:
    """`YYYY-MM-DD/HH-MM-SS-xxxxxx`, the same on all local ranks of one launch, unique per run."""
    if os.environ.get("DS_TRAINER_RUN_STAMP"):
        return os.environ["DS_TRAINER_RUN_STAMP"]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Ranks started by torchrun (or accelerate launch) share their parent, the elastic agent.
        parent = os.getppid()
        started = _process_start(parent) or time.time()
        key = f"{socket.gethostname()}:{parent}:{started}:{os.environ['TORCHELASTIC_RUN_ID']}"
        suffix = hashlib.sha1(key.encode()).hexdigest()[:6]
    else:
        started, suffix = time.time(), secrets.token_hex(3)
    value = time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(started)) + f"-{suffix}"
    # Processes started from this one (submitit jobs, locally or through sbatch, which passes the
    # environment on) compose the sweep directory again: they must land in the same one.
    os.environ["DS_TRAINER_RUN_STAMP"] = value
    return value


def hydra_subdir(output_dir: str) -> str | None:
    """Where Hydra writes its `.hydra/` files before the task runs: on rank 0 into a new folder;
    into a folder that holds a run (its lock, or its config.yaml) nowhere, so that a run refused
    there leaves the other run's records untouched: `write_hydra_files` writes them once this
    run's checks passed and it holds the folder."""
    folder = Path(output_dir)
    held = (folder / runlock.LOCK).exists() or (folder / "config.yaml").exists()
    if not distributed.is_main() or held:
        return None
    return ".hydra"


def write_hydra_files(run_dir: Path, composed: str) -> None:
    """Hydra's `.hydra/` files (config.yaml: `composed`, the task's config as composed;
    hydra.yaml; overrides.yaml), where Hydra left them out (`hydra_subdir`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or HydraConfig.get().output_subdir is not None:
        return
    hydra_cfg = HydraConfig.get()
    folder = run_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    write_yaml(folder / "config.yaml", composed)
    write_yaml(folder / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))
    write_yaml(folder / "overrides.yaml", OmegaConf.to_yaml(list(hydra_cfg.overrides.task)))


def log_file(path: str) -> str:
    """`path` on rank 0; other ranks log to the console only."""
    return path if distributed.is_main() else os.devnull


def asset(name: str) -> str:
    """Absolute path of a folder in `ds_trainer/assets` (model architectures kept in the repo)."""
    return str(ASSETS_DIR / name)


PRESETS = "presets"  # <paths.outputs>/presets/<group>/<option>.yaml: presets the tools write (tune's winner)


def presets_dir(default_outputs: str = "outputs", argv: list[str] | None = None) -> Path:
    """The folder of the user's presets: `<paths.outputs>/presets`, with `paths.outputs` as the command line gives
    it (Hydra reads its search path before it applies the overrides, so the config's value would be the
    default's) or else `default_outputs`. A tool writes presets there, never into the source checkout."""
    outputs = default_outputs
    for arg in sys.argv[1:] if argv is None else argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "paths.outputs" and value and "," not in value:
            outputs = value
    return Path(outputs).expanduser().absolute() / PRESETS


def presets_searchpath(default_outputs: str) -> str:
    """`hydra.searchpath` entry of conf/config.yaml: `+experiment=<name>` finds a preset there as is."""
    return f"file://{presets_dir(default_outputs)}"


def register_resolvers() -> None:
    """Resolvers used by `conf/`: run and sweep directories, where Hydra writes .hydra/, the log file, asset
    paths, the presets."""
    for name, fn in (("ds_trainer_run_stamp", stamp), ("ds_trainer_hydra_subdir", hydra_subdir),
                     ("ds_trainer_log_file", log_file), ("ds_trainer_asset", asset),
                     ("ds_trainer_presets", presets_searchpath)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


@cache
def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path, skip: frozenset[str] = frozenset()) -> None:
    """The files under `path` (or the file) that a library wrote readable by its owner alone
    (safetensors writes 0600) made as readable as the umask makes every other file, so that a
    teammate on a shared disk reads the weights as well as the config; `skip`: names of folders
    left alone."""
    wanted = 0o666 & ~_umask()
    files = [path]
    if not path.is_file():
        files = [p for p in path.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(path).parts)]
    for file in files:
        try:
            mode = file.stat().st_mode & 0o777
            if mode == 0o600 and wanted != 0o600:
                file.chmod(wanted)
        except OSError:
            continue  # another rank's file, or gone: its own writer follows the umask too


def write_json(path: Path, data: Any) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def write_yaml(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)


def write_run_files(run_dir: Path, cfg: DictConfig, ds: dict[str, Any] | None,
                    accelerate: dict[str, Any]) -> dict[str, Path]:
    """Write `config.yaml`, `ds_config.json` (DeepSpeed runs) and `accelerate_config.yaml`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    files = {"config": run_dir / "config.yaml", "accelerate": run_dir / "accelerate_config.yaml"}
    write_yaml(files["config"], OmegaConf.to_yaml(cfg))
    if ds is not None:
        files["ds_config"] = run_dir / "ds_config.json"
        write_json(files["ds_config"], ds)
    write_yaml(files["accelerate"], accelerate)
    return files
