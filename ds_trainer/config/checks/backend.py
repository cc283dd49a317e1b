"""The `zero` and `offload` groups: what each backend can run (ZeRO's stages and offload, PyTorch FSDP2's limits,
bf16 masters). Torch-free, read-only.
"""

from __future__ import annotations

import re

from omegaconf import DictConfig

from ds_trainer.config import ds_config, hardware, optimizers, schema
from ds_trainer.config.problems import Problem

# Accelerate's first release with what backend=fsdp relies on: FSDP2 (1.6), trainable parameters cast to one dtype
# before fully_shard (1.14, #3985) and the frozen LoRA base left in its dtype (1.13, #3848).
FSDP_ACCELERATE = (1, 14)
# zero keys only DeepSpeed reads: set under backend=fsdp they would do nothing.
_DEEPSPEED_ONLY = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                   "reduce_bucket_size", "allgather_bucket_size", "round_robin_gradients",
                   "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                   "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "sub_group_size")
# Optimizers whose state precision=bf16_pure keeps in bf16 (DeepSpeed's Adam family, its CPU Adam with
# fp32_optimizer_states=False under offload; torch's AdamW on bf16 parameters under FSDP).
PURE_OPTIMIZERS = ("adam", "adamw")


def problems(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """Offload under DDP and ZeRO, then FSDP2's rules, then bf16 masters."""
    return _offload(cfg) + _fsdp(cfg, info) + _pure(cfg)


def _offload(cfg: DictConfig) -> list[Problem]:
    device, backend, stage = cfg.offload.device.value, cfg.zero.backend.value, int(cfg.zero.stage)
    if backend == "fsdp":
        return []  # its own rules (`_fsdp`)
    if backend == "deepspeed" and stage not in (0, 1, 2, 3):
        return [Problem("zero.stage", stage, "ZeRO stages are 0, 1, 2 and 3", "zero=stage2")]
    if device != "none" and (backend == "ddp" or stage == 0):
        which = "zero=ddp" if backend == "ddp" else "zero=stage0"
        return [Problem("offload", device, f"{which} has nothing to offload: offload is a ZeRO stage 1-3 feature",
                        f"zero=stage2 offload={device} (or offload=none)")]
    if cfg.offload.params is True and device != "none" and stage != 3:
        return [Problem("offload.params", True, f"parameter offload needs zero=stage3 (got zero=stage{stage})",
                        "zero=stage3, or offload.params=false")]
    return []  # offload=nvme below stage 3 runs as offload=cpu (`resolve` says so)


def _installed_version(package: str) -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        return tuple(int(part) for part in re.findall(r"\d+", metadata.version(package))[:2])
    except metadata.PackageNotFoundError:
        return None


def _fsdp(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """backend=fsdp (zero=fsdp_full_shard / fsdp_shard_grad_op): what PyTorch FSDP2 can do, asked of it."""
    if cfg.zero.backend.value != "fsdp":
        return []
    option, stage, out = ds_config.zero_option(cfg), int(cfg.zero.stage), []
    if stage not in (2, 3):
        out.append(Problem("zero.stage", stage, "FSDP shards gradients and optimizer state always, and parameters "
                           "between forward and backward with stage 3 (full shard) or not with stage 2 (shard grad "
                           "op); it has no stage 0 or 1", "zero=fsdp_full_shard or zero=fsdp_shard_grad_op"))
    version = _installed_version("accelerate")
    if version is not None and version < FSDP_ACCELERATE:
        out.append(Problem("zero", option, f"the installed accelerate {'.'.join(map(str, version))} predates what "
                           "FSDP2 training of a UNet needs (one dtype for the trainable parameters, a frozen LoRA "
                           "base left in 16 bits)", "pip install -c constraints.txt 'accelerate>=1.14'"))
    if info.kind not in ("cuda", "rocm", "cpu"):
        out.append(Problem("zero", option, f"PyTorch FSDP2 runs on CUDA/ROCm (NCCL) or the CPU (gloo), not {info.kind}",
                           "zero=ddp"))
    return out + _fsdp_settings(cfg)


def _fsdp_settings(cfg: DictConfig) -> list[Problem]:
    """The offload, precision and `zero` keys FSDP2 reads, and the DeepSpeed keys it would ignore."""
    option, stage, device, out = ds_config.zero_option(cfg), int(cfg.zero.stage), cfg.offload.device.value, []
    if device == "nvme":
        out.append(Problem("offload", "nvme", "FSDP offloads to host memory only (CPUOffloadPolicy); it has no NVMe "
                           "tier", "offload=cpu, or zero=stage3 offload=nvme (DeepSpeed swaps to disk)"))
    elif device == "cpu" and cfg.offload.params is False:
        out.append(Problem("offload.params", False, "FSDP's CPU offload is all or nothing: parameters, gradients and "
                           "the optimizer step live on the host together", "offload.params=null, or zero=stage2 "
                           "offload=cpu (DeepSpeed offloads the optimizer state alone)"))
    if cfg.precision.name.value == "fp16":
        out.append(Problem("precision", "fp16", "ds_trainer's FSDP backend trains in bf16 or fp32: fp16 needs a "
                           "gradient scaler over sharded gradients, which it does not run",
                           "precision=bf16, or zero=stage2 precision=fp16 (DeepSpeed's loss scaling)"))
    if str(cfg.zero.fsdp_reduce_dtype) not in ("fp32", "bf16"):
        out.append(Problem("zero.fsdp_reduce_dtype", cfg.zero.fsdp_reduce_dtype, "gradients are reduced in fp32 or "
                           "bf16", "zero.fsdp_reduce_dtype=fp32"))
    if not list(cfg.zero.fsdp_wrap):
        out.append(Problem("zero.fsdp_wrap", [], "with no unit below the root FSDP gathers the whole UNet at once "
                           "(no memory saved over DDP)", f"zero.fsdp_wrap=[{','.join(cfg.model.blocks)}] (the model's "
                           "blocks, the default)"))
    defaults = schema.ZeroConfig()
    for key in _DEEPSPEED_ONLY:
        if cfg.zero[key] != getattr(defaults, key):
            out.append(Problem(f"zero.{key}", cfg.zero[key], f"a DeepSpeed setting; zero={option} is PyTorch FSDP, "
                               "which does not read it", f"drop zero.{key}, or a DeepSpeed stage such as zero=stage"
                               f"{stage if stage in (2, 3) else 3}"))
    return out


def _pure(cfg: DictConfig) -> list[Problem]:
    """precision=bf16_pure: bf16 masters and optimizer state exist under ZeRO 1-3 and FSDP, for Adam's state, off
    NVMe; its Kahan-compensated update for optimi's Adam, AdamW and Lion, where a client optimizer can step DeepSpeed's
    bf16 masters. (What it costs at the run's LR is `resolve`'s warning.)"""
    kahan = cfg.precision.weight_update.value == "kahan"
    if cfg.precision.name.value != "bf16_pure":
        return [Problem("precision.weight_update", "kahan", "Kahan compensation keeps what rounding a bf16 weight "
                        f"loses; precision={cfg.precision.name.value} keeps fp32 weights (or masters), whose updates "
                        "do not round away", "precision=bf16_pure_kahan, or precision.weight_update=nearest")
                ] if kahan else []
    backend, stage, option = cfg.zero.backend.value, int(cfg.zero.stage), ds_config.zero_option(cfg)
    if backend == "ddp" or (backend == "deepspeed" and stage == 0):
        return [Problem("precision", "bf16_pure", f"bf16 master weights and optimizer state are DeepSpeed's ZeRO "
                        f"1-3 feature (bf16_master_weights_and_grads) or FSDP's bf16 parameters; zero={option} "
                        "keeps fp32 masters", "zero=stage1 (or stage2, stage3, fsdp_full_shard), or precision=bf16")]
    name, out = optimizers.resolve(cfg.optimizer.name)[0], []
    if kahan:
        return _kahan(cfg, name)
    if name is not None and name not in PURE_OPTIMIZERS:
        out.append(Problem("optimizer.name", name, f"precision=bf16_pure keeps Adam's moments in bf16 "
                           f"(bf16_optimizer_states); {name}'s state has no bf16 form in DeepSpeed (under offload its "
                           "CPU kernel stores fp32)", "optimizer=adamw, or precision=bf16"))
    if backend == "deepspeed" and ds_config.placement(cfg)[0] == "nvme":
        out.append(Problem("offload", "nvme", "DeepSpeed's NVMe swapper sizes every optimizer state as fp32; "
                           "precision=bf16_pure keeps it in bf16", "offload=cpu, or precision=bf16"))
    return out


def _kahan(cfg: DictConfig, name: str | None) -> list[Problem]:
    """precision.weight_update=kahan: optimi's twin of the named optimizer steps the bf16 weights, where DeepSpeed lets
    a client optimizer step its bf16 masters (not offloaded)."""
    out = []
    if name is not None and name not in optimizers.KAHAN:
        out.append(Problem("optimizer.name", name, "precision.weight_update=kahan steps optimi's Kahan-summed Adam, "
                           f"AdamW or Lion in place of the optimizer named; {name} has no such form",
                           "optimizer=adamw, or precision=bf16_pure (rounded updates)"))
    placed = ds_config.placement(cfg)[0]
    if cfg.zero.backend.value == "deepspeed" and placed != "gpu":
        rounded = ", or precision=bf16_pure (DeepSpeed's CPU Adam, rounded updates)" if placed == "cpu" else ""
        out.append(Problem("offload", cfg.offload.device.value, "DeepSpeed steps bf16 masters under offload only "
                           "with its own CPU Adam (it refuses any other optimizer there), and "
                           "precision.weight_update=kahan steps optimi's",
                           f"offload=none, or zero=fsdp_full_shard (FSDP2 offloads any optimizer){rounded}"))
    return out
