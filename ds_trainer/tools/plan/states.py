"""The planner's model states: parameters, gradients and optimizer state per rank (DeepSpeed's own accounting,
FSDP2's and DDP's), what the optimizer keeps fewer than Adam's moments, and a checkpoint's bytes on disk."""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig

from ds_trainer.tools.plan import cache, lora
from ds_trainer.tools.plan.unet import UNetStats, unet_stats


def architecture(cfg: DictConfig) -> str:
    """The folder of the trained module's architecture (the pretrained model's, or the config's own)."""
    return str(cfg.model.pretrained or cfg.model.architecture)


def stats(cfg: DictConfig) -> UNetStats:
    """The trained module's parameter counts, remembered on disk (cache.py)."""
    return UNetStats(*cache.cached("unet_stats", (architecture(cfg),),
                                   lambda a: list(dataclasses.astuple(unet_stats(a)))))


def trained_module(cfg: DictConfig, unet_params: int) -> tuple[int, int]:
    """(frozen, trained) parameters of the module the backend wraps: the UNet (its LoRA's frozen base and adapters),
    and the text encoders that train with it (text_encoders=lora|full: their frozen base and what trains; their
    activations: `lora.encoder_activations`)."""
    adapters = lora.trainable(cfg, architecture(cfg))
    frozen, trained = (unet_params, adapters) if adapters is not None else (0, unet_params)
    te_frozen, te_trained = lora.encoders(cfg, architecture(cfg))
    return frozen + te_frozen, trained + te_trained


def model_states(zero: str, offload: str, p: int, layer: int, n: int, params_offload: bool,
                 precision: str) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, host) bytes per rank; sums match DeepSpeed's estimators. precision=bf16_pure:
    bf16 masters, gradients and Adam moments (DeepSpeed: 2 + 2 + 2 + 4 = 10 bytes a parameter instead of 16;
    FSDP: bf16 parameters are the masters, 2 + 2 + 4 = 8)."""
    half = 2 if precision != "fp32" else 4
    pure = precision == "bf16_pure"
    if zero.startswith("fsdp"):
        # FSDP2 with Accelerate's fp32 sharded parameters (the masters), gradients reduce-scattered into fp32
        # shards, Adam's moments sharded: 16P/N (bf16_pure: bf16 shards, 8P/N). Full shard gathers one unit at a
        # time in the compute dtype (and prefetches the next); shard-grad-op keeps every unit gathered from forward
        # to backward.
        shard, moments = (2, 4) if pure else (4, 8)
        if offload != "none":  # CPUOffloadPolicy: parameters, gradients and optimizer state on the host
            return 2 * half * layer, 0, 0, int(p * (2 * shard + moments) * 1.5)
        gathered = 2 * half * layer if zero == "fsdp_full_shard" else half * p
        return gathered + shard * p // n, shard * p // n, moments * p // n, 0
    if zero == "ddp":
        # fp32 weights, gradients (DDP's buckets are the gradients: Accelerate is given gradient_as_bucket_view)
        # and Adam's moments; under 16-bit autocast a 16-bit copy of every weight lives through backward.
        return 4 * p + (0 if precision == "fp32" else 2 * p), 4 * p, 8 * p, 0
    stage = int(zero[-1])
    # The optimizer's own bytes a parameter (masters + moments), the partitioned gradient beside the 16-bit one
    # (fp32 unless bf16_pure), and the host's share of all model states under offload.
    state, grad, host_state = (2 + 4, 2, 10) if pure else (4 + 8, 2 + 4, 16)
    if stage in (0, 1, 2):
        ranks = 1 if stage == 0 else n
        if offload == "none":
            full_grads = 2 * p - 2 * p // ranks if stage == 1 else 0
            return half * p, grad * p // ranks + full_grads, state * p // ranks, 0
        host = int(p * max(4 * n, host_state) * 1.5)
        return half * p, 0, 0, host
    gathered = 4 * layer
    if offload == "none":
        return gathered + 2 * p // n, (2 if pure else 4) * p // n, state * p // n, 0
    if not params_offload:
        return gathered + 2 * p // n, 0, 0, int(p * host_state * 1.5)
    return gathered, 0, 0, int(p * (host_state + 2) * 1.5)


# fp32 tensors an optimizer keeps per trained parameter (Adam's two moments, Lion's and Adagrad's one).
_MOMENTS = {"adam": 2, "adamw": 2, "adamw_torch": 2, "lamb": 2, "muon": 2, "lion": 1, "adagrad": 1,
            "schedule_free_adamw": 2}  # schedule-free: z and the second moment


def _moment_tensors(cfg: DictConfig, name: str) -> float:
    """fp32 tensors of a parameter's size the optimizer keeps per trained parameter (Prodigy: Adam's two, and its
    starting weights and sum on every slice_p-th element)."""
    if name == "prodigy":
        return 2 + 2 / max(1, int(cfg.optimizer.slice_p))
    return _MOMENTS.get(name, 2)
# bitsandbytes' 8-bit AdamW: two uint8 moments and an fp32 absmax per block of 256 of each.
_BYTES_8BIT = 2 + 2 * 4 / 256


# precision.weight_update=kahan: optimi's bf16 compensation buffer, one per trained parameter.
_KAHAN_BYTES = 2


def moments_saved(cfg: DictConfig, zero: str, trained: int, world_size: int) -> int:
    """Bytes per rank the config's optimizer keeps fewer than Adam's moments (which the model states count: 8 bytes
    a trained parameter, 4 under bf16_pure), sharded as the optimizer state is; negative where it keeps more
    (precision.weight_update=kahan's compensation)."""
    from ds_trainer.config import optimizers

    name = optimizers.resolve(cfg.optimizer.name)[0] or "adamw"
    adam = 4 if cfg.precision.name.value == "bf16_pure" else 8
    kept = _BYTES_8BIT if name == "adamw8bit" else adam * _moment_tensors(cfg, name) / 2
    kept += _KAHAN_BYTES if cfg.precision.weight_update.value == "kahan" else 0  # (more than Adam's: a negative saving)
    ranks = 1 if zero in ("ddp", "stage0") else world_size
    return int((adam - kept) * trained) // ranks


def checkpoint_bytes(cfg: DictConfig) -> tuple[int, int]:
    """(one checkpoint, the export at the end) in bytes on disk, all ranks together. A checkpoint holds
    DeepSpeed's files (16-bit weights of the whole UNet; fp32 masters and moments of what is trained) and the
    portable state (fp32 weights and moments), and the EMA when on. Measured on sdxl_tiny (5.4M parameters,
    bf16, AdamW): 2.0 + 12.0 + 12.0 bytes a parameter, as counted here."""
    from ds_trainer.config import optimizers, weights_file

    module = stats(cfg)
    _, trained = trained_module(cfg, module.params)
    encoders = sum(lora.encoders(cfg, architecture(cfg)))  # trained text encoders: in the engine's files too
    fp32 = cfg.precision.name.value == "fp32" or cfg.zero.backend.value == "ddp"
    pure = cfg.precision.name.value == "bf16_pure"  # bf16 masters and moments: no separate fp32 copy
    name = optimizers.resolve(cfg.optimizer.name)[0] or "adamw"
    moments = _BYTES_8BIT if name == "adamw8bit" else (2 if pure else 4) * _moment_tensors(cfg, name)
    moments += _KAHAN_BYTES if cfg.precision.weight_update.value == "kahan" else 0
    engine = int((4 if fp32 else 2) * (module.params + encoders) + ((0 if fp32 or pure else 4) + moments) * trained)
    # The portable state: fp32 weights, and fp32 Adam moments for the optimizers whose moments it holds.
    portable = (4 + (8 if name in (*optimizers.FP32_MOMENTS, "adamw8bit") else 0)) * trained  # 8-bit: dequantized
    ema = 4 * trained if cfg.train.ema else 0
    export = 4 * (module.params + encoders) * (2 if cfg.train.ema else 1)
    if cfg.model.about.tiny or weights_file.is_single_file(cfg.model.pretrained):
        export += 4 * module.params  # the whole pipeline's own UNet or transformer (its encoders and VAE not counted)
    return engine + portable + ema, (export if cfg.train.export else 0)
