"""What runs, decided once before any rule reads the config. Torch-free.

The few decisions that change the configuration (DDP on a platform without DeepSpeed, torch's AdamW where
FusedAdam cannot be compiled, one ZeRO-3 sub-group for an optimizer with per-step state), each said as a warning;
the warnings about what then runs (an NVMe offload below stage 3 kept in host memory, a substituted optimizer
name, bf16 weights, Prodigy's step size); and the facts recorded under `resolved:` that the recipe, the tools and
the rules read (the world size, where the optimizer state lives, what the precision means, the NVMe swap). Every
other module of `config/checks/` only reads the config this returns.
"""

from __future__ import annotations

import copy
import os

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import ds_config, hardware, nvme, optimizers, schema, toolkit


def resolve(cfg: DictConfig, info: hardware.PlatformInfo | None = None) -> tuple[
        DictConfig, hardware.PlatformInfo, list[str]]:
    """A copy of `cfg` as it will run (fallbacks applied, `resolved:` filled in), the platform it runs on, and the
    warnings, in the order a user reads them."""
    cfg = copy.deepcopy(cfg)
    # Absolute paths: ds_config.json and accelerate_config.yaml must work from any directory.
    cfg.paths.outputs = os.path.abspath(cfg.paths.outputs)
    OmegaConf.resolve(cfg)
    cfg.offload.nvme_path = os.path.abspath(cfg.offload.nvme_path)
    info = info or hardware.detect(cfg.platform.value)
    warnings = _platform(cfg, info) + _nvme_below_stage3(cfg) + _pure(cfg)
    _, substituted = optimizers.resolve(cfg.optimizer.name)
    warnings += [substituted] if substituted else []
    optimizer = optimizers.stepping(cfg.optimizer.name, cfg.precision.weight_update.value)
    warnings += _kahan(cfg, optimizer)
    warnings += _global_state(cfg, optimizer, info) + _torch_adam(cfg, optimizer, info)
    warnings += _kahan_kernel(cfg, optimizer, info)
    optimizer_on, params_on = ds_config.placement(cfg)
    r = cfg.resolved
    r.platform, r.backend, r.world_size = info.kind, cfg.zero.backend.value, world_size_of(cfg)
    r.optimizer, r.optimizer_state_on, r.params_on = optimizer, optimizer_on, params_on
    r.nvme_swap_bytes = 0  # `size_swap`, once the rest of the config is known to run
    r.precision = precision_meaning(cfg)
    r.fsdp = fsdp_meaning(cfg) if cfg.zero.backend.value == "fsdp" else None
    r.warnings = warnings
    return cfg, info, warnings


def _platform(cfg: DictConfig, info: hardware.PlatformInfo) -> list[str]:
    """DeepSpeed runs on CUDA and the CPU only: elsewhere the run falls back to plain DDP."""
    if cfg.zero.backend.value != "deepspeed" or info.deepspeed:
        return []
    warning = (f"DeepSpeed does not run on {info.kind}: falling back to zero=ddp"
               + (f" and dropping offload={cfg.offload.device.value}" if cfg.offload.device.value != "none" else ""))
    cfg.zero.backend, cfg.zero.stage, cfg.offload.device = "ddp", 0, "none"
    return [warning]


def _nvme_below_stage3(cfg: DictConfig) -> list[str]:
    """Below stage 3 DeepSpeed keeps an NVMe-offloaded optimizer state in host memory (`ds_config.placement`)."""
    stage = int(cfg.zero.stage)
    if cfg.zero.backend.value != "deepspeed" or cfg.offload.device.value != "nvme" or stage not in (1, 2):
        return []
    return [f"offload=nvme with zero=stage{stage}: DeepSpeed swaps to disk only on stage 3; below it the optimizer "
            "state stays in host memory. Running as offload=cpu (nothing is written to offload.nvme_path). For real "
            "NVMe swap use zero=stage3."]


def _pure(cfg: DictConfig) -> list[str]:
    """precision=bf16_pure: what bf16 weights cost at the run's LR (not with precision.weight_update=kahan, whose
    compensation keeps the updates: `_kahan` says so)."""
    if cfg.precision.name.value != "bf16_pure" or cfg.precision.weight_update.value == "kahan":
        return []
    lr = float(cfg.optimizer.lr)
    # bf16 keeps 8 significant bits: round to nearest drops an update below half a unit in the last place (2^-9
    # of the weight, taken as 1/256 to allow for Adam's steps reaching a few lr). benchmarks/cpu-tiny-precision.
    return [f"precision=bf16_pure: the weights are bf16, so an update smaller than about 1/256 of a weight rounds "
            f"away; Adam steps by about optimizer.lr={lr:g}, which vanishes on every weight larger than "
            f"~{256 * lr:.2g}. Measured on the tiny model: at lr 1e-5 the loss barely moved (bf16 fell from 1.07 to "
            "0.61 over the same 400 steps). precision=bf16 keeps fp32 masters"]


def _kahan(cfg: DictConfig, optimizer: str | None) -> list[str]:
    """precision.weight_update=kahan: the named optimizer steps as optimi's Kahan-summed twin, said and recorded."""
    if cfg.precision.weight_update.value != "kahan" or optimizer not in optimizers.KAHAN_OPTIMIZERS:
        return []
    module, cls = optimizers.CLIENT_CLASS[optimizer]
    return [f"precision.weight_update=kahan: optimizer={cfg.optimizer.name} steps as {module}.{cls} with Kahan "
            f"summation (resolved.optimizer={optimizer}; built by ds_trainer, not DeepSpeed's kernel): each "
            "bf16 weight keeps a bf16 compensation of what rounding lost and gets it back at the next step, 2 bytes "
            "a trained parameter more than precision=bf16_pure"]


def _global_state(cfg: DictConfig, optimizer: str | None, info: hardware.PlatformInfo) -> list[str]:
    """Prodigy and schedule-free keep state per step, not per element (see `optimizers.GLOBAL_STATE`), and optimi's
    optimizers count steps per parameter group (`optimizers.ONE_STEP_CALL`): ZeRO-3 steps them over one sub-group;
    Prodigy's step size is said. (Under FSDP2 Prodigy and schedule-free are refused.)"""
    if not (optimizers.is_client(optimizer) and optimizer in optimizers.ONE_STEP_CALL) \
            or cfg.zero.backend.value == "fsdp":
        return []
    stage, world, lr, out = int(cfg.zero.stage), world_size_of(cfg), float(cfg.optimizer.lr), []
    if optimizer == "prodigy" and partitioned_over_ranks(cfg) and info.kind == "cuda":
        out.append(f"optimizer=prodigy on {world} ranks under ZeRO-{stage}: prodigyopt's fsdp_in_use path "
                   "all-reduces the sums behind d, so every rank steps with the same d (not run on a GPU by "
                   "ds_trainer's tests)")
    if optimizer == "prodigy" and 0 < lr < 0.1:  # lr <= 0 is refused (settings)
        out.append(f"optimizer=prodigy with optimizer.lr={lr:g}: Prodigy's lr multiplies the step size it estimates "
                   f"(1.0 takes the estimate as it is), so this trains about {1 / lr:.0f} times slower than Prodigy "
                   "would")
    one_call = 10**12
    if cfg.zero.backend.value == "deepspeed" and stage == 3 and int(cfg.zero.sub_group_size) < one_call:
        out.append(f"zero.sub_group_size raised from {int(cfg.zero.sub_group_size)} to {one_call} for "
                   f"optimizer={optimizer}: ZeRO-3 calls step() once per sub-group, and {optimizer}'s per-step state "
                   "must see every trained parameter in one call. DeepSpeed then makes the fp32 gradient of each "
                   "rank's whole partition at once at the step (4 bytes per trained parameter, divided by the "
                   "ranks)")
        cfg.zero.sub_group_size = one_call
    return out


# optimi's Triton kernels (optimi 0.3: adam.py, adamw.py, lion.py) start each block of 1024
# elements at `tl.program_id(0) * BLOCK_SIZE`, an int32: in a tensor of more than 2**31 elements
# the offsets wrap negative and the masked loads and stores land 2**31 elements below it. One
# block of margin.
TRITON_MAX_NUMEL = 2**31 - 1024


def flat_partition(cfg: DictConfig) -> int | None:
    """The elements of the largest flat tensor DeepSpeed hands a client optimizer on one rank of a
    full fine-tune: the rank's share of the trained module (ZeRO-1/2: one per parameter group;
    ZeRO-3: one per sub-group), or None where the optimizer steps the parameters themselves (DDP,
    FSDP2, ZeRO-0, an adapter's small ones)."""
    if cfg.zero.backend.value != "deepspeed" or int(cfg.zero.stage) == 0:
        return None
    if cfg.adapter.method.value != "none":
        return None
    world = max(world_size_of(cfg), 1)  # world_size=0 is refused by the settings' rule
    share = -(-int(cfg.model.param_count) // world)
    if int(cfg.zero.stage) == 3:
        return min(share, int(cfg.zero.sub_group_size))
    return share


def _kahan_kernel(cfg: DictConfig, optimizer: str | None, info: hardware.PlatformInfo) -> list[str]:
    """optimi's Kahan optimizers pick their Triton kernel on CUDA; a flat partition past its 32-bit
    indices (review 3's C1: SDXL full on one rank, Qwen-Image full on up to 9) steps with optimi's
    torch loop instead (its elementwise ops index in 64 bits), said loudly and recorded as
    resolved.kahan_loop."""
    if optimizer not in optimizers.KAHAN_OPTIMIZERS or info.kind != "cuda":
        return []
    partition = flat_partition(cfg)
    if partition is None or partition < TRITON_MAX_NUMEL:
        return []
    cfg.resolved.kahan_loop = True
    world, count = world_size_of(cfg), int(cfg.model.param_count)
    ranks = -(-count // TRITON_MAX_NUMEL)
    return [f"optimizer={cfg.optimizer.name} with precision.weight_update=kahan: each rank's "
            f"optimizer steps one flat partition of {partition:,} elements ({cfg.model.name}'s "
            f"{count:,} on {world} rank(s) under ZeRO-{int(cfg.zero.stage)}), past the "
            f"{TRITON_MAX_NUMEL:,} that optimi's Triton kernel indexes in 32-bit ints (its writes "
            "would land below the tensor). optimi steps it with its torch loop instead "
            "(resolved.kahan_loop=true, triton=False): the same update, slower, with a "
            f"transient bf16 copy of the partition at each step "
            f"({2 * partition / 2**30:.1f} GiB). {ranks} or more ranks keep the Triton kernel"]


def fused_kernel(cfg: DictConfig, optimizer: str | None, info: hardware.PlatformInfo) -> str | None:
    """The CUDA op a GPU-resident DeepSpeed optimizer compiles with nvcc at the first step, or None (an
    offloaded state steps in DeepSpeed's C++ CPU op: no nvcc needed)."""
    op = toolkit.CUDA_OPS.get(optimizer or "")
    if info.kind != "cuda" or cfg.zero.backend.value != "deepspeed" or op is None:
        return None
    return op if ds_config.placement(cfg)[0] == "gpu" else None


def _torch_adam(cfg: DictConfig, optimizer: str | None, info: hardware.PlatformInfo) -> list[str]:
    """Without a CUDA toolkit that matches torch, FusedAdam's first step fails: Adam and AdamW then run as torch's
    AdamW (the same update, unfused), said loudly and recorded. (Lamb and Lion have no such twin: a problem.)"""
    if fused_kernel(cfg, optimizer, info) != "fused_adam":
        return []
    kit = toolkit.probe()
    if kit.can_compile("fused_adam"):
        return []
    cfg.resolved.torch_adam = True
    return [f"optimizer={optimizer}: DeepSpeed's FusedAdam cannot be compiled here ({kit.problem}); using torch's "
            f"AdamW instead (ds_config `torch_adam: true`: the same update, unfused, a little slower; "
            f"optimizer=adamw_torch chooses torch's AdamW yourself, fused on CUDA). For DeepSpeed's fused kernel: "
            f"{kit.fix()}"]


def size_swap(cfg: DictConfig) -> None:
    """Record under `resolved.nvme_swap_bytes` what DeepSpeed will write to offload.nvme_path (sized, and its disk
    asked, only once the rest of the config is known to run)."""
    cfg.resolved.nvme_swap_bytes = swap_need(cfg) if "nvme" in ds_config.placement(cfg) else 0


def world_size_of(cfg: DictConfig) -> int:
    """The run's process count: `world_size` if set, else the launcher's WORLD_SIZE, else 1."""
    if cfg.world_size is not None:
        return int(cfg.world_size)
    return int(os.environ.get("WORLD_SIZE", "1"))


def partitioned_over_ranks(cfg: DictConfig) -> bool:
    """Whether each rank's optimizer sees only its partition of the trained parameters (DeepSpeed ZeRO 1-3 on more
    than one rank): what Prodigy's all-reduce of its sums is for."""
    return cfg.zero.backend.value == "deepspeed" and int(cfg.zero.stage) > 0 and world_size_of(cfg) > 1


def precision_meaning(cfg: DictConfig) -> dict[str, str]:
    """What `precision` means under the backend that runs, as `config.yaml` records it (resolved.precision): the
    dtypes of the master weights, the gradients the optimizer reads, the optimizer state, the forward/backward
    compute and the gradient reduction."""
    precision, backend = cfg.precision.name.value, cfg.zero.backend.value
    compute = {"bf16": "bf16", "bf16_pure": "bf16", "fp16": "fp16"}.get(precision, "fp32")
    if precision == "bf16_pure":  # DeepSpeed's bf16 masters, gradients, moments; FSDP's bf16 parameters
        master = gradients = state = "bf16"
    else:  # fp32 masters (DeepSpeed's, Accelerate's fp32 FSDP shards, DDP's fp32 module under autocast)
        master = state = gradients = "fp32"
    if backend == "deepspeed":  # DeepSpeed's communication_data_type left unset: the parameters' dtype
        reduce = compute
    elif backend == "fsdp":
        reduce = "fp32" if compute == "fp32" else str(cfg.zero.fsdp_reduce_dtype)
    else:
        reduce = "fp32"
    sharded = ", sharded" if backend == "fsdp" or (backend == "deepspeed" and int(cfg.zero.stage) > 0) else ""
    return {"master_weights": master + sharded, "gradients": gradients, "optimizer_state": state + sharded,
            "compute_dtype": compute, "reduce_dtype": reduce}


def _encoder_units(cfg: DictConfig) -> list[str]:
    """With trained text encoders (text_encoders=lora|full) each encoder layer is an FSDP unit too. The encoders'
    embeddings, final norms and projection stay in the root unit with the UNet's parts outside its blocks (an encoder
    model made a unit would change class, and transformers 5 finds its hidden-state recorders by class)."""
    return ["CLIPEncoderLayer"] if schema.trains_text_encoders(cfg) else []


def fsdp_meaning(cfg: DictConfig) -> dict[str, object]:
    """What backend=fsdp runs, as `config.yaml` records it: the FSDP2 fields and what the precision means."""
    meaning = precision_meaning(cfg)
    return {"fsdp_version": 2, "reshard_after_forward": int(cfg.zero.stage) == 3,
            "units": [str(name) for name in cfg.zero.fsdp_wrap] + _encoder_units(cfg),
            # precision=bf16: Accelerate casts the trainable parameters to fp32 before sharding: fp32 sharded masters
            # and Adam state (DeepSpeed's meaning of the same precision), compute in bf16. bf16_pure: the parameters
            # stay bf16 (mixed_precision "no"), and Adam's state is bf16 with them.
            "master_weights": meaning["master_weights"], "optimizer_state": meaning["optimizer_state"],
            "compute_dtype": meaning["compute_dtype"], "reduce_dtype": meaning["reduce_dtype"],
            "offload": "CPUOffloadPolicy (parameters, gradients, optimizer step on the host)"
            if cfg.offload.device.value == "cpu" else "none",
            # Every micro-batch's gradients are reduce-scattered: no full unsharded gradient kept between them.
            "sync_each_batch": True}


def swap_need(cfg: DictConfig, optimizer: str | None = None) -> int:
    """Estimated bytes DeepSpeed writes to offload.nvme_path for this config, before the margin."""
    _, params_on = ds_config.placement(cfg)
    param_bytes = 4 if cfg.precision.name.value == "fp32" else 2
    return nvme.swap_bytes(int(cfg.model.param_count), optimizer or str(cfg.resolved.optimizer or "adamw"),
                           params_on == "nvme", param_bytes)


def swap_problem(cfg: DictConfig, optimizer: str | None = None) -> str | None:
    """Why offload.nvme_path cannot take the swap (estimate x offload.free_space_margin), or None."""
    need = swap_need(cfg, optimizer)
    return nvme.check_path(str(cfg.offload.nvme_path), int(need * float(cfg.offload.free_space_margin)))
