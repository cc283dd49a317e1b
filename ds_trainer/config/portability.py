"""Whether a checkpoint can continue under this configuration, decided before a run. Torch-free.

Every checkpoint holds a portable state next to DeepSpeed's own files (`portable/meta.json` and
safetensors shards, written by `train/portable.py`). Its `layout` (ZeRO stage or DDP, offload, ranks,
micro batch, accumulation, precision) may differ from the resumed run's: the state is then carried over
parameter by parameter. Its `identity` (optimizer type, architecture, adapter/LoRA shape) may not, unless the
user asks for the weights only with `resume_optimizer=reset`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import optimizers, schema, trust
from ds_trainer.config.ds_config import option_name
from ds_trainer.config.problems import Problem

META = "portable/meta.json"
# Optimizers whose state the portable format holds (DeepSpeed's Adam/AdamW map 1:1 onto torch's).
# bitsandbytes' 8-bit AdamW's are written dequantized (train/quantized.py) and quantized again on a carry.
MOMENT_OPTIMIZERS = ("adam", "adamw", "adamw8bit")
# Optimizers whose state is another's, under its name: torch's AdamW built by ds_trainer is AdamW (its moments carry
# to and from DeepSpeed's AdamW through the portable state).
# optimi's Kahan-summed twins (precision.weight_update=kahan) likewise: their moments are Adam's, their compensation is
# folded into the portable weight (train/state/kahan.py).
STATE_FAMILY = {"adamw_torch": "adamw", "adamw_kahan": "adamw", "adam_kahan": "adam", "lion_kahan": "lion"}


def layout(cfg: DictConfig) -> dict[str, Any]:
    """What may change between a run and its resume: where and how the state is split."""
    return {"zero": option_name(str(cfg.resolved.backend), int(cfg.zero.stage)),
            "offload": str(cfg.offload.device.value), "world_size": int(cfg.resolved.world_size),
            "micro_batch_size": int(cfg.train.micro_batch_size),
            "gradient_accumulation_steps": int(cfg.train.gradient_accumulation_steps),
            "precision": str(cfg.precision.name.value),
            # torch's AdamW standing in for FusedAdam (no CUDA toolkit): another state format in DeepSpeed's
            # files, so a move between the two goes through the portable state. Absent otherwise, as in the
            # checkpoints written before it existed.
            **({"optimizer_kernel": "torch"} if cfg.resolved.get("torch_adam") else {}),
            # torch's AdamW as ds_trainer builds it (optimizer=adamw_torch): the same moments as DeepSpeed's AdamW,
            # in another optimizer's files.
            **({"optimizer_kernel": "client"} if str(cfg.resolved.optimizer) == "adamw_torch" else {}),
            # optimi's Kahan-summed optimizer (precision.weight_update=kahan): its state (a compensation beside the
            # moments) in a client optimizer's files; absent otherwise.
            **({"optimizer_kernel": "kahan"} if str(cfg.resolved.optimizer) in optimizers.KAHAN_OPTIMIZERS else {})}


def identity(cfg: DictConfig) -> dict[str, Any]:
    """What must not change for the optimizer state to carry: optimizer type, architecture, LoRA shape."""
    adapter = cfg.get("adapter")  # LoRA: its shape (method, rank, targets) decides which parameters train
    method = str(getattr(adapter.method, "value", adapter.method)) if adapter is not None else "none"
    shape = None if method == "none" else {"method": method, "rank": int(adapter.rank),
                                            "targets": [str(t) for t in adapter.targets],
                                            **({"factor": int(adapter.factor)} if method == "lokr" else {})}
    text = text_encoders_shape(cfg)
    return {"optimizer": STATE_FAMILY.get(str(cfg.resolved.optimizer), str(cfg.resolved.optimizer)),
            "architecture": Path(str(cfg.model.architecture)).name,
            "adapter": shape,
            # Trained text encoders (absent when they are frozen, as in the checkpoints written before they could train)
            **({"text_encoders": text} if text is not None else {})}


def text_encoders_shape(cfg: DictConfig) -> dict[str, Any] | None:
    """Which text encoders train and how (None: frozen): the parameters they add to the trained module."""
    if not schema.trains_text_encoders(cfg):
        return None
    te = cfg.text_encoders
    mode = str(getattr(te.mode, "value", te.mode))
    shape: dict[str, Any] = {"mode": mode, "which": str(getattr(te.which, "value", te.which))}
    if mode == "lora":
        shape.update(rank=int(te.rank), targets=[str(t) for t in te.targets])
    return shape


def read_meta(checkpoint: Path) -> dict[str, Any] | None:
    """The portable state's description, or None for a checkpoint without one (written before it existed)."""
    path = Path(checkpoint) / META
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():  # a folder, a symlink loop: damaged, not a checkpoint from before it
        raise ValueError("it is not a file")
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
        raise ValueError("it is not a JSON object")
    missing = sorted(META_KEYS - set(meta))
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}: not the description a run writes")
    return dict(meta)


META_KEYS = frozenset({"identity", "layout", "params", "index", "step", "samples", "moments"})


def changes(meta: dict[str, Any], cfg: DictConfig) -> list[str]:
    """The layout differences, as `key: saved -> now`."""
    now, saved = layout(cfg), meta["layout"]
    return [f"{key}: {saved.get(key)} -> {now.get(key)}" for key in [*now, *(k for k in saved if k not in now)]
            if saved.get(key) != now.get(key)]


# Between FSDP layouts that differ only in how many ranks hold the shards and how the batch is split,
# torch.distributed.checkpoint reshards the model and optimizer state as it loads them: the native load serves.
RESHARDED_NATIVELY = frozenset({"world_size", "micro_batch_size", "gradient_accumulation_steps"})


def reshards_natively(saved: dict[str, Any], cfg: DictConfig) -> bool:
    """Whether a checkpoint saved under the FSDP layout `saved` loads natively under this FSDP configuration."""
    now = layout(cfg)
    moved = {key for key in {*now, *saved} if saved.get(key) != now.get(key)}
    return str(now["zero"]).startswith("fsdp") and str(saved.get("zero")).startswith("fsdp") \
        and moved <= RESHARDED_NATIVELY


def reset_requested(cfg: DictConfig) -> bool:
    value = cfg.get("resume_optimizer")
    return getattr(value, "value", value) == "reset"


def check(cfg: DictConfig, checkpoint: Path | None) -> tuple[list[Problem], list[str]]:
    """Problems that refuse the resume, and warnings to record (the weights-only override)."""
    if checkpoint is None:
        return [], []
    try:
        meta = read_meta(checkpoint)
    except (OSError, ValueError) as exc:
        fix = "resume=latest, or resume=<another checkpoint folder>"
        return [Problem("resume", str(checkpoint), f"its portable state's {META} cannot be "
                        f"read ({exc})", fix)], []
    native = trust.native_allowed(cfg, checkpoint)
    if meta is None:
        if not native and (Path(checkpoint) / "COMPLETE").is_file():
            return [Problem("resume", str(checkpoint), f"{trust.untrusted_why(checkpoint)}; it "
                            "holds no portable state (train.portable_state=false) to resume from "
                            "instead", "resume from a checkpoint of your own runs, or "
                            "resume_trust_native=true if you trust where this one came from")], []
        return _without_portable_state(cfg, checkpoint), []
    problems, warnings = _identity(cfg, checkpoint, meta)
    if not native and not problems and str(meta["identity"]["optimizer"]) not in MOMENT_OPTIMIZERS \
            and not reset_requested(cfg):
        saved = meta["identity"]["optimizer"]
        problems = [Problem("resume", str(checkpoint), f"{trust.untrusted_why(checkpoint)}; its "
                            f"portable state holds no optimizer state for {saved} (only for "
                            f"{'/'.join(MOMENT_OPTIMIZERS)}), which only the native files hold",
                            "resume_trust_native=true if you trust where it came from, or "
                            "resume_optimizer=reset to carry the weights only")]
    if not native and not problems:
        warnings.append(f"{trust.untrusted_why(checkpoint)}: it resumes through its portable "
                        "state (safetensors and JSON) instead of the native load (bit-exact; "
                        "resume_trust_native=true for it)")
    return problems, warnings


def _identity(cfg: DictConfig, checkpoint: Path,
              meta: dict[str, Any]) -> tuple[list[Problem], list[str]]:
    """`check` with a portable state: optimizer, architecture, adapter and encoders must match."""
    saved, now = meta["identity"], identity(cfg)
    now.setdefault("text_encoders", None)
    differ = [key for key in now if saved.get(key) != now[key]]
    moved = changes(meta, cfg)
    if saved["optimizer"] not in MOMENT_OPTIMIZERS and moved and "optimizer" not in differ:
        differ.append("optimizer")
    if not differ:
        return [], []
    if reset_requested(cfg):
        what = ", ".join(f"{key} {saved.get(key)} -> {now[key]}" for key in differ)
        return [], [f"resume_optimizer=reset: resuming {checkpoint} with the WEIGHTS ONLY ({what}); the optimizer "
                    "state (Adam moments) starts fresh, so the first steps differ from an uninterrupted run"]
    return [_problem(key, saved.get(key), now[key], checkpoint, moved) for key in differ], []


def _problem(key: str, saved: Any, now: Any, checkpoint: Path | None, moved: list[str]) -> Problem:
    fix = "resume_optimizer=reset to carry the weights only (the optimizer starts fresh)"
    if key == "optimizer" and saved == now:
        return Problem("optimizer", now, f"the checkpoint {checkpoint} holds no portable optimizer state for {saved} "
                       f"(only {'/'.join(MOMENT_OPTIMIZERS)}), and the run changed ({'; '.join(moved)})",
                       f"resume with the saved layout, or {fix}")
    if key == "optimizer":
        return Problem("optimizer", now, f"the checkpoint {checkpoint} was trained with optimizer={saved}; its "
                       "state cannot continue under another optimizer type", f"optimizer={saved}, or {fix}")
    if key == "architecture":
        return Problem("model.architecture", now, f"the checkpoint {checkpoint} holds a UNet of architecture {saved}",
                       f"model={saved} (the model option of that architecture), or {fix} (weights whose names "
                       "match carry over)")
    if key == "text_encoders":
        return Problem("text_encoders", now, f"the checkpoint {checkpoint} was trained with text_encoders="
                       f"{saved or 'frozen'}: other text encoders train now, so other parameters are in the model and "
                       "the optimizer", f"the saved text_encoders settings, or {fix}")
    return Problem("adapter", now, f"the checkpoint {checkpoint} was trained with adapter={saved}: another adapter "
                   "shape has other trainable parameters", f"the saved adapter settings, or {fix}")


def _without_portable_state(cfg: DictConfig, checkpoint: Path | None) -> list[Problem]:
    """A checkpoint saved with train.portable_state=false resumes only under the layout it records."""
    marker = Path(checkpoint) / "COMPLETE" if checkpoint is not None else None
    if marker is None or not marker.is_file():
        return []
    saved = json.loads(marker.read_text()).get("layout") or {}  # older checkpoints record none
    now = layout(cfg)
    moved = {key: (saved[key], now[key]) for key in now if key in saved and saved[key] != now[key]}
    if not moved or reshards_natively(saved, cfg):
        return []
    changed = "; ".join(f"{key}: {was} -> {value}" for key, (was, value) in moved.items())
    back = " ".join(_override(key, was) for key, (was, _) in moved.items())
    convert, ident = "", identity(cfg)
    if str(saved["zero"]) in ("stage1", "stage2", "stage3") and ident["adapter"] is None:
        convert = (f", or give it a portable state offline: python -m ds_trainer.convert {checkpoint} --import-to "
                   f"<dir> --architecture {ident['architecture']}, then resume=<dir>")
    return [Problem("resume", str(checkpoint), f"the checkpoint holds no portable state (saved with "
                    f"train.portable_state=false), so it continues only under the layout it was saved with; this run "
                    f"changed it ({changed})", f"resume with {back}{convert}")]


def _override(key: str, value: Any) -> str:
    keys = {"zero": "zero", "offload": "offload", "world_size": "world_size", "precision": "precision",
            "micro_batch_size": "train.micro_batch_size",
            "gradient_accumulation_steps": "train.gradient_accumulation_steps"}
    return f"{keys[key]}={value}"
