"""`accelerate_config.yaml`: the Accelerate launcher's config file for a run. Torch-free, and it does not
import `accelerate` either: it writes the YAML `accelerate launch --config_file` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

# precision group -> Accelerate's mixed_precision
MIXED_PRECISION = {"bf16": "bf16", "bf16_pure": "bf16", "fp16": "fp16", "fp32": "no"}


def mixed_precision(cfg: DictConfig) -> str:
    """Accelerate's mixed_precision for the run. FSDP with bf16_pure: "no", or Accelerate would cast the bf16
    parameters to fp32 masters before sharding (the model is bf16 already: it computes in bf16)."""
    if cfg.precision.name.value == "bf16_pure" and cfg.zero.backend.value == "fsdp":
        return "no"
    return MIXED_PRECISION[cfg.precision.name.value]


def config_file(cfg: DictConfig, ds_json: Path | None, world_size: int) -> dict[str, Any]:
    """The content of `accelerate_config.yaml`: usable as is with `accelerate launch --config_file`.

    DeepSpeed runs point at the written `ds_config.json` and carry none of the fields Accelerate
    refuses next to a config file (stage, offload, accumulation, clipping, mixed precision: the JSON
    has them all). `use_cpu` stays false for DeepSpeed, which would otherwise bypass its launcher;
    DeepSpeed picks its CPU accelerator by itself.
    """
    on_cpu = cfg.resolved.platform == "cpu"
    deepspeed = cfg.resolved.backend == "deepspeed"
    fsdp = cfg.resolved.backend == "fsdp"
    if deepspeed:
        distributed_type = "DEEPSPEED"
    elif fsdp:
        distributed_type = "FSDP"  # on a CPU-only machine ds_trainer itself turns it into FSDP on gloo
    elif world_size > 1:
        # Accelerate starts N local processes (torchrun) only for the GPU types; its MULTI_CPU type
        # wants mpirun. On a CPU-only machine ds_trainer asks Accelerate for the CPU (gloo) itself.
        distributed_type = "MULTI_GPU"
    else:
        distributed_type = "NO"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": distributed_type,
        "num_machines": 1,
        "num_processes": int(world_size),
        "machine_rank": 0,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": on_cpu and world_size == 1 and not deepspeed and not fsdp,
        "downcast_bf16": "no",
        "debug": False,
    }
    if fsdp:
        meaning = cfg.resolved.fsdp
        out["mixed_precision"] = mixed_precision(cfg)
        # Every field FSDP2 reads, explicit (a field left out is read from FSDP_* variables). The reduce dtype
        # has no key here; ds_trainer sets it in the plugin it builds (config.yaml: resolved.fsdp).
        out["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": bool(meaning.reshard_after_forward),
            "fsdp_offload_params": cfg.offload.device.value == "cpu",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": ",".join(meaning.units),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": False,
        }
    elif not deepspeed:
        out["mixed_precision"] = mixed_precision(cfg)
    else:
        assert ds_json is not None
        out["deepspeed_config"] = {
            "deepspeed_config_file": str(ds_json.resolve()),
            "zero3_init_flag": int(cfg.zero.stage) == 3,
        }
    return out
