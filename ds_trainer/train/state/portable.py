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
from ds_trainer.train.backends import deepspeed, inner, nvme_swap, placement, sharded
from ds_trainer.train.state import adam8bit, kahan

if TYPE_CHECKING:
    from ds_trainer.train.run import Run

log = logging.getLogger("ds_trainer")

SHARD_BYTES = 1 << 30  # rank 0 holds at most one shard of gathered tensors at once
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def _shape(p: torch.nn.Parameter) -> list[int]:
    return list(placement.shape(p))


def _step_count(base: Any) -> int:
    grouped = kahan.step_count(base)
    if grouped is not None:
        return grouped
    steps = [int(s["step"]) for s in base.state.values() if isinstance(s, dict) and "step" in s]
    return max(steps) if steps else 0


def full_values(accelerator: Any, model: Any, base: Any, moments: bool,
                ) -> Iterator[tuple[str, torch.nn.Parameter, tuple[torch.Tensor | None, ...]]]:
    """Collective (every rank iterates to the end, in the same order): (name, parameter, its whole fp32 master weight
    and, with `moments`, Adam's `exp_avg` and `exp_avg_sq` (None where there are none)) for every trainable
    parameter, under any layout: DeepSpeed's kept-apart masters (ZeRO-1/2/3, BF16_Optimizer), ZeRO-0's flat or
    per-parameter 16-bit masters, ZeRO-3's state on NVMe (a subgroup swapped in once), FSDP's shards, or the
    parameter itself. `base` is the optimizer that holds the state (`backends.inner.optimizer`)."""
    named = trainable(accelerator.unwrap_model(model))
    engine = inner.engine(accelerator)
    zero = engine.optimizer if engine is not None else None
    if moments:
        _link_every_group(zero)
    if zero is None or not nvme_swap.swapping(zero):
        places, masters = deepspeed.flat_places(engine), deepspeed.unfused_masters(engine)
        for name, p in named:
            if id(p) in places:
                yield name, p, _read_flat(p, base, places[id(p)], moments)
            else:
                yield name, p, _read(masters.get(id(p), p), base, moments)
        return
    # ZeRO-3 with the optimizer state on NVMe: each subgroup swapped in once (see nvme_swap).
    names = {id(p): name for name, p in named}
    kinds = KINDS if moments and base.state else KINDS[:1]
    for group, _ in nvme_swap.subgroups(zero, write=False):
        for p in nvme_swap.params_of(zero, group):
            if id(p) in names:
                full = [nvme_swap.gather(zero, p, nvme_swap.partition(zero, base, p, kind)) for kind in kinds]
                yield names[id(p)], p, (*full, *[None] * (len(KINDS) - len(full)))


def _link_every_group(zero: Any) -> None:
    """DeepSpeed 0.19.8's ZeRO-1/2 links each parameter to its slice of the optimizer state once, right after the
    optimizer's first step of the first parameter group (`_optimizer_step` steps the groups one by one): with several
    groups (the UNet's and the trained text encoders') the later groups have no state yet then, stay unlinked, and
    `safe_get_full_optimizer_state` fails on them ("exp_avg not found in optimizer state fragment"). Linking again
    once every group has stepped reads them all; with one group it changes nothing."""
    groups = getattr(getattr(zero, "optimizer", None), "param_groups", [])
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state") and len(groups) > 1:
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _read_flat(p: torch.nn.Parameter, base: Any, place: tuple[torch.Tensor, int, int], moments: bool,
               ) -> tuple[torch.Tensor | None, ...]:
    """A parameter's fp32 master and moments, slices of its group's flat tensors (FP16_Optimizer)."""
    flat, offset, numel = place
    state = base.state.get(flat, {}) if moments else {}
    return tuple(t.narrow(0, offset, numel).view(p.shape) if t is not None else None
                 for t in (flat, state.get("exp_avg"), state.get("exp_avg_sq")))


def _read(p: torch.Tensor, base: Any, moments: bool) -> tuple[torch.Tensor | None, ...]:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    compensated = moments and kahan.is_kahan(base)  # the weight learned is w + c (kahan.py)
    if deepspeed.mapped(p):
        weight = safe_get_full_fp32_param(p)
        if not moments:
            return weight, None, None
        if compensated:
            weight = kahan.with_compensation(weight, safe_get_full_optimizer_state(p, kahan.COMP))
        return (weight, safe_get_full_optimizer_state(p, "exp_avg"),
                safe_get_full_optimizer_state(p, "exp_avg_sq"))
    state = base.state.get(p, {}) if moments else {}
    # Whole values (collective for FSDP's DTensors: every rank reads every parameter, in the same order).
    weight, exp_avg, exp_avg_sq = (sharded.full(t) if t is not None else None
                                   for t in (p.detach(), state.get("exp_avg"), state.get("exp_avg_sq")))
    if compensated and weight is not None:
        comp = state.get(kahan.COMP)
        weight = kahan.with_compensation(weight, sharded.full(comp) if comp is not None else None)
    return weight, exp_avg, exp_avg_sq


class Writer:
    """Writes `portable/` into a checkpoint folder being saved (`checkpoint.Saver` calls it, collectively)."""

    def __init__(self, run: Run, start: tuple[int, int]) -> None:
        cfg, accelerator = run.cfg, run.accelerator
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, run.model, run.optimizer, \
            run.scheduler
        self.start_step, self.start_samples = start
        self.global_batch = (int(cfg.train.micro_batch_size) * int(cfg.train.gradient_accumulation_steps)
                             * accelerator.num_processes)
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
            for name, p, values in full_values(self.accelerator, self.model, base, self.moments):  # collective
                params[name] = _shape(p)
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

        with safe_open(str(self.dir / self.index[key]), framework="pt") as f:
            return f.get_tensor(key)
