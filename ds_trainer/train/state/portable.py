"""The portable state of a checkpoint, and resuming from it under another configuration.

Next to DeepSpeed's native files every checkpoint gets `portable/`: per trainable parameter (by name)
the fp32 master weight and, for Adam/AdamW, `exp_avg` and `exp_avg_sq`, in safetensors shards; the
optimizer step count and hyperparameters, the data position in samples and the layout in `meta.json`;
the LR scheduler's state in `scheduler.pt` (the EMA is the checkpoint's `ema.pt`). It is read and
written one parameter at a time through DeepSpeed's `safe_get/set_full_*` API (collective under ZeRO:
every rank calls, rank 0 writes), so no rank holds a second full copy of model and optimizer.

A resume under the same layout stays DeepSpeed's native load (bit-exact). Under another layout the
weights go into the module before `prepare`, and after it into the fp32 masters and optimizer state.
DeepSpeed creates its optimizer state only in the first step, so that state is created here, zero
and at the saved step count, before the values are written into it (see `_prefill`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_trainer.config import portability
from ds_trainer.errors import TrainingError
from ds_trainer.train.backends import inner
from ds_trainer.train.state import adam8bit, kahan

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")

SHARD_BYTES = 1 << 30  # rank 0 holds at most one shard of gathered tensors at once
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]




def _step_count(base: Any) -> int:
    grouped = kahan.step_count(base)
    if grouped is not None:
        return grouped
    steps = [int(s["step"]) for s in base.state.values() if isinstance(s, dict) and "step" in s]
    return max(steps) if steps else 0


def full_values(layout: Whole, module: Any, base: Any, moments: bool,
                ) -> Iterator[tuple[str, torch.nn.Parameter, tuple[torch.Tensor | None, ...]]]:
    """Collective (every rank iterates to the end, in the same order): (name, parameter, its whole fp32 master weight
    and, with `moments`, Adam's `exp_avg` and `exp_avg_sq` (None where there are none)) for every trainable
    parameter of the unwrapped `module`, under the backend's `layout` (its masters:
    `backends.masters`). `base` is the optimizer that holds the state (`backends.inner.optimizer`).
    With optimi's Kahan summation the weight is the one learned, w + c."""
    named = trainable(module)
    held = layout.masters(base)
    compensated = moments and kahan.is_kahan(base)
    if moments:
        held.link_every_group()
    kinds = ("fp32", *((kahan.COMP,) if compensated else ()), *(KINDS[1:] if moments else ()))
    for name, p, got in held.read(named, kinds):
        weight = got["fp32"]
        if compensated and weight is not None:
            weight = kahan.with_compensation(weight, got[kahan.COMP])
        yield name, p, (weight, got.get("exp_avg"), got.get("exp_avg_sq"))


def saved_state(path: Path, what: str, **load: Any) -> dict[str, Any]:
    """A dict of tensors and numbers a checkpoint holds (`what`: the LR schedule's
    `scheduler.pt`, the EMA's `ema.pt`), read with torch's weights-only unpickler: it builds
    tensors, numbers, strings and containers and nothing else, so a file planted in a checkpoint
    cannot run code. Refused with its path when it holds anything else or is damaged."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, **load)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise TrainingError(
            f"resume: {path} is not the {what} state a run writes ({why}): torch's "
            "weights-only load takes numbers and tensors only, and this file holds other objects "
            "or is damaged; nothing was loaded from it. Resume from a checkpoint a ds_trainer run "
            "wrote (a file from elsewhere can run code when unpickled)") from None
    if not isinstance(state, dict):
        raise TrainingError(f"resume: {path} holds a {type(state).__name__}, not the {what} state "
                            "(a dict); resume from a checkpoint a ds_trainer run wrote")
    return state


def scheduler_state(path: Path) -> dict[str, Any]:
    """The LR schedule's state in a checkpoint's portable state (`scheduler.pt`; `saved_state`)."""
    return saved_state(path, "LR schedule")


class Writer:
    """Writes `portable/` into a checkpoint folder being saved (`checkpoint.Saver` calls it, collectively)."""

    def __init__(self, run: Run, start: tuple[int, int]) -> None:
        cfg, accelerator = run.cfg, run.accelerator
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, run.model, run.optimizer, \
            run.scheduler
        self.layout = run.params
        self.start_step, self.start_samples = start
        self.global_batch = (int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps)
                             * run.mesh.data_world)
        ident = portability.identity(cfg)
        self.meta: dict[str, Any] = {"format": 1, "layout": portability.layout(cfg), "identity": ident}
        self.moments = ident["optimizer"] in portability.MOMENT_OPTIMIZERS

    def samples(self, step: int) -> int:
        """Samples the run has trained on after `step` (counted across resumes with other batch sizes)."""
        return self.start_samples + (step - self.start_step) * self.global_batch

    def __call__(self, folder: Path, step: int) -> None:
        begin, main = time.perf_counter(), self.accelerator.is_main_process
        out = folder / "portable"
        if main:
            out.mkdir(parents=True, exist_ok=True)
        base = inner.optimizer(self.accelerator, self.optimizer)
        shard: dict[str, torch.Tensor] = {}
        index: dict[str, str] = {}
        params: dict[str, list[int]] = {}
        written, without_moments = 0, 0
        # 8-bit moments (bitsandbytes): read as the fp32 moments they encode.
        with adam8bit.exposed(inner.engine(self.accelerator), base):
            module = self.accelerator.unwrap_model(self.model)
            values_of = full_values(self.layout, module, base, self.moments)  # collective
            for name, p, values in values_of:
                params[name] = list(self.layout.shape(p))
                if not main:
                    continue
                without_moments += values[1] is None
                for kind, value in zip(KINDS, values, strict=True):
                    if value is not None:
                        shard[f"{kind}/{name}"] = value.detach().to("cpu", torch.float32).reshape(params[name]).clone()
                if sum(t.numel() * 4 for t in shard.values()) >= SHARD_BYTES:
                    written += self._flush(out, shard, index)
        if main:
            written += self._flush(out, shard, index)
            sched = inner.scheduler(self.accelerator, self.scheduler)
            if sched is not None:
                torch.save(sched.state_dict(), out / "scheduler.pt")
            group = base.param_groups[0]
            hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
            meta = {**self.meta, "step": step, "samples": self.samples(step), "optimizer_step": _step_count(base),
                    "moments": self.moments and not without_moments, "hyper": hyper, "params": params,
                    "index": index, "bytes": written}
            (out / "meta.json").write_text(json.dumps(meta, indent=1, default=list))
            log.info("portable state of step %d: %d parameters, %.1f MiB in %.1fs", step, len(params),
                     written / 2**20, time.perf_counter() - begin)
            if self.moments and without_moments:  # before the first step there are none yet
                log.warning("portable state of step %d: no Adam moments for %d parameters under this layout; a "
                            "resume under another one needs resume_optimizer=reset", step, without_moments)

    @staticmethod
    def _flush(out: Path, shard: dict[str, torch.Tensor], index: dict[str, str]) -> int:
        if not shard:
            return 0
        from safetensors.torch import save_file

        name = f"state-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / name))
        size = sum(t.numel() * t.element_size() for t in shard.values())
        index.update(dict.fromkeys(shard, name))
        shard.clear()
        return size


class Reader:
    """Tensors of a portable state, one at a time (memory-mapped shards)."""

    def __init__(self, checkpoint: Path, meta: dict[str, Any]) -> None:
        self.dir, self.index = Path(checkpoint) / "portable", meta["index"]

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.dir / self.index[key]
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:  # safetensors' own error type, OSError: the file is named
            why = str(exc).strip()[:200] or type(exc).__name__
            raise TrainingError(f"resume: {path} cannot be read as the portable state's "
                                f"safetensors shard ({why}, reading {key}): the file is damaged or "
                                "not the one the run wrote. Resume from another checkpoint "
                                "(resume=<run dir>/checkpoints/step_N)") from None
