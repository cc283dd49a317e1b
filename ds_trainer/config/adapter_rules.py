"""Rules for the `adapter` group, checked with the rest of the configuration. Torch-free.

Whether `adapter.targets` match modules of the UNet, and whether an `adapter.init_from` file fits, need
the model's module names; `train.adapter.problems` checks those before training starts.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

# (key, value, why, fix): validation turns each into a Problem.
Rule = tuple[str, object, str, str]


def check(cfg: DictConfig) -> list[Rule]:
    """Problems of `cfg.adapter` that the values alone show."""
    a = cfg.adapter
    if a.method.value == "none":
        return []
    out: list[Rule] = []
    if a.rank <= 0:
        out.append(("adapter.rank", a.rank, "the LoRA rank must be a positive integer", "adapter.rank=16"))
    if not math.isfinite(a.alpha) or a.alpha <= 0:
        out.append(("adapter.alpha", a.alpha, "the LoRA alpha (the update is scaled by alpha/rank) must be > 0",
                    f"adapter.alpha={max(a.rank, 1)}"))
    if not math.isfinite(a.dropout) or not 0.0 <= a.dropout < 1.0:
        out.append(("adapter.dropout", a.dropout, "must lie in [0, 1)", "adapter.dropout=0.0"))
    if not a.targets:
        out.append(("adapter.targets", [], "LoRA needs at least one module to adapt",
                    "adapter.targets=[to_q,to_k,to_v,to_out.0] (or adapter=lora_wide)"))
    if a.init_from is not None and not Path(a.init_from).exists():
        out.append(("adapter.init_from", a.init_from, "no such file or folder",
                    "adapter.init_from=<run>/lora/pytorch_lora_weights.safetensors (or null)"))
    return out
