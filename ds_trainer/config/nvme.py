"""NVMe offload: swap sizing, path checks, the async_io op, and stale swap cleanup."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import tempfile
from pathlib import Path

# Bytes per parameter DeepSpeed writes to the swap folder, per optimizer: fp32 master weights,
# the fp32 gradient it swaps alongside them, and the optimizer's fp32 states.
_OPTIMIZER_STATE_BYTES = {"adam": 16, "adamw": 16, "lamb": 16, "muon": 16, "adagrad": 12, "lion": 12}

# DeepSpeed's aio reads and writes in blocks; buffers are kept to a multiple of this many elements.
_ALIGN = 1 << 20


def swap_bytes(param_count: int, optimizer: str, params_on_nvme: bool, param_bytes: int) -> int:
    """Estimated bytes one node writes to the swap folder under ZeRO-3 NVMe offload."""
    per_param = _OPTIMIZER_STATE_BYTES.get(optimizer, 16) + (param_bytes if params_on_nvme else 0)
    return param_count * per_param


def buffers(max_param_numel: int, prefetch_bucket: int) -> tuple[int, int]:
    """(buffer_count, buffer_size in elements) for ZeRO-3 parameter swapping.

    Every buffer must hold the largest parameter, and together they must hold the parameters
    prefetched at once plus the one in use: too few gives DeepSpeed's "Not enough buffers" error,
    too large (the docs' 1e9) pins gigabytes of host memory per buffer.
    """
    size = -(-max_param_numel // _ALIGN) * _ALIGN
    count = -(-(prefetch_bucket + max_param_numel) // size) + 2
    return max(5, min(count, 64)), size


def aio_prerequisites(gpu: bool = False) -> str | None:
    """Why DeepSpeed's async_io op cannot build here, or None. Torch-free: header and library, and on a GPU
    machine the CUDA toolkit's headers (DeepSpeed's CUDA builder of the op includes CUDA_HOME and links
    cudart; an nvcc of another release does not matter for this C++ op)."""
    if gpu:
        from ds_trainer.config import toolkit

        if toolkit.cuda_home() is None:
            return ("on a GPU machine DeepSpeed's async_io op compiles against the CUDA toolkit's headers and "
                    "none was found (CUDA_HOME unset, no nvcc on PATH, no /usr/local/cuda): install the CUDA "
                    "toolkit of torch's release and export CUDA_HOME")
    include_dirs = ["/usr/include", "/usr/local/include"]
    include_dirs += [flag[2:] for flag in os.environ.get("CFLAGS", "").split() if flag.startswith("-I")]
    has_header = any(Path(d, "libaio.h").exists() for d in include_dirs)
    has_lib = ctypes.util.find_library("aio") is not None
    if has_header and has_lib:
        return None
    return ("DeepSpeed's async_io op needs libaio: install it with `apt-get install libaio-dev` "
            "(or set CFLAGS=-I<include dir> and LDFLAGS=-L<lib dir> where it lives)")


def aio_load_error(gpu: bool = False) -> str | None:
    """Build/load the async_io op now (minutes the first time, cached after); the error, or None. The
    prerequisites are named first: a missing CUDA_HOME made DeepSpeed fail with "expected str, bytes or
    os.PathLike object, not NoneType", which said nothing of the cause."""
    why = aio_prerequisites(gpu)
    if why:
        return why
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return "DeepSpeed reports its async_io op as incompatible here"
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure is reported to the user
        return f"DeepSpeed's async_io op failed to build or load: {type(exc).__name__}: {exc}"
    return None


def check_path(path: str, need_bytes: int) -> str | None:
    """Why `path` cannot take `need_bytes` of swap, or None. Creates the folder if needed."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot be created ({exc.strerror})"
    if not target.is_dir():
        return "exists and is not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=target):
            pass
    except OSError as exc:
        return f"is not writable ({exc.strerror})"
    # Swap folders of earlier runs are removed before DeepSpeed starts: their space counts as free.
    free = shutil.disk_usage(target).free + sum(_size(p) for p in target.glob("zero_stage_*") if p.is_dir())
    if free < need_bytes:
        return (f"has {free / 2**30:.2f} GiB free, the swap needs about {need_bytes / 2**30:.2f} GiB "
                "(estimate x offload.free_space_margin)")
    return None


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def remove_stale_swap(path: str) -> list[Path]:
    """Delete `zero_stage_*` swap folders left by earlier runs (they break resumes with
    "buffer nbytes != file bytes"); returns what was removed."""
    root = Path(path)
    stale = sorted(p for p in root.glob("zero_stage_*") if p.is_dir()) if root.is_dir() else []
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale
