"""NVMe offload: the swap fits on offload.nvme_path with its margin, and async I/O can run here. Torch-free,
read-only; asked only of a config with no other problem (it may create the swap folder to test it).
"""

from __future__ import annotations

from omegaconf import DictConfig

from ds_trainer.config import ds_config, hardware, nvme
from ds_trainer.config.checks import resolve
from ds_trainer.config.problems import Problem


def problems(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """The margin, the disk's room and rights, then libaio (and the CUDA toolkit on a GPU)."""
    if "nvme" not in ds_config.placement(cfg):
        return []
    optimizer = str(cfg.resolved.optimizer or "adamw")
    margin = float(cfg.offload.free_space_margin)
    if margin < 1.0:
        return [Problem("offload.free_space_margin", margin, "below 1.0 the swap may not fit; DeepSpeed does not "
                        "notice a full swap disk and later aborts the process on reading a short file",
                        "offload.free_space_margin=1.2 (the default)")]
    out = []
    why = resolve.swap_problem(cfg, optimizer)
    if why:
        out.append(Problem("offload.nvme_path", str(cfg.offload.nvme_path), why,
                           "offload.nvme_path=<a writable folder on a fast disk>"))
    why = nvme.aio_prerequisites(info.kind == "cuda")
    if why:
        fix = "the CUDA toolkit (CUDA_HOME), or offload=cpu" if "CUDA" in why else "apt-get install libaio-dev, " \
            "or offload=cpu"
        out.append(Problem("offload", "nvme", why, fix))
    return out
