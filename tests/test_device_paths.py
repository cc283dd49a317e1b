"""Paths that only a GPU runs, shown on the CPU by their mechanism (../shared/notes/gpu-paths-review-2.md): the
process group FSDP2's CPU offload needs, where a resumed shard of Adam's state lands, and the combinations
validation refuses because they fail on a GPU after training has started."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from ds_trainer.config import checks, hardware
from tests.helpers.cfg import make_cfg
from tests.helpers.ranks import free_port

GPU = hardware.PlatformInfo("cuda", bf16=True, fp16=True, gpu_name="NVIDIA H100", gpu_memory_mib=81559)

# One rank, one process: a group built from `backend` all-reduces a CPU tensor (NCCL is not on the CPU: gloo
# stands in for it under the same device map, which is what decides whether a CPU tensor has a backend).
GROUP_SCRIPT = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group(sys.argv[1].replace("nccl", "gloo"))
try:
    dist.all_reduce(torch.ones(1))
    print("ok")
except RuntimeError as exc:
    print(exc)
"""


def _all_reduce_on_the_host(backend: str) -> str:
    done = subprocess.run([sys.executable, "-c", GROUP_SCRIPT, backend, str(free_port())], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_fsdp_cpu_offload_on_gpus_gets_a_group_that_reduces_host_tensors() -> None:
    """C2: under FSDP2's CPU offload, clipping's norm and the portable state's gathers reduce CPU shards. torchrun,
    srun and `python -m ds_trainer` leave Accelerate with a plain "nccl" group, which maps "cuda" alone."""
    from ds_trainer.train import backends
    from ds_trainer.train.backends.accelerator import process_group

    kinds = {}
    for zero, offload in (("fsdp_full_shard", "cpu"), ("fsdp_full_shard", "none"), ("stage2", "cpu"), ("ddp", "none")):
        cfg = checks.check(make_cfg(f"zero={zero}", f"offload={offload}")).cfg
        backend = backends.of(cfg, {} if zero == "stage2" else None)
        kinds[zero, offload] = process_group("cuda", backend.host_collectives)
    assert kinds == {("fsdp_full_shard", "cpu"): "cuda:nccl,cpu:gloo", ("fsdp_full_shard", "none"): None,
                     ("stage2", "cpu"): None, ("ddp", "none"): None}
    assert process_group("cpu", False) == process_group("cpu", True) == "gloo"
    # What "nccl" builds (one backend, for "cuda" only) cannot reduce a host tensor; the group chosen above can
    assert "No backend type associated with device type cpu" in _all_reduce_on_the_host("cuda:nccl")
    assert _all_reduce_on_the_host(str(kinds["fsdp_full_shard", "cpu"])) == "ok"


@pytest.fixture
def one_rank_mesh() -> Iterator[object]:
    """A one-rank gloo group (torch's own: DeepSpeed's would load its communication op) and its CPU mesh; the
    one-rank group an earlier test of this worker left is used as it is."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if mine:
            dist.destroy_process_group()


def test_a_carried_shard_lands_where_the_parameter_lives_not_on_its_mesh_device(one_rank_mesh: object) -> None:
    """C3: under FSDP2's CPU offload a parameter's shard is on the host while its mesh is "cuda"; Adam's moments
    carried into it by a resume must sit beside it. Here the mesh is "cpu" and the parameter's shard on "meta",
    the same split."""
    from torch.distributed.tensor import DTensor, Shard

    from ds_trainer.train.backends import sharded

    p = DTensor.from_local(torch.empty(4, 3, device="meta"), one_rank_mesh, [Shard(0)],  # type: ignore[arg-type]
                           shape=torch.Size([4, 3]), stride=(3, 1))
    moment = sharded.like(torch.ones(4, 3), p)
    assert isinstance(moment, DTensor) and moment.to_local().device.type == "meta"
    assert moment.shape == p.shape and moment.placements == p.placements
    on_mesh = DTensor.from_local(torch.zeros(4, 3), one_rank_mesh, [Shard(0)])  # type: ignore[arg-type]
    assert torch.equal(sharded.like(torch.ones(4, 3), on_mesh).to_local(), torch.ones(4, 3))  # the plain case


def _refused(*overrides: str, info: hardware.PlatformInfo = GPU) -> dict[str, str]:
    report = checks.check(make_cfg("platform=cuda", *overrides), info=info)
    return {p.key: p.why + " | fix: " + p.fix for p in report.problems}


def test_what_fails_on_a_gpu_after_its_first_step_is_refused_before_it() -> None:
    """C4 (bitsandbytes counts a tensor's elements in a 32-bit int: one rank's ZeRO-1/2 partition of a full SDXL
    UNet is past it), L1 (Prodigy's CUDA step size meets an offloaded CPU partition) and L6 (T5 and the
    flow-matching transformers overflow in fp16): each is refused with its fix, and only where it fails."""
    full_sdxl = ("model=sdxl_base", "optimizer=adamw8bit", "zero=stage2")
    refused = _refused(*full_sdxl, "world_size=1")
    assert "2,567,463,684 elements" in refused["optimizer.name"]
    assert "2 or more ranks" in refused["optimizer.name"] and "zero=stage3" in refused["optimizer.name"]
    assert "optimizer.name" not in _refused(*full_sdxl, "world_size=2")  # 1.28 B elements per rank
    assert "optimizer.name" not in _refused("model=sdxl_base", "optimizer=adamw8bit", "zero=stage3", "world_size=1")
    assert "optimizer.name" not in _refused(*full_sdxl, "world_size=1", "adapter=lora")
    assert "zero.sub_group_size" in _refused("model=sdxl_base", "optimizer=adamw8bit", "zero=stage3",
                                             "zero.sub_group_size=3000000000")

    prodigy = ("optimizer=prodigy", "zero=stage2", "world_size=2")
    assert "CUDA scalar" in _refused(*prodigy, "offload=cpu")["offload"]
    assert "offload" not in _refused(*prodigy, "offload=none")
    assert "offload" not in _refused("optimizer=prodigy", "zero=stage2", "world_size=1", "offload=cpu")

    for model in ("sd3_tiny", "flux_tiny"):
        assert "T5 overflows in fp16" in _refused(f"model={model}", "precision=fp16")["precision"]
        assert "precision" not in _refused(f"model={model}", "precision=bf16")
    assert "precision" not in _refused("model=sdxl_tiny", "precision=fp16")


def test_the_attention_kernels_cuda_cannot_run_for_a_run_are_refused_before_it() -> None:
    """Review 3's C2 (Qwen-Image trains with a caption mask, which CUDA's flash kernel takes none of), C3 (cuDNN's
    attention has no fp32), C4 (a DDP full fine-tune samples its fp32 module without autocast: flash and cuDNN take
    fp16/bf16 only) and L1 (Qwen-Image in fp16, clipped as Flux's): refused with their fixes, only where they fail."""
    for model in ("qwen_image_tiny", "qwen_image_edit_tiny"):
        assert "takes no mask" in _refused(f"model={model}", "train.attention=flash")["train.attention"]
        assert "train.attention" not in _refused(f"model={model}", "train.attention=efficient")
        assert "train.attention" not in _refused(f"model={model}", "train.attention=cudnn")
    assert "train.attention" not in _refused("model=flux_tiny", "train.attention=flash")
    for kernel in ("flash", "cudnn"):
        assert "fp16 or bf16" in _refused("precision=fp32", f"train.attention={kernel}")["train.attention"]
        ddp = ("zero=ddp", f"train.attention={kernel}", "samples=on")
        assert "without autocast" in _refused(*ddp)["train.attention"]
        assert "train.attention" not in _refused(*ddp, "adapter=lora")  # a LoRA's base is held in bf16
        assert "train.attention" not in _refused("zero=ddp", f"train.attention={kernel}")  # no samples
        assert "train.attention" not in _refused("zero=stage2", f"train.attention={kernel}", "samples=on")
    assert "train.attention" not in _refused("precision=fp32", "train.attention=efficient")
    assert "clips its transformer's streams" in _refused("model=qwen_image_tiny", "precision=fp16")["precision"]


def _kahan_run(*overrides: str) -> tuple[bool, str]:
    report = checks.check(make_cfg("platform=cuda", "precision=bf16_pure_kahan", *overrides), info=GPU)
    assert report.ok, report.render()
    return bool(report.cfg.resolved.kahan_loop), " ".join(report.warnings)


def test_a_kahan_partition_past_tritons_int32_indices_steps_with_optimis_loop() -> None:
    """Review 3's C1: optimi's Triton kernel starts each block at program_id * 1024 in int32, so a flat ZeRO
    partition of 2**31 elements or more (SDXL full on one rank; Qwen-Image full on up to 9) would be stepped 4 GiB
    below itself. The partition is computed, not allocated: past the kernel's reach the run is built with optimi's
    torch loop (triton=False), said and recorded; below it, or where no flat partition exists, optimi chooses."""
    import numpy as np

    from ds_trainer.config.checks.resolve import TRITON_MAX_NUMEL, flat_partition
    from ds_trainer.train.optim import build
    from ds_trainer.train.state import kahan

    def last_block_start(numel: int) -> int:  # the kernel's `pid * BLOCK_SIZE` for its last block, in int32
        with np.errstate(over="ignore"):
            return int(np.int32(-(-numel // 1024) - 1) * np.int32(1024))

    sdxl = flat_partition(make_cfg("model=sdxl_base", "zero=stage2", "world_size=1"))
    assert sdxl == 2_567_463_684 and last_block_start(sdxl) < 0  # the wrap the loop avoids
    assert last_block_start(TRITON_MAX_NUMEL) > 0 and last_block_start(2**31 + 1) < 0  # a block of margin
    for zero in ("stage1", "stage2", "stage3"):
        loop, said = _kahan_run("model=sdxl_base", f"zero={zero}", "world_size=1")
        assert loop and "flat partition of 2,567,463,684 elements" in said and "2 or more ranks" in said, zero
        assert not _kahan_run("model=sdxl_base", f"zero={zero}", "world_size=2")[0], zero
    assert _kahan_run("model=qwen_image", "zero=stage3", "world_size=9")[0]
    assert not _kahan_run("model=qwen_image", "zero=stage3", "world_size=10")[0]
    assert not _kahan_run("model=sdxl_base", "zero=stage2", "world_size=1", "adapter=lora")[0]
    assert not _kahan_run("model=sdxl_base", "zero=fsdp_full_shard", "world_size=1")[0]  # DTensors: the loop
    on_cpu = checks.check(make_cfg("precision=bf16_pure_kahan", "model=sdxl_base", "zero=stage2",
                                   "world_size=1"))
    assert on_cpu.ok and not on_cpu.cfg.resolved.kahan_loop  # no Triton kernel there
    assert "world_size" in _refused("precision=bf16_pure_kahan", "zero=stage2", "world_size=0")

    # What the run builds from the record: optimi's loop, which steps the Kahan update; else optimi's own choice
    # (None: its Triton kernel on CUDA tensors).
    for loop in (True, False):
        cfg = checks.check(make_cfg("precision=bf16_pure_kahan", "zero=stage2")).cfg
        cfg.resolved.kahan_loop = loop
        weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        weight.grad = torch.full_like(weight, 0.5)
        optimizer = build.optimizer(cfg, [weight])
        assert optimizer.param_groups[0]["triton"] is (False if loop else None)  # None: optimi's choice
        optimizer.step()
        learned = kahan.with_compensation(weight.detach(), optimizer.state[weight][kahan.COMP])
        assert float(learned[0]) < 1.0  # the update is in the compensation: bf16 rounds it away from the weight


def test_triton_without_a_c_compiler_or_pythons_headers_is_refused_on_cuda(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """Review 3's P3: Triton builds its kernels' launcher with a C compiler and Python's headers at
    their first use, on CUDA too: a compiled run, or DeepSpeed's Muon, on a runtime-only image is
    refused before its cache build, naming what is missing, and only where Triton runs."""
    import sysconfig

    def said(*overrides: str) -> str:
        report = checks.check(make_cfg("platform=cuda", *overrides), info=GPU)
        return " | ".join(f"{p.key}: {p.why} fix: {p.fix}" for p in report.problems)

    compiled = ("zero=fsdp_full_shard", "train.compile=blocks")
    muon = ("optimizer=muon", "adapter=lora", "zero=stage2")
    assert "C compiler" not in said(*compiled) and "C compiler" not in said(*muon)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    refused = said(*compiled)
    assert "train.compile: Triton builds" in refused and "CC names (/nonexistent/cc)" in refused
    assert "apt-get install gcc python3-dev" in refused and "train.compile=none" in refused
    assert "optimizer.name: Triton builds" in said(*muon)
    assert "Triton builds" not in said("zero=fsdp_full_shard")  # nothing compiled
    # optimi's Kahan kernel: Triton only where it is installed (else optimi's loop, which needs none)
    has_triton = importlib.util.find_spec("triton") is not None
    kahan = said("precision=bf16_pure_kahan", "zero=stage2")
    assert ("precision: Triton builds" in kahan) == has_triton, kahan
    assert "Triton builds" not in checks.check(make_cfg(*compiled)).render()  # the CPU's own rule
    monkeypatch.delenv("CC")
    include = {**sysconfig.get_paths(), "include": str(tmp_path)}  # a runtime-only image's Python
    monkeypatch.setattr(sysconfig, "get_paths", lambda *_a, **_k: include)
    assert "lacks Python's headers (Python.h)" in said(*compiled)
