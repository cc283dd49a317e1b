"""Where a prepared run's optimizer keeps each trainable parameter's fp32 master and its state,
under every layout, as the portable state, a resume's carry and schedule-free's evaluation weights
ask for them: read whole, written whole, or this rank's part moved in place.

DeepSpeed keeps the master apart (ZeRO-3's partition, ZeRO-1/2's and BF16_Optimizer's fragment of a
flat partition: `safe_get/set_full_*` reach them), or on ZeRO-0 in 16 bits in the optimizer's fp32
groups (FP16_Optimizer: one flat tensor per group, the state on it; FP16_UnfusedOptimizer: one per
parameter); ZeRO-3 with the optimizer state on NVMe swaps it in a subgroup at a time (nvme_swap.py).
FSDP2 keeps a DTensor shard and the state beside it, DDP the parameter itself. A state is named by
its key in the optimizer's state ("exp_avg", "exp_avg_sq", optimi's "kahan_comp"), the master by
`FP32`. Every read and write of a whole value is collective: every rank calls in the same order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from ds_trainer.train.backends import inner, nvme_swap, sharded

FP32 = "fp32"
MOMENTS = ("exp_avg", "exp_avg_sq")
# (name, parameter) -> the whole values to write, by kind (FP32 and states), given the dtype the
# master is kept in (where a compensation is computed from the rounding)
Values = Callable[[str, torch.dtype], dict[str, torch.Tensor]]
Write = Callable[[torch.Tensor], Any]


def mapped(p: Any) -> bool:
    """Whether DeepSpeed keeps this parameter's fp32 master apart (ZeRO-1/2/3, BF16_Optimizer)."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def flat_places(engine: Any) -> dict[int, tuple[Any, int, int]]:
    """ZeRO-0 with bf16/fp16 (DeepSpeed's FP16_Optimizer keeps one flat fp32 master per group, and
    the Adam state on it): each parameter's (flat master, offset, numel), by the parameter's id.
    Empty elsewhere."""
    outer = engine.optimizer if engine is not None else None
    flats, groups = getattr(outer, "fp32_groups_flat", None), getattr(outer, "fp16_groups", None)
    places: dict[int, tuple[Any, int, int]] = {}
    if flats is None or groups is None:  # ZeRO-3 has fp16_groups too, but partitioned masters
        return places
    for flat, params in zip(flats, groups, strict=True):
        offset = 0
        for p in params:  # flattened in this order, without padding
            places[id(p)] = (flat, offset, p.numel())
            offset += p.numel()
    return places


def unfused_masters(engine: Any) -> dict[int, Any]:
    """ZeRO-0 with bf16/fp16 and an optimizer ds_trainer built (DeepSpeed's FP16_UnfusedOptimizer
    keeps an fp32 master per parameter, and the optimizer's state on it): each 16-bit parameter's
    master, by its id. Empty without such an optimizer (or without DeepSpeed: `engine` None)."""
    outer: Any = engine.optimizer if engine is not None else None
    if type(outer).__name__ != "FP16_UnfusedOptimizer":
        return {}
    return {
        id(p): master
        for group, masters in zip(outer.fp16_groups, outer.fp32_groups, strict=True)
        for p, master in zip(group, masters, strict=True)
    }


def zero0_views(engine: Any) -> dict[int, torch.Tensor]:
    """ZeRO-0 with bf16/fp16: each 16-bit parameter's fp32 master by its id, a view into its group's
    flat master (FP16_Optimizer) or its own (FP16_UnfusedOptimizer), which DeepSpeed's
    `safe_get_full_fp32_param` does not know. Empty elsewhere."""
    places, views = flat_places(engine), unfused_masters(engine)
    if not places:
        return views
    for group in engine.optimizer.fp16_groups:  # flat_places' groups, in its order
        for p in group:
            flat, offset, n = places[id(p)]
            views[id(p)] = flat[offset : offset + n].view_as(p)
    return views


class Masters:
    """The masters and state of a prepared run: `base` is the optimizer that holds the state
    (`inner.optimizer`), `engine` DeepSpeed's (None under FSDP2 and DDP)."""

    def __init__(self, engine: Any, base: Any) -> None:
        self.engine, self.base = engine, base
        self.zero: Any = engine.optimizer if engine is not None else None

    @classmethod
    def of(cls, accelerator: Any, optimizer: Any) -> Masters:
        return cls(inner.engine(accelerator), inner.optimizer(accelerator, optimizer))

    def swapping(self) -> bool:
        """Whether the state lives on NVMe (ZeRO-3's optimizer swap), a subgroup at a time in
        memory."""
        return self.zero is not None and nvme_swap.swapping(self.zero)

    def link_every_group(self) -> None:
        """DeepSpeed 0.19.8's ZeRO-1/2 links each parameter to its slice of the optimizer state
        once, right after the optimizer's first step of the first parameter group (`_optimizer_step`
        steps the groups one by one): with several groups (the UNet's and the trained text
        encoders') the later groups have no state yet then, stay unlinked, and
        `safe_get_full_optimizer_state` fails on them ("exp_avg not found in optimizer state
        fragment"). Linking again once every group has stepped reads them all; with one group it
        changes nothing."""
        groups = getattr(getattr(self.zero, "optimizer", None), "param_groups", [])
        if hasattr(self.zero, "_lazy_init_hp_params_optimizer_state") and len(groups) > 1:
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()

    # --- whole values

    def read(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        kinds: tuple[str, ...],
    ) -> Iterator[tuple[str, torch.nn.Parameter, dict[str, torch.Tensor | None]]]:
        """Collective (every rank iterates to the end, in the same order): (name, parameter, the
        whole value of each of `kinds`, None where the state has none) for each named parameter.
        Under ZeRO-3's NVMe swap the order is the subgroups' (each swapped in once), and only the
        master and Adam's moments are read."""
        if self.swapping():
            yield from self._read_swapped(named, kinds)
            return
        places, masters = flat_places(self.engine), unfused_masters(self.engine)
        for name, p in named:
            if id(p) in places:
                yield name, p, self._read_flat(p, places[id(p)], kinds)
            else:
                yield name, p, self._read_whole(masters.get(id(p), p), kinds)

    def _read_flat(
        self,
        p: torch.nn.Parameter,
        place: tuple[torch.Tensor, int, int],
        kinds: tuple[str, ...],
    ) -> dict[str, torch.Tensor | None]:
        """Slices of the group's flat master and state (FP16_Optimizer)."""
        flat, offset, numel = place
        state = self.base.state.get(flat, {})
        tensors = {kind: flat if kind == FP32 else state.get(kind) for kind in kinds}
        return {
            kind: t.narrow(0, offset, numel).view(p.shape) if t is not None else None
            for kind, t in tensors.items()
        }

    def _read_whole(
        self, p: torch.Tensor, kinds: tuple[str, ...]
    ) -> dict[str, torch.Tensor | None]:
        if mapped(p):
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            out = {}
            for kind in kinds:  # in this order on every rank (each is collective)
                if kind == FP32:
                    out[kind] = safe_get_full_fp32_param(p)
                else:
                    out[kind] = safe_get_full_optimizer_state(p, kind)
            return out
        state = self.base.state.get(p, {})
        tensors = {kind: p.detach() if kind == FP32 else state.get(kind) for kind in kinds}
        return {kind: sharded.full(t) if t is not None else None for kind, t in tensors.items()}

    def _read_swapped(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        kinds: tuple[str, ...],
    ) -> Iterator[tuple[str, torch.nn.Parameter, dict[str, torch.Tensor | None]]]:
        names = {id(p): name for name, p in named}
        held = [k for k in kinds if k == FP32 or (k in MOMENTS and self.base.state)]
        for group, _ in nvme_swap.subgroups(self.zero, write=False):
            for p in nvme_swap.params_of(self.zero, group):
                if id(p) in names:
                    full = {
                        k: nvme_swap.gather(
                            self.zero, p, nvme_swap.partition(self.zero, self.base, p, k)
                        )
                        for k in held
                    }
                    yield names[id(p)], p, {k: full.get(k) for k in kinds}

    def write(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        values: Values,
        step: Callable[[Any], Any],
    ) -> None:
        """Collective: each named parameter's master and states from `values` (whole, the same on
        every rank), into wherever this layout keeps them. Where the optimizer keeps a parameter's
        state itself (FSDP2, DDP, ZeRO-0's basic optimizer), a moment written makes its state anew,
        at `step(device)`. Under ZeRO-3's NVMe swap and ZeRO-0's flat masters only the master and
        Adam's moments are written."""
        if self.swapping():
            self._write_swapped(named, values)
            return
        places, masters = flat_places(self.engine), unfused_masters(self.engine)
        for name, p in named:
            if id(p) in places:
                self._write_flat(places[id(p)], values(name, torch.float32))
            # a 16-bit parameter holds the weight already (set before `prepare`); its fp32 master
            # gets it too
            else:
                target = masters.get(id(p), p)
                self._write_whole(target, values(name, target.dtype), step)

    def _write_whole(
        self, p: torch.Tensor, values: dict[str, torch.Tensor], step: Callable[[Any], Any]
    ) -> None:
        if mapped(p):
            from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

            safe_set_full_fp32_param(p, values[FP32].to(p.device))
            for kind, value in values.items():
                if kind != FP32:
                    safe_set_full_optimizer_state(p, value.to(p.device), kind)
            return
        with torch.no_grad():
            p.copy_(sharded.like(values[FP32], p))  # FSDP: this rank's shard of it
        states = {kind: sharded.like(value, p) for kind, value in values.items() if kind != FP32}
        if "exp_avg" in states:
            self.base.state[p] = {"step": step(p.device), **states}

    def _write_flat(
        self, place: tuple[torch.Tensor, int, int], values: dict[str, torch.Tensor]
    ) -> None:
        """ZeRO-0 with bf16/fp16: the fp32 master and moments are slices of the group's flat
        tensors; the bf16/fp16 parameter already holds the carried weight (loaded before `prepare`,
        then cast)."""
        flat, offset, numel = place
        with torch.no_grad():
            for kind in (FP32, *MOMENTS):
                if kind in values:
                    target = flat if kind == FP32 else self.base.state[flat][kind]
                    target.narrow(0, offset, numel).copy_(values[kind].flatten())

    def _write_swapped(self, named: list[tuple[str, torch.nn.Parameter]], values: Values) -> None:
        """ZeRO-3 with the optimizer state on NVMe: each subgroup swapped in once, written, swapped
        out."""
        names = {id(p): name for name, p in named}
        for group, _ in nvme_swap.subgroups(self.zero, write=True):
            for p in nvme_swap.params_of(self.zero, group):
                name = names.get(id(p))
                if name is None:
                    continue
                for kind, value in values(name, torch.float32).items():
                    if kind in (FP32, *MOMENTS):
                        nvme_swap.scatter(
                            self.zero, p, nvme_swap.partition(self.zero, self.base, p, kind), value
                        )

    def prefill(
        self, step: Callable[[], Any], fill: Callable[[torch.Tensor], None], t: int
    ) -> None:
        """Create DeepSpeed's optimizer state (zeros, at `step()`) that its first step would create,
        and link it to the parameters, so a write has somewhere to go before any step ran; `fill`
        adds to each flat state what the optimizer keeps beside the moments. ZeRO-0's basic
        optimizer gets its groups' step count `t`. A no-op without DeepSpeed (the state is made as
        it is written)."""
        zero = self.zero
        if zero is None:
            return
        if nvme_swap.swapping(
            zero
        ):  # the state lives on NVMe: created in each subgroup while it is swapped in
            for _, flat in nvme_swap.subgroups(zero, write=True):
                self.base.state[flat] = {
                    "step": step(),
                    "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat),
                }
            return
        flats = (
            getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3
            or getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
            or getattr(zero, "fp32_groups_flat_partition", None)  # BF16_Optimizer
            or getattr(zero, "fp32_groups_flat", None)
        )  # FP16_Optimizer (ZeRO-0 with bf16/fp16)
        if not flats:
            for group in (
                self.base.param_groups
            ):  # ZeRO-0: the basic optimizer holds the module's parameters
                group["step"] = t
            return
        for flat in flats:
            self.base.state[flat] = {
                "step": step(),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
            fill(flat)
        if hasattr(
            zero, "_lazy_init_hp_params_optimizer_state"
        ):  # ZeRO-1/2 link lazily, after the first step
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()

    # --- this rank's part, moved in place (schedule-free's evaluation weights)

    def local(
        self,
        named: list[tuple[str, torch.nn.Parameter]],
        kind: str,
    ) -> Iterator[tuple[torch.nn.Parameter, Any, Any, Write | None]]:
        """(parameter, its fp32 master (this rank's part under ZeRO), the matching part of state
        `kind`, how to set the master) for each named parameter; the master is None where this rank
        holds no part of it."""
        masters = unfused_masters(self.engine)
        for _, p in named:
            if hasattr(
                p, "ds_id"
            ):  # ZeRO-3: this rank's partition (a copy on the device when the state is offloaded)
                from deepspeed.utils import (
                    safe_get_local_fp32_param,
                    safe_get_local_optimizer_state,
                )

                yield (
                    p,
                    safe_get_local_fp32_param(p),
                    safe_get_local_optimizer_state(p, kind),
                    partial(_set_local, p),
                )
            elif hasattr(
                p, "_hp_mapping"
            ):  # ZeRO-1/2 (and BF16_Optimizer): the fragment of the flat partition
                mapping = p._hp_mapping
                if mapping is None:
                    yield p, None, None, None
                    continue
                master = mapping.get_hp_fragment()
                yield p, master, (mapping.optim_fragment or {}).get(kind), master.copy_
            else:  # the parameter itself (ddp, ZeRO-0 fp32), or its own fp32 master (ZeRO-0 16-bit)
                master = masters.get(id(p), p)
                yield p, master, self.base.state[master][kind], master.data.copy_

    def refresh(self, params: list[torch.nn.Parameter]) -> None:
        """Collective: the module's weights from the (moved or restored) fp32 masters, as
        DeepSpeed's step leaves them."""
        masters = unfused_masters(self.engine)
        gathered: list[Any] = []
        for p in params:
            if hasattr(p, "ds_id"):
                from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
                from deepspeed.utils import safe_get_local_fp32_param

                z3: Any = p  # DeepSpeed's partitioned parameter
                z3.ds_tensor.data.copy_(safe_get_local_fp32_param(p).view(-1))
                if z3.ds_status == ZeroParamStatus.AVAILABLE:
                    gathered.append(p)
            elif hasattr(p, "_hp_mapping"):
                from deepspeed.utils import safe_get_full_fp32_param

                p.data.copy_(safe_get_full_fp32_param(p))  # collective: joins every rank's fragment
            elif id(p) in masters:
                p.data.copy_(masters[id(p)])
        if gathered:
            # ZeRO-3 keeps small parameters whole on every rank (and may keep others gathered): a
            # gather skips a whole parameter, so it is released first and gathered again from the
            # partitions just written.
            gathered[0].partition(gathered)
            gathered[0].all_gather(gathered)


def restore_optimizer_clocks(engine: Any, optimizer_step: int | None = None) -> None:
    """After a DeepSpeed checkpoint load, restore what `load_checkpoint` leaves out, so that a
    resumed run takes the same steps as an uninterrupted one, bit for bit.

    - The learning rate the optimizer holds: DeepSpeed restores its LR scheduler's position but not
      the rate the scheduler had set for the next step (visible during warmup).
    - DeepSpeed's C++ Adam (`DeepSpeedCPUAdam` for CPU and NVMe offload, `FusedAdam` on the CPU
      accelerator) keeps beta1**t and beta2**t as running float32 products inside a C++ object that
      a new process creates afresh; its first step after a resume computes them with pow() instead,
      which differs from the running product in the last bit for most t, and the bias correction
      with it. Replaying steps 1..t on empty tensors rebuilds the same running products. (CUDA's
      FusedAdam computes pow() every step and needs nothing.) The step t comes from the optimizer's
      state, or where that is swapped out to NVMe (not in `base.state` between steps), from
      `optimizer_step` (the portable state's count)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if engine.lr_scheduler is not None:
        engine.lr_scheduler.step(engine.lr_scheduler.last_batch_iteration)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if not isinstance(base, DeepSpeedCPUAdam | FusedAdam):
        # no running products outside the state (a client optimizer: Adagrad, Lion, Prodigy, ...)
        return
    steps = {int(s["step"]) for s in base.state.values() if isinstance(s, dict) and "step" in s}
    if not steps and optimizer_step:
        steps = {optimizer_step}
    if len(steps) != 1 or not base.param_groups:
        return
    (t,), group, empty = steps, base.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    hyper = (group["lr"], beta1, beta2, group["eps"])
    if isinstance(base, DeepSpeedCPUAdam):
        for s in range(1, t + 1):
            base.ds_opt_adam.adam_update(
                base.opt_id,
                s,
                *hyper,
                group["weight_decay"],
                group["bias_correction"],
                empty,
                empty,
                empty,
                empty,
            )
    elif isinstance(base, FusedAdam) and get_accelerator().device_name() == "cpu":
        lists = [[empty] for _ in range(4)]
        for s in range(1, t + 1):
            base.multi_tensor_adam(
                2048,
                base._dummy_overflow_buf,
                lists,
                *hyper,
                s,
                base.adam_w_mode,
                int(group["bias_correction"]),
                group["weight_decay"],
            )


def _set_local(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_local_fp32_param

    safe_set_local_fp32_param(p, value)
