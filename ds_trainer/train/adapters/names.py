"""peft's names of the adapters' parameters, whatever the method: which parameters of an injected module are
adapters, and the names peft's state dicts give them."""

from __future__ import annotations

# LoRA's and DoRA's (`lora_A`, `lora_B`, `lora_magnitude_vector`), LoHa's (`hada_w1_a`, ...) and LoKr's (`lokr_w1`,
# `lokr_w2`, `lokr_w2_a`, ...).
PREFIXES = ("lora_", "hada_", "lokr_")


def is_adapter(name: str) -> bool:
    """Whether a parameter or module name is an adapter's (peft's), not the base model's."""
    return any(prefix in name for prefix in PREFIXES)


def peft_name(name: str) -> str:
    """A parameter's name as peft's state dicts write it: without the adapter's name (`.default`)."""
    return name.replace(".default.", ".").removesuffix(".default")
