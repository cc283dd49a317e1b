"""What this machine can run, found without importing torch (the dry run must stay fast).

Training re-checks with torch (`confirm_with_torch`), which is the authority once it is loaded.
"""

from __future__ import annotations

import os
import platform as _platform  # stdlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class PlatformInfo:
    """The accelerator kind and what it supports."""

    kind: str  # cuda | cpu | mps | rocm
    bf16: bool
    fp16: bool
    gpu_name: str | None = None
    gpu_memory_mib: int | None = None
    # DeepSpeed runs on CUDA and on its CPU accelerator; not on MPS or (in our support) ROCm.
    @property
    def deepspeed(self) -> bool:
        return self.kind in ("cuda", "cpu")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_info() -> PlatformInfo:
    # DeepSpeed's CPU accelerator always offers bf16; fp16 only where oneDNN has fp16 kernels.
    flags = _cpu_flags()
    return PlatformInfo("cpu", bf16=True, fp16=bool(flags & {"avx512_fp16", "amx_fp16"}))


@cache
def _nvidia_smi() -> list[tuple[str, int, float]]:
    """(name, memory MiB, compute capability) per visible GPU, or [] without a working driver."""
    exe = shutil.which("nvidia-smi")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if exe is None or visible in ("", "-1"):
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append((parts[0], int(float(parts[1])), float(parts[2])))
        except (IndexError, ValueError):
            continue
    if visible:
        wanted = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        gpus = [g for i, g in enumerate(gpus) if i in wanted] or gpus
    return gpus


def _nvidia_driver_gpus() -> bool:
    """NVIDIA's kernel driver lists GPUs (a container without the nvidia-smi binary, or one that fails)."""
    folder = Path("/proc/driver/nvidia/gpus")
    return folder.is_dir() and any(folder.iterdir())


def detect(requested: str = "auto") -> PlatformInfo:
    """The platform to plan for: `requested` unless it is `auto`, else what the machine has."""
    kind = requested
    if kind == "auto":
        if sys.platform == "darwin":
            kind = "mps" if _platform.machine() == "arm64" else "cpu"
        elif _nvidia_smi() or _nvidia_driver_gpus():
            kind = "cuda"
        elif Path("/dev/kfd").exists() and Path("/opt/rocm").exists():
            kind = "rocm"
        else:
            kind = "cpu"
    if kind == "cuda":
        gpus = _nvidia_smi()
        if gpus:
            name, mem, cap = gpus[0]
            return PlatformInfo("cuda", bf16=cap >= 8.0, fp16=True, gpu_name=name, gpu_memory_mib=mem)
        return PlatformInfo("cuda", bf16=True, fp16=True)
    if kind == "cpu":
        return _cpu_info()
    return PlatformInfo(kind, bf16=kind == "mps", fp16=True)


def confirm_with_torch(planned: PlatformInfo) -> PlatformInfo:
    """Re-detect with torch loaded; it wins over the torch-free guess (for example a CPU-only torch
    on a machine with a driver)."""
    import torch

    if planned.kind == "cuda" and not torch.cuda.is_available():
        return _cpu_info()
    if planned.kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        # From the properties: torch.cuda.is_bf16_supported() answers True on pre-Ampere GPUs (emulation) and,
        # to find out, makes a tensor on cuda:0 from every rank before Accelerate set each rank's device (a
        # CUDA context per rank on GPU 0).
        return PlatformInfo("cuda", bf16=props.major >= 8, fp16=True,
                            gpu_name=props.name, gpu_memory_mib=props.total_memory // 2**20)
    if planned.kind == "cpu":
        return PlatformInfo("cpu", bf16=True, fp16=bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()))
    return planned
