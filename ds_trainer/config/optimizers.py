"""Optimizer names: normalization, fallbacks, and what the installed DeepSpeed supports. Torch-free."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

# Read from DeepSpeed 0.19.8's runtime/config.py; used only when DeepSpeed is not installed.
FALLBACK_DEEPSPEED_OPTIMIZERS = (
    "adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon",
)

# Names users bring from older docs and other trainers, and what they become.
SUBSTITUTES = {
    "cpuadam": "adamw",
    "deepspeedcpuadam": "adamw",
    "fusedadam": "adamw",
}

# Optimizers ds_trainer builds itself and hands to `accelerator.prepare` (DeepSpeed: a client optimizer, no
# `optimizer` block in its JSON; the LR schedule is built over it too). Normalized name -> the name runs record.
CLIENT = {"adamwtorch": "adamw_torch", "torchadamw": "adamw_torch", "adamw8bit": "adamw8bit",
          "bnbadamw8bit": "adamw8bit", "prodigy": "prodigy", "schedulefreeadamw": "schedule_free_adamw",
          "adamwschedulefree": "schedule_free_adamw"}
# precision.weight_update=kahan: the optimizer a user names steps as optimi's Kahan-summed twin (the same update, with a
# bf16 compensation buffer per weight), built by ds_trainer. Not names a user gives: the resolved name runs record.
KAHAN = {"adam": "adam_kahan", "adamw": "adamw_kahan", "adamw_torch": "adamw_kahan", "lion": "lion_kahan"}
KAHAN_OPTIMIZERS = frozenset(KAHAN.values())
# What each client optimizer is, as the log and config.yaml name it: (module, class).
CLIENT_CLASS = {"adamw_torch": ("torch.optim", "AdamW"), "adamw8bit": ("bitsandbytes.optim", "AdamW8bit"),
                "prodigy": ("prodigyopt", "Prodigy"), "schedule_free_adamw": ("schedulefree", "AdamWScheduleFree"),
                "adam_kahan": ("optimi", "Adam"), "adamw_kahan": ("optimi", "AdamW"), "lion_kahan": ("optimi", "Lion")}
# The Python package a client optimizer needs, and what installs it.
_OPTIMI = ("optimi", "pip install -c constraints.txt torch-optimi")
CLIENT_PACKAGE = {"adamw8bit": ("bitsandbytes", "pip install -c constraints.txt bitsandbytes"),
                  "prodigy": ("prodigyopt", "pip install -c constraints.txt prodigyopt"),
                  "schedule_free_adamw": ("schedulefree", "pip install -c constraints.txt schedulefree"),
                  **{name: _OPTIMI for name in KAHAN_OPTIMIZERS}}
# Optimizers with state kept per step in their param groups, not per element (Prodigy's step size d from sums over
# every parameter, schedule-free's step count k and average weights): each `step()` call must see every trained
# parameter once. ZeRO-3 calls `step()` once per sub-group, so they need one sub-group (see config/checks/resolve.py).
GLOBAL_STATE = frozenset({"prodigy", "schedule_free_adamw"})
# Optimizers that count their steps in each parameter group (optimi's: one `step` per group, not per tensor): a
# ZeRO-3 step() per sub-group would count one optimizer step several times, so they too take one sub-group.
ONE_STEP_CALL = GLOBAL_STATE | KAHAN_OPTIMIZERS
# Optimizers whose state is kept elementwise in fp32 (what DeepSpeed's NVMe swapper and the portable state's Adam
# moments assume): the Adam family, DeepSpeed's and torch's.
FP32_MOMENTS = frozenset({"adam", "adamw", "adamw_torch"})

# Factored optimizers people bring from other SDXL trainers, not offered: they keep a row and a column statistic per
# 2-D weight, and ZeRO >= 1 hands an optimizer 1-D flat partitions, so the factorisation is gone (the full second
# moment comes back) and per-tensor RMS scaling and clipping become per-partition, without an error
# (notes/optimizers-text-encoders-models.md, A). Their memory saving has other routes here.
FACTORED = {"adafactor": "Adafactor", "came": "CAME"}

# Which fields of the `optimizer` group each DeepSpeed optimizer takes.
PARAMS: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "adagrad": ("lr", "eps", "weight_decay"),
    "lamb": ("lr", "betas", "eps", "weight_decay"),
    "lion": ("lr", "betas", "weight_decay"),
    "muadam": ("lr", "betas", "eps", "weight_decay"),
    "muadamw": ("lr", "betas", "eps", "weight_decay"),
    "musgd": ("lr", "momentum", "weight_decay"),
    "muon": ("lr", "momentum", "betas", "eps", "weight_decay"),
    "adamw_torch": ("lr", "betas", "eps", "weight_decay"),
    "adamw8bit": ("lr", "betas", "eps", "weight_decay"),
    "prodigy": ("lr", "betas", "eps", "weight_decay", "d_coef", "use_bias_correction", "safeguard_warmup", "slice_p"),
    "schedule_free_adamw": ("lr", "betas", "eps", "weight_decay"),
}

# DeepSpeed's `type` spelling for each name (its matching is case-insensitive; these read well).
DEEPSPEED_TYPE = {
    "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad", "lamb": "Lamb", "lion": "Lion",
    "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD", "muon": "Muon",
}

# Optimizers that run where ZeRO offload puts the state: DeepSpeed's CPU Adam/Adagrad/Lion kernels,
# and Muon (torch ops on the CPU partitions). Measured on DeepSpeed 0.19.8.
CPU_OFFLOAD_CAPABLE = frozenset({"adam", "adamw", "adagrad", "lion", "muon"})
# Optimizers whose DeepSpeed kernel exists only on CUDA when the state is not offloaded
# (FusedLamb always; FusedLion unless offload gives DeepSpeedCPULion instead).
CUDA_KERNEL = frozenset({"lamb", "lion"})
# muP optimizers: they need mup's `set_base_shapes` on a width-scaled model family, which SDXL's
# UNet is not; DeepSpeed fails on them without it.
MUP = frozenset({"muadam", "muadamw", "musgd"})


def normalize(name: str) -> str:
    """Case, `-` and `_` do not matter: `AdamW`, `adam_w`, `Adam-W` are all `adamw`."""
    return name.strip().lower().replace("-", "").replace("_", "")


@cache
def deepspeed_optimizers() -> tuple[str, ...]:
    """Optimizer names the installed DeepSpeed knows, read from its source without importing it.

    Importing DeepSpeed imports torch (seconds); the dry run must not, so the list literal
    `DEEPSPEED_OPTIMIZERS` in `deepspeed/runtime/config.py` is parsed instead.
    """
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return FALLBACK_DEEPSPEED_OPTIMIZERS
    source = Path(next(iter(spec.submodule_search_locations))) / "runtime" / "config.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return FALLBACK_DEEPSPEED_OPTIMIZERS
    constants: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                constants[target] = value.value
            elif target == "DEEPSPEED_OPTIMIZERS" and isinstance(value, ast.List):
                names = [constants.get(e.id) if isinstance(e, ast.Name) else getattr(e, "value", None)
                         for e in value.elts]
                return tuple(n for n in names if isinstance(n, str))
    return FALLBACK_DEEPSPEED_OPTIMIZERS


def resolve(name: str) -> tuple[str | None, str | None]:
    """Map a user's optimizer name to a supported one.

    Returns (name, warning): name is None when the installed DeepSpeed does not know it.
    """
    key = normalize(name)
    if key in SUBSTITUTES:
        new = SUBSTITUTES[key]
        return new, (f"optimizer.name={name} is not a DeepSpeed optimizer type; using {new} "
                     f"(DeepSpeed picks its CPU or fused kernel itself)")
    if key in CLIENT:
        return CLIENT[key], None
    if key in deepspeed_optimizers():
        return key, None
    return None, None


def is_client(name: str | None) -> bool:
    """An optimizer ds_trainer builds (torch's, bitsandbytes') rather than DeepSpeed from its JSON."""
    return name in CLIENT_CLASS


def known() -> tuple[str, ...]:
    """Every optimizer name a user can give: DeepSpeed's and ds_trainer's own."""
    return (*deepspeed_optimizers(), *(name for name in CLIENT_CLASS if name not in KAHAN_OPTIMIZERS))


def stepping(optimizer_name: str, update: str) -> str | None:
    """The optimizer that steps: the named one (`resolve`), or under precision.weight_update=kahan its Kahan-summed twin
    (an optimizer without one stays itself, and the config checks refuse the pair)."""
    name = resolve(optimizer_name)[0]
    return KAHAN.get(name, name) if update == "kahan" and name is not None else name
