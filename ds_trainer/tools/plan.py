"""Memory planner: before a run, which ZeRO stage and offload fit, per rank, and why.

    python -m ds_trainer.plan resolution=px1024 train.micro_batch_size=8 [plan.vram_gib=24]

Takes the same overrides as training. For every zero x offload cell it estimates the peak GPU memory
per rank (torch's allocated bytes: parameters, gradients, optimizer state, activations, DeepSpeed's
buffers), host RAM and NVMe bytes, marks what fits `plan.vram_gib` (default: the detected GPU) and
recommends the cheapest cell that fits (each higher stage or offload costs speed).

Method, per part (bytes; P = UNet parameters, N = ranks, L = largest layer's parameters):
- model states: DeepSpeed's own accounting, split into parts whose sums equal
  `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` (a test checks):
  stage 0-2 no offload 2P + 18P/N (stage 1 keeps full 16-bit gradients: + 2P - 2P/N), stage 1-2 with
  offload 2P, stage 3 4L + 18P/N, 4L + 2P/N (optimizer offloaded), 4L (parameters offloaded too);
  DDP keeps fp32 weights, gradients and AdamW state: 16P. fp32 precision doubles the 16-bit parts.
- activations: counted, not guessed: the UNet runs forward on the meta device (no memory, no
  download) under autograd's saved-tensor hooks, which see every tensor kept for backward. Attention
  is counted as memory-efficient kernels store it (q, k, v, output, log-sum-exp), not as the full
  attention matrix. With gradient checkpointing: what is saved across checkpointed blocks plus the
  largest block's own activations, recomputed one at a time in backward.
- DeepSpeed buffers: stage 1-2 reduce + allgather buckets (x4.5 with overlap_comm, DeepSpeed's rule of
  thumb), stage 3 prefetch + reduce buckets, in 16-bit elements.
- host RAM: offloaded optimizer state (DeepSpeed's estimate, x1.5 buffer factor) and pinned NVMe swap
  buffers; NVMe bytes: the ZeRO-3 swap estimate of `nvme.swap_bytes`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import buckets, nvme
from ds_trainer.tools import plan_cache, plan_lora, plan_samples
from ds_trainer.tools.plan_unet import (  # noqa: F401 (unet_inputs: imported from here by callers)
    UNetStats,
    blocks_of,
    forward_of,
    meta_unet,
    saved_bytes,
    text_tokens,
    unet_inputs,
    unet_stats,
)

GIB = 2**30
CELLS = [("ddp", "none"), ("stage0", "none"), ("stage1", "none"), ("stage2", "none"), ("stage3", "none"),
         ("stage1", "cpu"), ("stage2", "cpu"), ("stage3", "cpu"), ("stage3", "nvme")]
# PyTorch FSDP2's counterparts, printed after the ZeRO cells (recommended only when no ZeRO cell fits).
FSDP_CELLS = [("fsdp_shard_grad_op", "none"), ("fsdp_full_shard", "none"), ("fsdp_full_shard", "cpu")]


@dataclass
class Estimate:
    """Peak memory of one cell, per rank, in bytes."""

    zero: str
    offload: str
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    host: int
    nvme: int
    notes: list[str] = field(default_factory=list)
    # With samples=on or validation=on: the peak while sampling or validating (plan_samples), which may exceed
    # training's.
    sampling: int | None = None

    @property
    def gpu(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@cache  # a pure function of its arguments; the tuner asks for the same few shapes many times
def activation_bytes(architecture: str, batch: int, width: int, height: int, dtype_bytes: int,
                     checkpointing: bool, cross_dim_tokens: int = 77) -> int:
    """Bytes autograd keeps for backward in one forward of the trained module, a UNet or a transformer (see the module
    docstring); `cross_dim_tokens`: the text tokens it attends to."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its note on casting with .to() concerns real weights, not meta
    try:
        unet = meta_unet(architecture).to(dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    unet.train()
    unet.disable_gradient_checkpointing()
    forward = forward_of(unet, batch, height, width, dtype, "meta", cross_dim_tokens)
    return saved_bytes(unet, blocks_of(unet), forward, checkpointing, block_inputs=hasattr(unet, "transformer_blocks"))


def _model_states(zero: str, offload: str, p: int, layer: int, n: int, params_offload: bool,
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


def _architecture(cfg: DictConfig) -> str:
    return str(cfg.model.pretrained or cfg.model.architecture)


def _tokens(cfg: DictConfig) -> tuple[int, ...]:
    """The text tokens of a transformer (plan_unet.text_tokens) as part of the activations' cache key; SDXL's key
    has none (its 77)."""
    return (text_tokens(cfg),) if cfg.model.get("flow") is not None else ()


def _trained_module(cfg: DictConfig, unet_params: int) -> tuple[int, int]:
    """(frozen, trained) parameters of the module the backend wraps: the UNet (its LoRA's frozen base and adapters),
    and the text encoders that train with it (text_encoders=lora|full: their frozen base and what trains; their
    activations: `plan_lora.encoder_activations`)."""
    lora = plan_lora.trainable(cfg, _architecture(cfg))
    frozen, trained = (unet_params, lora) if lora is not None else (0, unet_params)
    te_frozen, te_trained = plan_lora.encoders(cfg, _architecture(cfg))
    return frozen + te_frozen, trained + te_trained


def estimate(cfg: DictConfig, zero: str, offload: str, world_size: int, activation_factor: float = 1.0) -> Estimate:
    """The estimate of one zero x offload cell for the composed config; `activation_factor` is the
    calibration from measured cells (tools/calibration.py)."""
    stats = UNetStats(*plan_cache.cached("unet_stats", (_architecture(cfg),),
                                         lambda a: list(dataclasses.astuple(unet_stats(a)))))
    precision = cfg.precision.name.value
    params_offload = cfg.offload.params is not False
    frozen, trained = _trained_module(cfg, stats.params)
    if not frozen:
        params, grads, optimizer, host = _model_states(zero, offload, trained, stats.largest_layer, world_size,
                                                       params_offload, precision)
    else:
        params, grads, optimizer, host = plan_lora.model_states(zero, offload, frozen, trained, stats.largest_layer,
                                                                world_size, params_offload, precision)
    saved = _moments_saved(cfg, zero, trained, world_size)
    if offload != "none" and zero not in ("ddp", "stage0"):
        host = max(0, host - int(saved * 1.5))  # the state lives on the host (as counted above, with its margin)
    else:
        optimizer = max(0, optimizer - saved)
    if cfg.train.ema and cfg.train.ema_device == "gpu":
        params += 4 * trained // world_size  # the fp32 shadow, a slice per rank (train/ema.py)
    if not cfg.data.cache:  # the VAE and text encoders stay on the GPU and encode every batch
        params += plan_samples.frozen_bytes(_architecture(cfg), "cuda", precision)
    act_bytes = 4 if precision == "fp32" else 2
    width, height = buckets.largest(cfg)  # with aspect-ratio buckets the largest one bounds memory
    shape = (_architecture(cfg), int(cfg.train.micro_batch_size), width, height, act_bytes,
             bool(cfg.train.gradient_checkpointing))
    activations = plan_cache.cached("activation_bytes", shape + _tokens(cfg), activation_bytes)
    activations = int((activations + plan_lora.encoder_activations(cfg, _architecture(cfg), act_bytes))
                      * activation_factor)
    z = cfg.zero
    buffers = 0
    if zero in ("stage1", "stage2"):
        buffers = 2 * (int(z.reduce_bucket_size) + int(z.allgather_bucket_size))
        buffers = int(buffers * (4.5 if z.overlap_comm else 1.0))
        buffers = min(buffers, 2 * (2 * trained))  # never more than the gradients they carry
    elif zero == "stage3":
        buffers = min(2 * (int(z.stage3_prefetch_bucket_size) + int(z.reduce_bucket_size)), 4 * stats.params)
    nvme_bytes, notes = 0, []
    if offload == "nvme" and zero == "stage3":
        nvme_bytes = nvme.swap_bytes(stats.params, "adamw", params_offload, act_bytes) // world_size
        count, size = nvme.buffers(stats.largest_layer, int(z.stage3_prefetch_bucket_size))
        host = count * size * act_bytes * (2 if params_offload else 1)
    elif offload == "nvme":
        notes.append("below stage 3 NVMe offload keeps the optimizer state in host memory")
    sampling = plan_samples.peak(cfg, params + grads + optimizer + buffers, stats.params, _architecture(cfg))
    return Estimate(zero, offload, params, grads, optimizer, activations, buffers, host, nvme_bytes, notes, sampling)


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


def _moments_saved(cfg: DictConfig, zero: str, trained: int, world_size: int) -> int:
    """Bytes per rank the config's optimizer keeps fewer than Adam's moments (which the model states count: 8 bytes
    a trained parameter, 4 under bf16_pure), sharded as the optimizer state is."""
    from ds_trainer.config import optimizers

    name = optimizers.resolve(cfg.optimizer.name)[0] or "adamw"
    adam = 4 if cfg.precision.name.value == "bf16_pure" else 8
    kept = _BYTES_8BIT if name == "adamw8bit" else adam * _moment_tensors(cfg, name) / 2
    ranks = 1 if zero in ("ddp", "stage0") else world_size
    return int((adam - kept) * trained) // ranks


def checkpoint_bytes(cfg: DictConfig) -> tuple[int, int]:
    """(one checkpoint, the export at the end) in bytes on disk, all ranks together. A checkpoint holds
    DeepSpeed's files (16-bit weights of the whole UNet; fp32 masters and moments of what is trained) and the
    portable state (fp32 weights and moments), and the EMA when on. Measured on sdxl_tiny (5.4M parameters,
    bf16, AdamW): 2.0 + 12.0 + 12.0 bytes a parameter, as counted here."""
    from ds_trainer.config import optimizers, weights_file

    architecture = _architecture(cfg)
    stats = UNetStats(*plan_cache.cached("unet_stats", (architecture,),
                                         lambda a: list(dataclasses.astuple(unet_stats(a)))))
    _, trained = _trained_module(cfg, stats.params)
    encoders = sum(plan_lora.encoders(cfg, architecture))  # trained text encoders: in the engine's files too
    fp32 = cfg.precision.name.value == "fp32" or cfg.zero.backend.value == "ddp"
    pure = cfg.precision.name.value == "bf16_pure"  # bf16 masters and moments: no separate fp32 copy
    name = optimizers.resolve(cfg.optimizer.name)[0] or "adamw"
    moments = _BYTES_8BIT if name == "adamw8bit" else (2 if pure else 4) * _moment_tensors(cfg, name)
    engine = int((4 if fp32 else 2) * (stats.params + encoders) + ((0 if fp32 or pure else 4) + moments) * trained)
    # The portable state: fp32 weights, and fp32 Adam moments for the optimizers whose moments it holds.
    portable = (4 + (8 if name in (*optimizers.FP32_MOMENTS, "adamw8bit") else 0)) * trained  # 8-bit: dequantized
    ema = 4 * trained if cfg.train.ema else 0
    export = 4 * (stats.params + encoders) * (2 if cfg.train.ema else 1)
    if str(cfg.model.name).endswith("_tiny") or weights_file.is_single_file(cfg.model.pretrained):
        export += 4 * stats.params  # the whole pipeline's own UNet or transformer (its encoders and VAE not counted)
    return engine + portable + ema, (export if cfg.train.export else 0)


def plan(cfg: DictConfig, world_size: int, activation_factor: float = 1.0) -> list[Estimate]:
    return [estimate(cfg, zero, offload, world_size, activation_factor) for zero, offload in CELLS + FSDP_CELLS]


def describe(e: Estimate) -> str:
    """One line for the training log."""
    parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in (
        ("params", e.params), ("grads", e.grads), ("optimizer", e.optimizer), ("activations", e.activations),
        ("buffers", e.buffers)))
    return f"about {e.gpu / GIB:.2f} GiB GPU per rank ({parts} GiB), host {e.host / GIB:.2f} GiB"


def recommend(estimates: list[Estimate], budget: float) -> Estimate | None:
    """The cheapest cell that fits: CELLS is ordered from fastest to slowest."""
    return next((e for e in estimates if max(e.gpu, e.sampling or 0) <= budget), None)


def table(estimates: list[Estimate], budget: float | None) -> str:
    head = ("zero", "offload", "GPU/rank", "params", "grads", "optim", "activ", "buffers", "host RAM", "NVMe",
            "fits")
    rows: list[tuple[str, ...]] = [head]
    for e in estimates:
        fits = "" if budget is None else ("yes" if e.gpu <= budget else "no")
        rows.append((e.zero, e.offload, *(f"{v / GIB:.2f}" for v in (e.gpu, e.params, e.grads, e.optimizer,
                                                                     e.activations, e.buffers, e.host, e.nvme)),
                     fits))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def log_for_run(cfg: DictConfig, info: Any, world: int) -> None:
    """Log this run's estimate at its start (training calls it on rank 0); warn when it exceeds the GPU."""
    import logging

    from ds_trainer.config import ds_config

    log = logging.getLogger("ds_trainer")
    zero = ds_config.zero_option(cfg)
    # The effective offload: below stage 3 an NVMe request runs as cpu.
    offload = "none" if cfg.resolved.optimizer_state_on == "gpu" else (
        cfg.offload.device.value if zero == "stage3" else "cpu")
    try:
        from ds_trainer.tools import calibration

        calibrated = calibration.for_config(cfg, info)
        result = estimate(cfg, zero, offload, world, calibrated.factor)
    except Exception as exc:  # noqa: BLE001 - a plan is advice; training goes on without it
        log.warning("no memory plan for this model (%s)", exc)
        return
    at = f" at the largest bucket {buckets.name(buckets.largest(cfg))}" if buckets.enabled(cfg) else ""
    log.info("memory plan (python -m ds_trainer.plan)%s: %s; %s", at, describe(result), calibrated.describe())
    if result.sampling is not None:
        log.info("memory plan: %s", plan_samples.describe(result.sampling, result.gpu))
    total = (info.gpu_memory_mib or 0) * 2**20
    if info.kind == "cuda" and total and result.gpu > total:
        log.warning("the memory plan (%.1f GiB per rank) exceeds this GPU's %.1f GiB: expect out of memory; "
                    "`python -m ds_trainer.plan` with the same overrides shows what fits",
                    result.gpu / 2**30, total / 2**30)
    elif info.kind == "cuda" and total and (result.sampling or 0) > total:
        log.warning("training fits this GPU's %.1f GiB but sampling or validating (samples=on, validation=on) "
                    "needs about %.1f GiB per rank: expect out of memory at the first sample or validation step",
                    total / 2**30, (result.sampling or 0) / 2**30)


def main(argv: list[str] | None = None) -> int:
    """Compose the overrides like training does, print the table and the recommendation."""
    from ds_trainer.config import hardware, overrides, rundir, schema
    from ds_trainer.config.checks import resolve
    from ds_trainer.tools import calibration

    schema.register()
    rundir.register_resolvers()
    cfg = overrides.compose_checked(list(sys.argv[1:] if argv is None else argv))  # a mistake: exit 2
    info = hardware.detect(cfg.platform.value)
    if info.kind == "cuda" and cfg.plan.vram_gib is None:
        info = hardware.confirm_with_torch(info)  # torch's figure: a MIG slice's memory, not the whole card's
    world = resolve.world_size_of(cfg)
    budget_gib = cfg.plan.vram_gib if cfg.plan.vram_gib is not None else (
        info.gpu_memory_mib / 1024 * (1 - float(cfg.plan.margin)) if info.gpu_memory_mib else None)
    budget = budget_gib * GIB if budget_gib is not None else None
    calibrated = calibration.for_config(cfg, info)
    estimates = plan(cfg, world, calibrated.factor)
    size = buckets.name(buckets.largest(cfg)) + (" (largest bucket)" if buckets.enabled(cfg) else "")
    print(f"ds_trainer plan: {cfg.model.name} {size}, micro batch "
          f"{cfg.train.micro_batch_size}, {cfg.precision.name.value}, gradient checkpointing "
          f"{'on' if cfg.train.gradient_checkpointing else 'off'}, {world} rank(s); GiB per rank")
    frozen, trained = plan_lora.encoders(cfg, _architecture(cfg))
    if frozen + trained:  # the trained module is the UNet and the encoders
        act = plan_lora.encoder_activations(cfg, _architecture(cfg), 4 if cfg.precision.name.value == "fp32" else 2)
        print(f"text_encoders={cfg.text_encoders.mode.value} ({cfg.text_encoders.which.value}): {trained / 1e6:,.1f}M "
              f"encoder parameters train with the UNet, {frozen / 1e6:,.1f}M frozen in the same module; their "
              f"activations {act / 2**20:,.0f} MiB a step (in the activations column)")
    print(table(estimates, budget))
    print(calibrated.describe())
    if estimates[0].sampling is not None:
        print("samples/validation=on, GiB per rank while sampling or validating: " + ", ".join(
            f"{e.zero}/{e.offload} {(e.sampling or 0) / GIB:.2f}"
            + (" (does not fit)" if budget is not None and (e.sampling or 0) > budget >= e.gpu else "")
            for e in estimates))
    if budget is None:
        print("no GPU detected: pass plan.vram_gib=<GiB per GPU> to see what fits")
        return 0
    best = recommend(estimates, budget)
    if best is None and any(e.gpu <= budget for e in estimates):
        print(f"training fits {budget_gib:.0f} GiB but sampling or validating fits in no cell: samples.ema=false "
              "or validation.ema=false, smaller samples.width/height or validation.batch_size, or samples=none")
        return 1
    if best is None:
        print(f"nothing fits {budget_gib:.0f} GiB: lower train.micro_batch_size or the resolution, or turn on "
              "train.gradient_checkpointing=true")
        return 1
    print(f"recommended for {budget_gib:.0f} GiB: zero={best.zero} offload={best.offload} "
          f"(about {best.gpu / GIB:.1f} GiB per rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
