"""The `optimizer` group against the backend, the offload, the scheduler and this machine: what DeepSpeed has, what
ds_trainer builds itself, and where each can run. Torch-free, read-only.
"""

from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from ds_trainer.config import ds_config, hardware, optimizers, toolkit
from ds_trainer.config.checks import resolve
from ds_trainer.config.problems import Problem

# bitsandbytes' 8-bit kernels (the CUDA optimizer step, quantize_blockwise) take a tensor's element count as a C int.
EIGHT_BIT_MAX_NUMEL = 2**31 - 1

# Schedules that lower the LR over the run: schedule-free's average is what they would buy, and its weighting assumes
# the LR stays at its peak after warm-up.
DECAYING_SCHEDULES = ("warmup_decay", "warmup_cosine", "one_cycle")


def problems(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """The optimizer's name and where it runs, then the fused CUDA kernel it compiles."""
    return _optimizer(cfg, info) + _cuda_ops(cfg, info)


def _optimizer(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    name = cfg.resolved.optimizer
    label = optimizers.FACTORED.get(optimizers.normalize(cfg.optimizer.name)) if name is None else None
    if label is not None:
        why = (f"{label} is a factored optimizer (row and column statistics per weight): ZeRO >= 1 hands an "
               "optimizer flat 1-D partitions, where the factorisation is lost (the full second moment comes back) and "
               "per-tensor scaling becomes per-partition, and FSDP splits each weight's rows over the ranks; "
               "ds_trainer does not offer it")
        return [Problem("optimizer.name", cfg.optimizer.name, why, "optimizer=adamw8bit (2 bytes a parameter of "
                        "state), or precision=bf16_pure (bf16 Adam state), or offload=cpu")]
    if name is None:
        known = ", ".join(optimizers.known())
        return [Problem("optimizer.name", cfg.optimizer.name, "neither ds_trainer nor the installed DeepSpeed has "
                        f"such an optimizer (known: {known}; the 1-bit optimizers of older docs are gone)",
                        "optimizer=adamw (or optimizer.name=<one of the above>)")]
    if optimizers.is_client(name):
        return _client_optimizer(cfg, name, info)
    if cfg.zero.backend.value in ("ddp", "fsdp") and name not in ("adam", "adamw", "adagrad"):
        return [Problem("optimizer.name", name, f"zero={ds_config.zero_option(cfg)} runs torch.optim, which has "
                        "adam, adamw and adagrad", "optimizer=adamw, or a DeepSpeed stage such as zero=stage2")]
    return _deepspeed_optimizer(cfg, name, info)


def _deepspeed_optimizer(cfg: DictConfig, name: str, info: hardware.PlatformInfo) -> list[Problem]:
    """An optimizer named in DeepSpeed's JSON: a CPU kernel to offload it, CUDA for its fused kernels, muP, Muon.
    (Under DDP and FSDP the same name is torch's Adam, AdamW or Adagrad, which asks for nothing more.)"""
    optimizer_on, out = ds_config.placement(cfg)[0], []
    if cfg.zero.backend.value == "deepspeed" and optimizer_on != "gpu" and name not in optimizers.CPU_OFFLOAD_CAPABLE:
        capable = ", ".join(sorted(optimizers.CPU_OFFLOAD_CAPABLE))
        out.append(Problem("optimizer.name", name, f"DeepSpeed has no CPU implementation of {name}, needed to "
                           f"offload its state (it has: {capable})", "optimizer=adamw, or offload=none"))
    if name in optimizers.CUDA_KERNEL and info.kind != "cuda" and (name == "lamb" or optimizer_on == "gpu"):
        fix = "optimizer=adamw" if name == "lamb" else "offload=cpu (DeepSpeed's CPU Lion), or optimizer=adamw"
        out.append(Problem("optimizer.name", name, f"DeepSpeed's fused {name} kernel runs on CUDA only; this machine "
                           f"is {info.kind}", fix))
    if name in optimizers.MUP:
        out.append(Problem("optimizer.name", name, "muP optimizers need mup's set_base_shapes on a width-scaled "
                           "model family; SDXL's UNet is not one", "optimizer=adamw"))
    return out + (_muon(cfg) if name == "muon" else [])


def _muon(cfg: DictConfig) -> list[Problem]:
    """DeepSpeed's Muon (0.19.8) on what ds_trainer trains: measured on every stage with the tiny SDXL."""
    out = []
    if cfg.adapter.method.value == "none":
        out.append(Problem("optimizer.name", "muon", "DeepSpeed's Muon gives every weight of two or more dimensions "
                           "its orthogonalized update, and that update fails on the UNet's 4-D convolution weights "
                           "(a full UNet stops before its first step under every ZeRO stage); LoRA's adapters are "
                           "matrices and train with it", "adapter=lora, or optimizer=adamw"))
    if int(cfg.zero.stage) == 3 and bool(cfg.zero.reduce_scatter):
        out.append(Problem("zero.reduce_scatter", True, "DeepSpeed's ZeRO-3 runs Muon only without reduce-scatter "
                           "(it needs each full gradient to orthogonalize it)", "zero.reduce_scatter=false"))
    return out


def _client_optimizer(cfg: DictConfig, name: str, info: hardware.PlatformInfo) -> list[Problem]:
    """An optimizer ds_trainer builds (torch's AdamW, bitsandbytes' AdamW8bit, Prodigy, schedule-free AdamW): it
    runs where its state lives and as its maths needs, or the run is refused; never replaced by another (Accelerate
    would put DeepSpeed's CPU Adam in under offload)."""
    package, out = optimizers.CLIENT_PACKAGE.get(name), []
    if package is not None and importlib.util.find_spec(package[0]) is None:
        out.append(Problem("optimizer.name", name, f"needs the {package[0]} package, which is not installed",
                           f"{package[1]} (the README's setup installs it), or optimizer=adamw"))
    if ds_config.placement(cfg)[0] == "nvme" and name not in optimizers.KAHAN_OPTIMIZERS:  # (kahan: backend's rule)
        out.append(Problem("offload", "nvme", f"DeepSpeed swaps only its own optimizers' state to NVMe; {name} is "
                           "built by ds_trainer", "offload=cpu, or optimizer=adamw (DeepSpeed's CPU Adam swaps)"))
    if name == "adamw8bit" and cfg.zero.backend.value == "fsdp":
        out.append(Problem("optimizer.name", name, "bitsandbytes' 8-bit state is not built for FSDP2's DTensor "
                           "shards", "zero=stage3 (ZeRO shards it as flat partitions), or optimizer=adamw"))
    if name == "adamw8bit":
        out += _eight_bit_partition(cfg)
    return out + (_global_state_optimizer(cfg, name, info) if name in optimizers.GLOBAL_STATE else [])


def _eight_bit_partition(cfg: DictConfig) -> list[Problem]:
    """Under ZeRO-1/2 DeepSpeed hands a client optimizer one flat tensor per parameter group and rank (ZeRO-3 one
    per sub-group): past 2**31 - 1 elements bitsandbytes' count wraps negative and its CUDA step launches with a
    negative size. A full SDXL UNet (2.57 B) on one rank is past it; LoRA's adapters are far below."""
    if cfg.zero.backend.value != "deepspeed" or cfg.adapter.method.value != "none":
        return []
    stage, world, count = int(cfg.zero.stage), resolve.world_size_of(cfg), int(cfg.model.param_count)
    if stage == 3 and int(cfg.zero.sub_group_size) > EIGHT_BIT_MAX_NUMEL:
        return [Problem("zero.sub_group_size", int(cfg.zero.sub_group_size), "ZeRO-3 hands optimizer.name=adamw8bit "
                        "one flat tensor per sub-group, and bitsandbytes' 8-bit kernels count its elements in a "
                        f"32-bit int (at most {EIGHT_BIT_MAX_NUMEL:,})", "zero.sub_group_size=1000000000")]
    partition = -(-count // world)
    if stage not in (1, 2) or partition <= EIGHT_BIT_MAX_NUMEL:
        return []
    ranks = -(-count // EIGHT_BIT_MAX_NUMEL)
    return [Problem("optimizer.name", "adamw8bit", f"under ZeRO-{stage} each rank's optimizer steps one flat "
                    f"partition of the trained weights: {partition:,} elements of {cfg.model.name}'s {count:,} on "
                    f"each of {world} rank(s), past the {EIGHT_BIT_MAX_NUMEL:,} bitsandbytes' 8-bit kernels count "
                    "in (a 32-bit int: the step would launch with a negative size)",
                    f"{ranks} or more ranks (world_size), or zero=stage3 (sub-groups of zero.sub_group_size), or "
                    "zero=ddp, or optimizer=adamw")]


def _global_state_optimizer(cfg: DictConfig, name: str, info: hardware.PlatformInfo) -> list[Problem]:
    """Prodigy and schedule-free keep state per step, not per element (see `optimizers.GLOBAL_STATE`); `resolve`
    gives them one ZeRO-3 sub-group."""
    stage, world = int(cfg.zero.stage), resolve.world_size_of(cfg)
    if cfg.zero.backend.value == "fsdp":
        return [Problem("optimizer.name", name, "ds_trainer reads its state and (schedule-free) computes its "
                        "evaluation weights from ZeRO's partitions or whole torch parameters; FSDP2's DTensor "
                        "shards are not among them", f"zero=stage2 or zero=stage3 with optimizer={name}, or "
                        "optimizer=adamw with FSDP")]
    out = []
    if name == "prodigy" and resolve.partitioned_over_ranks(cfg) and info.kind != "cuda":
        out.append(Problem("optimizer.name", name, f"Prodigy's step size d sums over every trained parameter; "
                           f"under ZeRO-{stage} each of the {world} ranks holds only its partition, and "
                           "prodigyopt's all-reduce that joins the sums (fsdp_in_use) runs on CUDA only; this "
                           f"machine is {info.kind}", "zero=stage0 or zero=ddp (every rank holds every "
                           "parameter), one rank, or optimizer=adamw"))
    if name == "prodigy" and resolve.partitioned_over_ranks(cfg) and info.kind == "cuda" and \
            ds_config.placement(cfg)[0] == "cpu":
        out.append(Problem("offload", cfg.offload.device.value, f"Prodigy on {world} ranks under ZeRO-{stage} "
                           "all-reduces the sums behind its step size d on the GPU and keeps d as a CUDA scalar; "
                           "the offloaded optimizer steps CPU partitions, which cannot take a CUDA operand (the "
                           "first step fails)", "offload=none, or zero=stage0 or zero=ddp, or one rank, or "
                           "optimizer=adamw"))
    if name == "schedule_free_adamw" and cfg.scheduler.name.value in DECAYING_SCHEDULES:
        out.append(Problem("scheduler", cfg.scheduler.name.value, "schedule-free AdamW replaces a decaying schedule "
                           "(its averaged weights are what the decay would buy) and weights its average by the peak "
                           "LR, which a decay below it breaks", "scheduler=warmup (warm-up, then constant) or "
                           "scheduler=constant"))
    return out


def _cuda_ops(cfg: DictConfig, info: hardware.PlatformInfo) -> list[Problem]:
    """A GPU-resident DeepSpeed optimizer compiles its fused CUDA kernel at the first step: without a CUDA toolkit
    that matches torch that step fails. Lamb and Lion have no unfused twin and are refused (Adam's fallback to
    torch's AdamW is `resolve`'s)."""
    optimizer = cfg.resolved.optimizer
    op = resolve.fused_kernel(cfg, optimizer, info)
    if op is None or op == "fused_adam":
        return []
    kit = toolkit.probe()
    if kit.can_compile(op):
        return []
    fix = kit.fix() + ", or optimizer=adamw" + (" or offload=cpu (DeepSpeed's C++ CPU Lion)" if optimizer == "lion"
                                                  else "")
    return [Problem("optimizer.name", optimizer, f"DeepSpeed compiles its fused {optimizer} kernel ({op}) with "
                    f"nvcc at the first step, and cannot here: {kit.problem}", fix)]

