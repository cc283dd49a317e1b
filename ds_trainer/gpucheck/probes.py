"""`python -m ds_trainer.gpucheck.probes NAME [args]`: the check's steps that are not training runs.

Each probe runs in a process of its own (a CUDA error or a hard exit stays in it) and ends by printing one line,
`GPUCHECK {json}`: `findings` (review finding -> what was seen), `data` (figures for the results) and the peak GPU
memory it allocated. They import torch, diffusers and bitsandbytes only: nothing of ds_trainer, so a probe reads
the libraries as they are, whatever ds_trainer does with them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

MARK = "GPUCHECK "
LIBRARIES = ("deepspeed", "diffusers", "accelerate", "transformers", "peft", "torchao", "optimi",
             "bitsandbytes", "hydra", "omegaconf")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # noqa: BLE001 - missing or broken: the machine row says so
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _nccl() -> str:
    import torch

    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (2.18.3 -> 21803) in older ones
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def matmul_tflops() -> float:
    """Dense matrix-multiply rate in TFLOP/s, as the bench measures it (bf16 8192^3 on a GPU, fp32 512^3 on a CPU):
    the denominator of MFU."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype, device, iters = (8192, torch.bfloat16, "cuda", 50) if cuda else (512, torch.float32, "cpu", 5)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for _ in range(4):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            a @ b
        if cuda:
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def unet_tflop_per_image(model: str, res: int) -> float:
    """Model FLOPs of one image through the UNet, forward and backward, counted on the meta device (the bench's
    count: checkpointing's recomputation is not counted)."""
    import diffusers
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ds_trainer import ASSETS_DIR

    config = diffusers.UNet2DConditionModel.load_config(str(ASSETS_DIR / model), subfolder="unet")
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel.from_config(config)
        pooled = int(unet.config.projection_class_embeddings_input_dim) - 6 * int(unet.config.addition_time_embed_dim)
        latents = torch.randn(1, int(unet.config.in_channels), res // 8, res // 8)
        embeds = torch.randn(1, 77, int(unet.config.cross_attention_dim))
        cond = {"text_embeds": torch.randn(1, pooled), "time_ids": torch.randn(1, 6)}
        with FlopCounterMode(display=False) as counter:
            unet(latents, torch.tensor([500]), embeds, added_cond_kwargs=cond).sample.sum().backward()
    return float(counter.get_total_flops()) / 1e12


def machine(flops: list[str]) -> dict[str, Any]:
    """The machine row: what a result is read against."""
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    data: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": cuda, "cpus": os.cpu_count(),
        "host_memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        **{name: _version(name) for name in LIBRARIES}}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        data.update(gpu_name=torch.cuda.get_device_name(0), gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", nccl=_nccl(), driver=_driver(),
                    nvcc=shutil.which("nvcc"), cuda_home=os.environ.get("CUDA_HOME"))
    # The names and versions first: a probe stopped in the matrix product or the FLOP count still
    # gives the GPU's name (review 3's K5: without it no calibration record can be filed).
    print(MARK + json.dumps({"data": data}), flush=True)
    data["peak_tflops"] = round(matmul_tflops(), 3)
    data["tflop_per_image"] = {}
    for item in flops:
        model, res = item.split(":")
        data["tflop_per_image"][f"{model}@{res}"] = round(unet_tflop_per_image(model, int(res)), 3)
    return {"data": data}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mechanisms() -> dict[str, Any]:
    """Review C2, L1 and C3's mechanisms on a one-rank group (their failures need two GPUs or a resume)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    findings = {}
    # C2: Accelerate's plain "nccl" group serves CUDA tensors only ("cuda:gloo" shows the same on a CPU machine).
    backend = "nccl" if cuda else "cuda:gloo"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1))
        findings["C2"] = f"not reproduced: a CPU tensor all-reduced on a plain {backend} group"
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        findings["C2"] = f"reproduced on a plain {backend} group: {_first_line(exc)}"
    if not cuda:  # C3's FSDP2 below needs a group that serves CPU tensors here
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    # L1: prodigyopt's CUDA scalar `d` in an update of a CPU-offloaded partition.
    if cuda:
        try:
            torch.zeros(4).add_(torch.tensor(1e-8, device="cuda"))  # exp_avg_sq.sqrt().add_(d * eps)
            findings["L1"] = "not reproduced: a CPU tensor took a CUDA 0-dim operand"
        except Exception as exc:  # noqa: BLE001
            findings["L1"] = f"reproduced: {_first_line(exc)}"
    else:
        findings["L1"] = "needs CUDA"
    # C3: an FSDP2 parameter under CPUOffloadPolicy: its local shard lives on the CPU, its mesh says "cuda".
    layer = torch.nn.Linear(64, 64)
    fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=cuda))
    weight: Any = layer.weight  # a DTensor now
    local, mesh = weight.to_local().device.type, weight.device_mesh.device_type
    findings["C3"] = (f"reproduced: the shard is on {local}, its mesh on {mesh} (a shard built on the mesh's device "
                      "is on the wrong one)" if local != mesh else f"not reproduced: shard and mesh both on {local}")
    dist.destroy_process_group()
    return {"findings": findings}


def adamw8bit(numel: int) -> dict[str, Any]:
    """Review C4: bitsandbytes passes a tensor's size to its CUDA kernel as int32; one of 2**31 elements or more
    (one rank's flat ZeRO-1/2 partition of SDXL) wraps negative."""
    import bitsandbytes as bnb
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = torch.nn.Parameter(torch.zeros(numel, device=device))
    weight.grad = torch.full_like(weight, 1e-3)
    optimizer = bnb.optim.AdamW8bit([weight], lr=1e-2, weight_decay=0.0)
    try:
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        return {"findings": {"C4": f"reproduced: {_first_line(exc)}"}}
    first, last = float(weight[0]), float(weight[-1])
    moved = first != 0.0 and last != 0.0
    if numel < 2**31:
        seen = f"mechanics only ({numel} < 2**31 elements): the step {'moved' if moved else 'did NOT move'} it"
    else:
        seen = ("not reproduced: first and last elements moved" if moved else
                f"reproduced: no update (first {first}, last {last})")
    return {"findings": {"C4": seen}, "data": {"first": first, "last": last}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_trainer.gpucheck.probes")
    parser.add_argument("name", choices=("machine", "mechanisms", "adamw8bit"))
    parser.add_argument("--flops", nargs="*", default=[], help="model:resolution pairs to count UNet FLOPs of")
    parser.add_argument("--numel", type=int, default=2**31 + 4096)
    args = parser.parse_args(argv)
    if args.name == "machine":
        result = machine(args.flops)
    elif args.name == "mechanisms":
        result = mechanisms()
    else:
        result = adamw8bit(args.numel)
    import torch

    if torch.cuda.is_available():
        result["gpu_mem_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["gpu_mem_peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
