"""Each setting on its own: keys no schema knows, and numbers out of their range. Torch-free, read-only."""

from __future__ import annotations

import difflib
import math
import os

from omegaconf import DictConfig, OmegaConf

from ds_trainer.config import schema
from ds_trainer.config.problems import Problem

# Top-level keys that may hold anything (added by launchers and sweeps).
_FREE_FORM = frozenset({"hydra"})

_FLOATS = ("optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.momentum", "train.gradient_clipping",
           "train.checkpoint_every_minutes",
           "train.ema_decay", "train.noise_offset", "train.min_snr_gamma", "scheduler.warmup_min_lr",
           "scheduler.cos_min_ratio", "scheduler.warmup_min_ratio", "scheduler.min_lr_ratio")


def problems(cfg: DictConfig) -> list[Problem]:
    """Unknown keys, then numbers: non-finite ones alone (the range checks assume finite numbers), else ranges."""
    infinite = [Problem(key, value, "must be a finite number", f"{key}=<a number>") for key in _FLOATS
                if (value := OmegaConf.select(cfg, key)) is not None and not math.isfinite(value)]
    if infinite:
        return _unknown_keys(cfg) + infinite
    cache_only = [Problem("cache_only", True, "builds the latent cache, which data.cache=false turns off",
                          "data.cache=true (or train without cache_only)")] \
        if cfg.cache_only and not cfg.data.cache else []
    if int(cfg.data.cache_pack) < 1:
        cache_only.append(Problem("data.cache_pack", cfg.data.cache_pack, "is the number of samples in each file of "
                                  "the latent cache", "data.cache_pack=256"))
    return _unknown_keys(cfg) + _train(cfg) + _world_size(cfg) + _optimizer(cfg) + _scheduler(cfg) + cache_only


def _unknown_keys(cfg: DictConfig) -> list[Problem]:
    """Keys force-added with `+` that no schema knows: they would be silently ignored."""
    out: list[Problem] = []

    def walk(node: DictConfig, ref: DictConfig, prefix: str) -> None:
        known = list(ref.keys())
        for key in map(str, node.keys()):
            path = prefix + key
            if key not in known:
                if prefix.split(".")[0] not in _FREE_FORM:
                    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)
                    hint = f"did you mean {prefix}{close[0]}?" if close else "remove it"
                    out.append(Problem(path, node[key], "is not a ds_trainer setting", hint))
            elif OmegaConf.is_dict(node._get_node(key)) and OmegaConf.is_dict(ref._get_node(key)) \
                    and node[key] is not None and ref[key] is not None:  # an optional mapping left unset
                walk(node[key], ref[key], path + ".")
    walk(cfg, OmegaConf.structured(schema.Config), "")
    return out


def _train(cfg: DictConfig) -> list[Problem]:
    t, out = cfg.train, []
    for key, low in (("max_steps", 1), ("micro_batch_size", 1), ("gradient_accumulation_steps", 1),
                     ("log_every", 1), ("checkpoints_to_keep", 1), ("checkpoint_every", 0)):
        if t[key] < low:
            out.append(Problem(f"train.{key}", t[key], f"must be at least {low}", f"train.{key}={max(low, 1)}"))
    if t.checkpoint_every_minutes < 0:
        out.append(Problem("train.checkpoint_every_minutes", t.checkpoint_every_minutes,
                           "must be >= 0 (0: no checkpoints by wall time)", "train.checkpoint_every_minutes=30"))
    if t.gradient_clipping < 0:
        out.append(Problem("train.gradient_clipping", t.gradient_clipping, "must be >= 0 (0 turns clipping off)",
                           "train.gradient_clipping=1.0"))
    if not 0.0 < t.ema_decay < 1.0:
        out.append(Problem("train.ema_decay", t.ema_decay, "must lie strictly between 0 and 1",
                           "train.ema_decay=0.9999"))
    if t.ema_device not in ("cpu", "gpu"):
        out.append(Problem("train.ema_device", t.ema_device, "must be cpu or gpu", "train.ema_device=cpu"))
    if t.min_snr_gamma is not None and t.min_snr_gamma <= 0:
        out.append(Problem("train.min_snr_gamma", t.min_snr_gamma, "must be > 0, or null to turn it off",
                           "train.min_snr_gamma=5.0"))
    return out


def _world_size(cfg: DictConfig) -> list[Problem]:
    """`world_size`, when set, is at least 1 and what the launcher started."""
    out = []
    if cfg.world_size is not None and cfg.world_size < 1:
        out.append(Problem("world_size", cfg.world_size, "must be at least 1", "world_size=1"))
    launched = os.environ.get("WORLD_SIZE")
    if cfg.world_size is not None and launched is not None and int(launched) != cfg.world_size:
        out.append(Problem("world_size", cfg.world_size, f"the launcher started {launched} processes",
                           f"world_size={launched} (or leave it unset)"))
    return out


def _optimizer(cfg: DictConfig) -> list[Problem]:
    o, out = cfg.optimizer, []
    if o.lr <= 0:
        out.append(Problem("optimizer.lr", o.lr, "must be > 0", "optimizer.lr=1e-4"))
    if o.eps <= 0:
        out.append(Problem("optimizer.eps", o.eps, "must be > 0", "optimizer.eps=1e-8"))
    if o.weight_decay < 0:
        out.append(Problem("optimizer.weight_decay", o.weight_decay, "must be >= 0", "optimizer.weight_decay=0.01"))
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        out.append(Problem("optimizer.betas", list(o.betas), "must be two numbers in [0, 1)",
                           "optimizer.betas=[0.9,0.999]"))
    return out


def _scheduler(cfg: DictConfig) -> list[Problem]:
    s, max_steps, out = cfg.scheduler, cfg.train.max_steps, []
    if s.warmup_steps is not None and not 0 <= s.warmup_steps <= max_steps:
        out.append(Problem("scheduler.warmup_steps", s.warmup_steps,
                           f"must lie between 0 and train.max_steps={max_steps}",
                           f"scheduler.warmup_steps={max(0, min(s.warmup_steps, max_steps))}"))
    for key in ("cos_min_ratio", "warmup_min_ratio", "min_lr_ratio"):
        if not 0.0 <= s[key] <= 1.0:
            out.append(Problem(f"scheduler.{key}", s[key], "must lie between 0 and 1", f"scheduler.{key}=0.1"))
    return out
