"""ds_trainer: Hydra-driven SDXL training with DeepSpeed ZeRO through Hugging Face Accelerate."""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR.parent / "conf"
ASSETS_DIR = PACKAGE_DIR / "assets"
SWEEPS_DIR = PACKAGE_DIR.parent / "sweeps"


def _one_path_per_environment() -> None:
    """Import torch and DeepSpeed by their real paths, whatever symlink reached the environment.

    DeepSpeed's ops are compiled with torch's and DeepSpeed's own folders in every command (include
    paths, sources): an environment reached by two paths (a symlinked checkout, a venv behind a
    link) would give two sets of commands for one ops folder, and torch's loader rebuilds an op each
    time the other path ran last (a minute or two per op). Resolving the import path before either
    is imported makes one set. Every ds_trainer entry point imports this package first; torch
    imported earlier keeps its path.
    """
    sys.path[:] = [os.path.realpath(p) if p else p for p in sys.path]


_one_path_per_environment()
