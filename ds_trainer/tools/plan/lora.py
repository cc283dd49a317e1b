"""The planner's model states for a module part frozen and part trained (`adapter=lora`, trained text encoders): a
frozen 16-bit base (partitioned under ZeRO-3) and fp32 masters, gradients and optimizer state for the trained
parameters only."""

from __future__ import annotations

from functools import cache, partial
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import schema
from ds_trainer.tools.plan.unet import saved_bytes


@cache
def _count(architecture: str, method: str, rank: int, alpha: int, targets: tuple[str, ...], factor: int) -> int:
    from ds_trainer.tools.plan.unet import build_meta
    from ds_trainer.train.adapters.adapter import peft_config

    unet = build_meta(architecture)  # its own: adapters are added to it
    unet.requires_grad_(False)
    unet.add_adapter(peft_config(method, rank, alpha, targets, factor=factor))
    return sum(p.numel() for p in unet.parameters() if p.requires_grad)


def trainable(cfg: DictConfig, architecture: str) -> int | None:
    """The adapters' parameter count (LoRA, DoRA, LoKr, LoHa: as peft builds them), or None when the whole UNet is
    trained."""
    a = cfg.adapter
    if a.method.value == "none":
        return None
    return _count(architecture, a.method.value, int(a.rank), int(a.alpha), tuple(a.targets), int(a.factor))


@cache
def _encoders(architecture: str, which: str, mode: str, rank: int, targets: tuple[str, ...]) -> tuple[int, int]:
    from ds_trainer.train.families import text_encoders

    spec = text_encoders.Spec(mode, rank=rank, alpha=rank, targets=targets)
    frozen = trained = 0
    for name in text_encoders.COMPONENTS[which]:
        encoder = text_encoders.meta_encoder(architecture, name)
        text_encoders.prepare_encoder(spec, name, encoder)
        trained += sum(p.numel() for p in encoder.parameters() if p.requires_grad)
        frozen += sum(p.numel() for p in encoder.parameters() if not p.requires_grad)
    return frozen, trained


def encoders(cfg: DictConfig, architecture: str) -> tuple[int, int]:
    """(frozen, trained) parameters the trained text encoders add to the trained module ((0, 0): frozen encoders)."""
    if not schema.trains_text_encoders(cfg):
        return 0, 0
    te = cfg.text_encoders
    return _encoders(architecture, te.which.value, te.mode.value, int(te.rank), tuple(te.targets))


def model_states(zero: str, offload: str, base: int, t: int, layer: int, n: int,  # noqa: PLR0913 - the figures a cell's
                 params_offload: bool, precision: str) -> tuple[int, int, int, int]:  # states depend on, as numbers
    """(params, grads, optimizer, host) bytes per rank for a frozen base of `base` parameters and `t`
    adapter parameters. DeepSpeed casts the whole module (base and adapters) to 16-bit; the fp32
    masters and Adam moments (12 bytes) and the gradients exist for the adapters only (bf16_pure: bf16
    masters and moments, 6 bytes)."""
    half = 2 if precision != "fp32" else 4
    pure = precision == "bf16_pure"
    # Below stage 3 the 16-bit gradient and its fp32 partition (bf16_pure: one bf16 gradient); stage 3 keeps the
    # partition alone; the masters and moments; the host's share of all model states under offload.
    grads, partition, state, host_state = (2, 2, 6, 10) if pure else (6, 4, 12, 16)
    if zero.startswith("fsdp"):  # the frozen base sharded in 16-bit, the adapters' fp32 (bf16_pure: bf16) state
        shard, moments = (2, 4) if pure else (4, 8)
        if offload != "none":
            return 2 * half * layer, 0, 0, int((half * base + (2 * shard + moments) * t) * 1.5)
        gathered = 2 * half * layer if zero == "fsdp_full_shard" else half * (base + t)
        return gathered + (half * base + shard * t) // n, shard * t // n, moments * t // n, 0
    if zero == "ddp":  # the base cast to 16-bit by the recipe, the adapters fp32 with their Adam state
        return half * base + 4 * t, 4 * t, 8 * t, 0
    stage = int(zero[-1])
    if stage in (0, 1, 2):
        ranks = 1 if stage == 0 else n
        params = half * (base + t)
        if offload == "none":
            full_grads = 2 * t - 2 * t // ranks if stage == 1 else 0
            return params, grads * t // ranks + full_grads, state * t // ranks, 0
        return params, 0, 0, int(t * max(4 * n, host_state) * 1.5)
    gathered = half * layer
    if offload == "none":
        return gathered + half * (base + t) // n, partition * t // n, state * t // n, 0
    if not params_offload:
        return gathered + half * (base + t) // n, 0, 0, int(t * host_state * 1.5)
    return gathered, 0, 0, int((half * (base + t) + host_state * t) * 1.5)


@cache
def _encoder_activations(architecture: str, which: str, mode: str, rank: int,  # noqa: PLR0913 - @cache's key
                         targets: tuple[str, ...], batch: int, dtype_bytes: int, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward in the trained encoders' forward (a prompt's tokens each), counted as the
    UNet's are (plan.activation_bytes): a forward on the meta device, each saved tensor counted once; with
    checkpointing each layer's input is kept and one layer at a time recomputed."""
    import torch
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    from ds_trainer.train.families import text_encoders

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    spec = text_encoders.Spec(mode, rank=rank, alpha=rank, targets=targets)
    total = 0
    for name in text_encoders.COMPONENTS[which]:
        encoder: Any = text_encoders.meta_encoder(architecture, name)
        text_encoders.prepare_encoder(spec, name, encoder)
        encoder = encoder.to(dtype)
        tokens = torch.zeros(batch, int(encoder.config.max_position_embeddings), dtype=torch.long, device="meta")
        total += saved_bytes(encoder, (CLIPEncoderLayer,), partial(encoder, tokens, output_hidden_states=True),
                             checkpointing)
    return total


def encoder_activations(cfg: DictConfig, architecture: str, dtype_bytes: int) -> int:
    """Activation bytes the trained text encoders add to a step (0 with frozen encoders: their embeddings are
    cached)."""
    from ds_trainer.tools.plan import cache as disk_cache

    if not schema.trains_text_encoders(cfg):
        return 0
    te = cfg.text_encoders
    return int(disk_cache.cached("encoder_activations", (
        architecture, te.which.value, te.mode.value, int(te.rank), tuple(str(t) for t in te.targets),
        int(cfg.train.micro_batch_size), dtype_bytes, bool(cfg.train.gradient_checkpointing)), _encoder_activations))
