"""Resuming from a checkpoint's portable state under another configuration (see `portable.py`).

The recipe calls `Carry` at two points: `before_prepare` puts the saved fp32 weights into the UNet (so
DeepSpeed's fp32 masters and the DDP module start from them), `after_prepare` writes the masters and the
Adam state into whatever optimizer the configuration built, restores the step count (with DeepSpeed's
C++ Adam clocks), the LR schedule, the EMA and the data position. When nothing changed it does nothing
and the recipe keeps DeepSpeed's native, bit-exact load; except under ZeRO-3 with the optimizer state on NVMe,
where DeepSpeed 0.19.8's own load loses Adam's moments and the portable state (bit-exact there too) is loaded.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from omegaconf import DictConfig

from ds_trainer.config import portability
from ds_trainer.errors import TrainingError
from ds_trainer.train.backends import inner, masters
from ds_trainer.train.state import adam8bit, kahan, portable
from ds_trainer.train.state.portable import KINDS, Reader, trainable

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")
MOMENTS = portability.MOMENT_OPTIMIZERS


class Source(Protocol):
    """Where carried tensors come from, by key `<kind>/<name>` (a checkpoint's `portable.Reader`, or `Exact`)."""

    def __contains__(self, key: str) -> bool: ...

    def get(self, key: str) -> torch.Tensor: ...


class Carry:
    """The resume plan: `changed` when the portable state must carry over (else native or fresh)."""

    def __init__(self, cfg: DictConfig, resume_from: Path | None, native: bool = True) -> None:
        self.path = resume_from
        self.meta = portability.read_meta(resume_from) if resume_from is not None else None
        self.reset = portability.reset_requested(cfg) and self.meta is not None
        moved = portability.changes(self.meta, cfg) if self.meta is not None else []
        self.changes = moved
        # FSDP on another number of ranks (or batch split): torch.distributed.checkpoint reshards on load.
        self.resharded = bool(moved) and not self.reset and self.meta is not None \
            and portability.reshards_natively(self.meta["layout"], cfg)
        self.changed = self.meta is not None and ((bool(moved) and not self.resharded) or self.reset)
        self.swap_reload = bool(self.meta is not None and not self.changed and swaps_optimizer(cfg)
                                and self.meta.get("moments"))
        if self.swap_reload:
            # DeepSpeed 0.19.8's own load under ZeRO-3 with the optimizer state on NVMe purges its swap after
            # reading the checkpoint, then swaps the emptied state in: Adam's moments restart from zero (measured:
            # after one step every weight off by up to 2 lr, the moments exactly what zeros give). The portable
            # state carries them instead, bit for bit.
            self.changed = True
            self.changes = ["ZeRO-3's NVMe optimizer swap: DeepSpeed's own load would lose Adam's moments"]
        if self.meta is not None and not self.changed and not native:
            # Not this user's checkpoint (config/trust.py): its pickled native files stay unread.
            self.changed = True
            self.changes = ["not written by this user's runs: its DeepSpeed and Accelerate files "
                            "are not unpickled"]
        self.reader = Reader(resume_from, self.meta) if self.changed and resume_from and self.meta else None
        self.carried: list[str] = []
        saved = str(self.meta["layout"].get("precision")) if self.meta is not None else None
        now = str(cfg.precision.name.value)
        # Into bf16_pure the fp32 weights and moments are rounded to bf16; out of it they are carried exactly.
        self.precisions = (saved, now)
        self.rounding = "bf16_pure" in self.precisions and saved != now and not self.reset

    def start(self, step: int, global_batch: int) -> tuple[int, int]:
        """(step, samples seen) where the data continues: the saved count, or for a checkpoint without a
        portable state (same layout by definition) the count its fixed global batch gives."""
        if self.meta is not None and int(self.meta["step"]) == step:
            return step, int(self.meta["samples"])
        return step, step * global_batch

    def after_native_load(self) -> None:
        """Say what a native load carried across (FSDP: the state resharded for this layout)."""
        if self.resharded:
            log.info("resumed natively from %s under another layout (%s): torch.distributed.checkpoint resharded "
                     "the weights and the optimizer state", self.path, "; ".join(self.changes))

    def before_prepare(self, model: torch.nn.Module) -> None:
        """Load the saved fp32 weights into the (not yet prepared) UNet, by name."""
        if self.reader is None:
            return
        assert self.meta is not None
        named = trainable(model)
        self._check_names(named)
        with torch.no_grad():
            for name, p in named:
                saved = self._saved_name(name)
                key = f"fp32/{saved}"
                if key in self.reader and list(p.shape) == list(self.meta["params"].get(saved, [])):
                    p.copy_(self.reader.get(key))
                    self.carried.append(name)

    def _saved_name(self, name: str) -> str:
        """The checkpoint's name of a parameter: its own, or across a change of `text_encoders` (weights only), the
        UNet's parameter named as in a UNet alone (`x`) or in the UNet trained with its text encoders (`unet.x`)."""
        assert self.meta is not None
        if name in self.meta["params"]:
            return name
        other = name.removeprefix("unet.") if name.startswith("unet.") else f"unet.{name}"
        return other if other in self.meta["params"] else name

    def _check_names(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        """The trainable parameters must match by name and shape unless only the weights are carried."""
        assert self.meta is not None
        now = {name: list(p.shape) for name, p in named}
        saved = {name: list(shape) for name, shape in self.meta["params"].items()}
        if now == saved or self.reset:
            return
        missing, extra = sorted(saved.keys() - now.keys()), sorted(now.keys() - saved.keys())
        shaped = sorted(n for n in now.keys() & saved.keys() if now[n] != saved[n])
        what = "; ".join(f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)})"
                         for label, names in (("only in the checkpoint", missing), ("only in this model", extra),
                                              ("another shape", shaped)) if names)
        raise TrainingError(f"resume={self.path}: the trainable parameters differ from the checkpoint's ({what}); "
                            "the optimizer state cannot carry over. Resume with the same model and adapter "
                            "settings, or with resume_optimizer=reset to carry the weights only")

    def after_prepare(self, run: Run) -> int:
        """Write the state into the prepared engine or optimizer; returns the step to continue after."""
        accelerator, scheduler = run.accelerator, run.scheduler
        assert self.meta is not None and self.reader is not None
        if not self.meta["moments"] and not self.reset and self.meta["identity"]["optimizer"] in MOMENTS:
            raise TrainingError(f"resume={self.path}: the checkpoint's portable state holds no Adam moments (it was "
                                f"saved under {self.meta['layout']}); resume with that layout, or with "
                                "resume_optimizer=reset to carry the weights only")
        base = inner.optimizer(accelerator, run.optimizer)
        engine = inner.engine(accelerator)
        moments = bool(self.meta["moments"]) and not self.reset
        t = int(self.meta["optimizer_step"])
        if moments:
            _prefill(run.params.masters(base), base, t)
        reader: Source = self.reader
        renamed = {name: self._saved_name(name) for name in self.carried if self._saved_name(name) != name}
        if renamed:
            reader = _Renamed(self.reader, renamed)
        write(run.params, accelerator.unwrap_model(run.model), base, reader, set(self.carried), moments, t)
        if moments:  # bitsandbytes' 8-bit AdamW: the carried fp32 moments quantized into its own state
            adam8bit.absorb(engine, base, t)
        step = int(self.meta["step"])
        sched = inner.scheduler(accelerator, scheduler)
        if sched is not None and (self.path / "portable" / "scheduler.pt").exists():  # type: ignore[operator]
            sched.load_state_dict(portable.scheduler_state(self.path / "portable" / "scheduler.pt"))  # type: ignore[operator]
            if engine is None:
                sched.step(sched.last_batch_iteration)  # the LR of the current position (as DeepSpeed's load)
        if engine is not None:
            masters.restore_optimizer_clocks(engine, t if moments else None)
            engine.global_steps, engine.global_samples = step, int(self.meta["samples"])
        self._load_ema(run.ema)
        if self.rounding:
            into = self.precisions[1] == "bf16_pure"
            kept = into and moments and kahan.is_kahan(base)
            log.warning("precision %s -> %s: %s", *self.precisions,
                        "the carried fp32 weights were rounded to bf16 with what rounding lost kept in the Kahan "
                        "compensation, and the Adam moments rounded to bf16" if kept else
                        "the carried fp32 weights and Adam moments were rounded to bf16 (bf16_pure keeps them so)"
                        if into else "the bf16 weights and moments carry over exactly into fp32 masters")
        how = ("the WEIGHTS ONLY (resume_optimizer=reset: the optimizer starts fresh)" if not moments else
               f"fp32 weights and Adam moments (optimizer step {t}"
               + ("; 8-bit moments quantized again in this layout's blocks)" if adam8bit.is_8bit(base) else ")"))
        log.warning("resumed from %s at step %d %s (%s): carried %s of %d/%d trainable parameters, the LR "
                    "schedule, the EMA and the data position (sample %d)", self.path, step,
                    "through its portable state" if self.swap_reload else "under another configuration",
                    "; ".join(self.changes) or "same layout", how, len(self.carried), len(self.meta["params"]),
                    int(self.meta["samples"]))
        return step

    def _load_ema(self, ema: Any) -> None:
        assert self.path is not None
        if ema is None or not (self.path / "ema.pt").exists():
            return
        state = portable.saved_state(self.path / "ema.pt", "EMA", mmap=True)
        if set(state["shadow"]) != set(ema.names):
            log.warning("the checkpoint's EMA covers other parameters: the EMA starts from the carried weights")
            return
        ema.load_state_dict(state)


class _Renamed:
    """A portable state's reader under this model's parameter names (`renamed`: this model's name -> the saved one)."""

    def __init__(self, reader: Source, renamed: dict[str, str]) -> None:
        self.reader, self.renamed = reader, renamed

    def _key(self, key: str) -> str:
        kind, _, name = key.partition("/")
        return f"{kind}/{self.renamed.get(name, name)}"

    def __contains__(self, key: str) -> bool:
        return self._key(key) in self.reader

    def get(self, key: str) -> torch.Tensor:
        return self.reader.get(self._key(key))


def swaps_optimizer(cfg: DictConfig) -> bool:
    """Whether DeepSpeed keeps the optimizer state on NVMe (ZeRO-3 swaps it; ZeRO-1/2 keep it in host memory)."""
    resolved = cfg.get("resolved") or {}
    return bool(resolved.get("backend") == "deepspeed" and int(cfg.zero.stage) == 3
                and resolved.get("optimizer_state_on") == "nvme")


def write(layout: Whole, module: Any, base: Any, reader: Source, names: set[str], moments: bool, t: int) -> None:
    """Collective: the fp32 weight (and with `moments` Adam's moments) of each named trainable parameter of the
    unwrapped `module` from `reader` into wherever the backend's `layout` keeps them (its masters,
    `backends.masters`: DeepSpeed's masters and state, on NVMe a subgroup at a time, ZeRO-0's flat or per-parameter
    masters, FSDP's shards, or the parameter itself). With optimi's Kahan summation the rounding of each weight to
    its dtype starts its compensation."""
    named = [(name, p) for name, p in trainable(module) if name in names]
    compensated = moments and kahan.is_kahan(base)

    def values(name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {kind: reader.get(f"{kind}/{name}") for kind in KINDS
               if kind == "fp32" or moments and f"{kind}/{name}" in reader}
        if compensated:  # what rounding to the master's dtype loses, into optimi's compensation
            out[kahan.COMP] = kahan.remainder(out["fp32"], out["fp32"].to(dtype))
        return out

    layout.masters(base).write(named, values, partial(_step_value, base, t))


def _step_value(base: Any, t: int, device: Any = "cpu") -> Any:
    """torch's Adam/AdamW keep the step as a float tensor (float32 on the parameter's device when fused);
    DeepSpeed's Adams as an int."""
    if not isinstance(base, torch.optim.Adam | torch.optim.AdamW):
        return t
    fused = any(group.get("fused") for group in base.param_groups)
    return torch.tensor(float(t), dtype=torch.float32, device=device) if fused else torch.tensor(float(t))


def _prefill(held: masters.Masters, base: Any, t: int) -> None:
    """Create DeepSpeed's optimizer state (zeros, at step t) that its first step would create, and link it to
    the parameters, so `write` has somewhere to write before any step ran (optimi's groups set to step t)."""
    compensated = kahan.is_kahan(base)
    if compensated:
        kahan.set_clock(base, t)

    def fill(flat: torch.Tensor) -> None:
        if compensated:
            kahan.fill(base, flat)

    held.prefill(partial(_step_value, base, t), fill, t)


class Exact:
    """A fresh start under DeepSpeed in bf16/fp16: the fp32 masters get the loaded weights exactly.

    DeepSpeed casts the module to 16 bits in `prepare` and builds its fp32 masters from that cast, so the run would
    start from the pretrained (or initial) weights rounded to bf16 (8 significant bits; fp16 pretrained files lose 3
    of their 11) and export them so after any number of steps too small to move them. FSDP and DDP keep the loaded
    fp32 weights. Here the loaded tensors are held through `prepare` (DeepSpeed's cast makes new tensors; on a GPU the
    module moves to the device, so these host tensors are what was there before `prepare`, no more host memory) and
    written into the masters after it, as a resume writes carried weights. `kept`: whether the backend builds its
    masters from a cast (`Backend.masters_from_cast`); nothing is held otherwise."""

    def __init__(self, kept: bool, model: torch.nn.Module) -> None:
        self.weights = {f"fp32/{name}": p.data for name, p in trainable(model)} if kept else {}

    def __contains__(self, key: str) -> bool:
        return key in self.weights

    def get(self, key: str) -> torch.Tensor:
        return self.weights[key]

    def after_prepare(self, run: Run) -> None:
        """Collective: write the held fp32 weights into DeepSpeed's masters, then let them go."""
        if not self.weights:
            return
        names = {key.removeprefix("fp32/") for key in self.weights}
        base = inner.optimizer(run.accelerator, run.optimizer)
        write(run.params, run.accelerator.unwrap_model(run.model), base, self, names, moments=False, t=0)
        log.debug("fp32 masters set from the loaded weights (%d parameters)", len(names))
        self.weights = {}
