"""The planner's estimate of each zero x offload cell: peak GPU memory per rank by part, host RAM and NVMe bytes
(the package docstring says how each part is counted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, partial

from omegaconf import DictConfig

from ds_trainer.config import buckets, families, nvme
from ds_trainer.config.source_repeats import tags_vary
from ds_trainer.tools.plan import cache as disk_cache
from ds_trainer.tools.plan import lora, quantized, samples
from ds_trainer.tools.plan.states import architecture, model_states, moments_saved, stats, trained_module
from ds_trainer.tools.plan.unet import (
    blocks_of,
    forward_of,
    is_transformer,
    meta_unet,
    saved_bytes,
    text_tokens,
    token_height,
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
    # With samples=on or validation=on: the peak while sampling or validating (samples.py), which may exceed
    # training's.
    sampling: int | None = None

    @property
    def gpu(self) -> int:
        """The peak GPU bytes per rank: every part together."""
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@cache  # a pure function of its arguments; the tuner asks for the same few shapes many times
def activation_bytes(  # noqa: PLR0913 - the disk cache's key, one argument each
        architecture: str, batch: int, width: int, height: int, dtype_bytes: int,
        checkpointing: bool, cross_dim_tokens: int = 77, frames: int = 1,
        downsample: int = 8, math_attention: bool = False) -> int:
    """Bytes autograd keeps for backward in one forward of the trained module, a UNet or a transformer (see the module
    docstring); `cross_dim_tokens`: the text tokens it attends to; `math_attention`:
    train.attention=math, whose kernel saves each attention's probabilities (unet.saved_bytes)."""
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
    forward = forward_of(unet, batch, height, width, dtype, "meta", cross_dim_tokens, frames,
                         downsample)
    return saved_bytes(unet, blocks_of(unet), forward, checkpointing,
                       block_inputs=is_transformer(architecture), math_attention=math_attention)


def _tokens(cfg: DictConfig) -> tuple[int, ...]:
    """The text tokens of a transformer (unet.text_tokens) as part of the activations' cache key,
    and a video model's frames and downsampling; SDXL's key has none (its 77)."""
    if cfg.model.get("flow") is None:
        return ()
    if not families.of(cfg).video:
        return (text_tokens(cfg),)
    frames = max(int(n) for n in cfg.data.video.frames)
    return text_tokens(cfg), frames, int(cfg.model.downsample_factor)


def _activations(cfg: DictConfig, shape: tuple[object, ...]) -> int:
    """activation_bytes of `shape` (remembered on disk) at the run's attention kernel: torch's math
    kernel (train.attention=math) keeps each attention's probabilities, the others do not."""
    if cfg.train.attention.value != "math":
        return int(disk_cache.cached("activation_bytes", shape, activation_bytes))
    measure = partial(activation_bytes, math_attention=True)
    return int(disk_cache.cached("activation_bytes/math", shape, measure))


def quantized_layers(architecture: str) -> list[tuple[int, int]]:
    """(weights, rows) of the trained module's linear layers (what quantize= holds packed), remembered on disk."""
    return [tuple(layer) for layer in disk_cache.cached(  # type: ignore[misc]
        "linear_layers", (architecture,), lambda a: quantized.linear_layers(meta_unet(a)))]


def estimate(cfg: DictConfig, zero: str, offload: str, world_size: int, activation_factor: float = 1.0) -> Estimate:
    """The estimate of one zero x offload cell for the composed config; `activation_factor` is the
    calibration from measured cells (calibration.py)."""
    module = stats(cfg)
    precision = cfg.precision.name.value
    params_offload = cfg.offload.params is not False
    frozen, trained = trained_module(cfg, module.params)
    if not frozen:
        params, grads, optimizer, host = model_states(zero, offload, trained, module.largest_layer, world_size,
                                                       params_offload, precision)
    else:
        params, grads, optimizer, host = lora.model_states(zero, offload, frozen, trained, module.largest_layer,
                                                                world_size, params_offload, precision)
    if frozen and cfg.quantize.kind.value != "none":  # the UNet's frozen linear layers as bitsandbytes holds them
        on_host = offload != "none" and (params_offload or zero.startswith("fsdp"))  # FSDP2 offloads them all
        params, host = _quantized_base(cfg, zero, on_host, params, host, world_size)
    saved = moments_saved(cfg, zero, trained, world_size)
    if offload != "none" and zero not in ("ddp", "stage0"):
        host = max(0, host - int(saved * 1.5))  # the state lives on the host (as counted above, with its margin)
    else:
        optimizer = max(0, optimizer - saved)
    if cfg.train.ema and cfg.train.ema_device == "gpu":
        params += 4 * trained // world_size  # the fp32 shadow, a slice per rank (train/ema.py)
    if not cfg.data.cache:  # the VAE and text encoders stay on the GPU and encode every batch
        params += samples.frozen_bytes(architecture(cfg), "cuda", precision, quantize=samples.encoders_quantized(cfg))
    elif tags_vary(cfg):  # tags shuffled or dropped: the text encoders stay to encode every batch's captions
        params += samples.frozen_bytes(architecture(cfg), "cuda", precision, vae=False,
                                       quantize=samples.encoders_quantized(cfg))
    act_bytes = 4 if precision == "fp32" else 2
    width, height = buckets.largest(cfg)  # with aspect-ratio buckets the largest one bounds memory
    height = token_height(cfg, height)
    shape = (architecture(cfg), int(cfg.train.micro_batch_size), width, height, act_bytes,
             bool(cfg.train.gradient_checkpointing))
    activations = _activations(cfg, shape + _tokens(cfg))
    activations = int((activations + lora.encoder_activations(cfg, architecture(cfg), act_bytes))
                      * activation_factor)
    context = int(cfg.parallel.context)
    activations //= context  # parallel.context: each rank keeps its part of the sequence's
    z = cfg.zero
    buffers = context_buffers(cfg, width, height, act_bytes)
    if zero in ("stage1", "stage2"):
        buckets_ = 2 * (int(z.reduce_bucket_size) + int(z.allgather_bucket_size))
        buckets_ = int(buckets_ * (4.5 if z.overlap_comm else 1.0))
        buffers += min(buckets_, 2 * (2 * trained))  # never more than the gradients they carry
    elif zero == "stage3":
        prefetch = 2 * (int(z.stage3_prefetch_bucket_size) + int(z.reduce_bucket_size))
        buffers += min(prefetch, 4 * module.params)
    nvme_bytes, notes = 0, []
    if offload == "nvme" and zero == "stage3":
        # Optimizer state for what trains; a frozen base (a LoRA's) swaps its 16-bit parameters at most.
        nvme_bytes = (nvme.swap_bytes(trained, "adamw", params_offload, act_bytes)
                      + (frozen * act_bytes if params_offload else 0)) // world_size
        count, size = nvme.buffers(module.largest_layer, int(z.stage3_prefetch_bucket_size))
        host = count * size * act_bytes * (2 if params_offload else 1)
    elif offload == "nvme":
        notes.append("below stage 3 NVMe offload keeps the optimizer state in host memory")
    if cfg.train.ema and cfg.train.ema_device == "cpu":
        host += 4 * trained // world_size  # the fp32 shadow on the host, a slice per rank (train/state/ema.py)
    sampling = samples.peak(cfg, params + grads + optimizer + buffers, module.params, architecture(cfg))
    return Estimate(zero, offload, params, grads, optimizer, activations, buffers, host, nvme_bytes, notes, sampling)

def context_buffers(cfg: DictConfig, width: int, height: int, dtype_bytes: int) -> int:
    """parallel.context: Ulysses' all-to-all buffers of one attention layer (a layer at a time): its
    query, key, value and output, sent and received, each this rank's part of the split sequences'
    tokens at the transformer's width."""
    context = int(cfg.parallel.context)
    spec = families.of(cfg)
    if context <= 1 or spec.context_lengths is None:
        return 0
    import json
    from pathlib import Path

    c = json.loads((Path(str(cfg.model.architecture)) / "transformer" / "config.json").read_text())
    width_ = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    frames = max(int(n) for n in cfg.data.video.frames) if spec.video else 1
    tokens = sum(spec.context_lengths(cfg, width, height, frames).values())
    return 2 * 4 * int(cfg.train.micro_batch_size) * (tokens // context) * width_ * dtype_bytes


def _quantized_base(cfg: DictConfig, zero: str, params_offloaded: bool, params: int, host: int,
                    world_size: int) -> tuple[int, int]:
    """(params, host) with the frozen base's linear layers quantized: below ZeRO-3 whole on each GPU; under ZeRO-3 and
    FSDP2 a partition of the packed weights per rank (or all on the host with the parameters offloaded) and every
    scale; FSDP2's shard-grad-op holds the gathered packed weights beside its shard."""
    kind, base_bytes = cfg.quantize.kind.value, 4 if cfg.precision.name.value == "fp32" else 2
    layers = quantized_layers(architecture(cfg))
    if zero != "stage3" and not zero.startswith("fsdp"):
        return params - quantized.saved(kind, layers, base_bytes), host
    if params_offloaded:
        return (params + quantized.scale_bytes(kind, layers),
                max(0, host - int(quantized.packed_saved(layers, base_bytes) * 1.5)))
    if zero == "fsdp_shard_grad_op":  # the base gathered whole through the step, its shard kept beside it
        return (params - quantized.saved(kind, layers, base_bytes)
                - quantized.packed_saved(layers, base_bytes) // world_size), host
    return params - quantized.saved(kind, layers, base_bytes, world_size), host


def plan(cfg: DictConfig, world_size: int, activation_factor: float = 1.0) -> list[Estimate]:
    """The estimate of every cell the config can run in, ZeRO's then FSDP2's (an int8 or fp8 base: not ZeRO-3's nor
    FSDP2's, which the checks refuse)."""
    kind = cfg.quantize.kind.value
    return [estimate(cfg, zero, offload, world_size, activation_factor) for zero, offload in CELLS + FSDP_CELLS
            if kind in ("none", "nf4") or not (zero.startswith("fsdp") or zero == "stage3")]
