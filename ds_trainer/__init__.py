"""ds_trainer: Hydra-driven SDXL training with DeepSpeed ZeRO through Hugging Face Accelerate."""

from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR.parent / "conf"
ASSETS_DIR = PACKAGE_DIR / "assets"
SWEEPS_DIR = PACKAGE_DIR.parent / "sweeps"
