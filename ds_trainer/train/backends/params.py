"""A parameter under the run's layout, as the parts of a run ask about it: its whole shape and size,
this rank's share of it, its whole value (gathered), and its fp32 master read or set whole. Each
backend gives one object (`Backend.params`): DDP `Whole`, FSDP2 `Sharded`, DeepSpeed `Zero`.

ZeRO-3 partitions a parameter (its data gathered away, this rank's share in `ds_tensor`, the whole
shape in `ds_shape`); ZeRO-1/2 keep the fp32 master as a fragment of a flat partition
(`_hp_mapping`); ZeRO-0 in 16 bits keeps it in the optimizer's fp32 groups; FSDP2 holds a DTensor
shard (sharded.py); DDP the tensor itself. A parameter a sharding backend leaves whole (a frozen
part built outside zero.Init or fully_shard) is answered as `Whole` answers it. Only this folder
names those attributes (tests/test_architecture.py). Whatever reads or writes a whole value of a
split parameter is collective: every rank calls it with the same parameters in the same order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_trainer.train.backends import masters, sharded


def shape(p: Any) -> tuple[int, ...]:
    """The whole parameter's shape under every layout: a ZeRO-3 partition records it (`ds_shape`),
    a DTensor has it. What reads a module before or without a run (a LoRA file's key table, a
    count of trainable parameters, `convert`) asks here; a run's parts ask their backend's
    object."""
    return tuple(getattr(p, "ds_shape", p.shape))


def numel(p: Any) -> int:
    """The whole parameter's element count under every layout (`shape`'s)."""
    return int(getattr(p, "ds_numel", p.numel()))


class Whole:
    """Every parameter held whole on every rank (DDP, one process)."""

    sharder = ""  # what splits the trained parameters, as a log says it: "ZeRO-3 partitions"

    @property
    def shards(self) -> bool:
        """Whether the backend splits the trained parameters over the ranks."""
        return bool(self.sharder)

    def shape(self, p: Any) -> tuple[int, ...]:
        """The whole parameter's shape."""
        return shape(p)

    def numel(self, p: Any) -> int:
        """The whole parameter's element count."""
        return numel(p)

    def partitioned(self, p: Any) -> bool:  # noqa: ARG002
        """Whether its whole value exists only inside `gathered` (ZeRO-3's partitions)."""
        return False

    def local(self, p: Any) -> torch.Tensor | None:  # noqa: ARG002
        """This rank's share of a parameter split over the ranks; None for one held whole."""
        return None

    def storage(self, p: Any) -> torch.Tensor:
        """Where this rank keeps the parameter's values: its share where it is split, else the
        tensor's data."""
        mine = self.local(p)
        if mine is None:
            return p.data  # type: ignore[no-any-return]
        return mine

    def split(self, params: Iterable[Any]) -> bool:
        """Whether any of them is split over the ranks: reading one whole is then collective."""
        return any(self.local(p) is not None for p in params)

    def gathered(self, params: list[Any]) -> contextlib.AbstractContextManager[Any]:  # noqa: ARG002
        """Inside, the parameters hold their whole values (read-only); collective where they are
        partitioned (every rank enters it with the same list)."""
        return contextlib.nullcontext()

    def full(self, p: Any) -> torch.Tensor:
        """Inside `gathered`: the parameter's whole value (collective for a shard)."""
        return p  # type: ignore[no-any-return]

    def whole_copies(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A float32 copy of each parameter's whole value on every rank. Collective where they are
        split: every rank calls it with the same names in the same order."""
        with self.gathered(list(params.values())):
            return {name: self.full(p).detach().to(torch.float32, copy=True)
                    for name, p in params.items()}

    def share(self, whole: torch.Tensor, p: Any, rank: int) -> torch.Tensor:  # noqa: ARG002
        """This rank's share of a whole value of `p`, shaped as `storage(p)` (no communication)."""
        return whole.reshape(self.storage(p).shape)

    def regather(self, params: list[Any]) -> None:
        """After writing the shares of partitioned parameters: the copies a backend keeps whole
        are rebuilt from them (collective). A no-op here."""

    def fp32(self, p: Any) -> torch.Tensor:
        """Collective where split: the fp32 master's whole value (the parameter itself here)."""
        return self.full(p)

    def set_fp32(self, p: Any, value: torch.Tensor) -> None:
        """Collective where split: set the fp32 master and the parameter to `value` (whole, the same
        on every rank)."""
        with torch.no_grad():
            if not self.partitioned(p):
                p.copy_(sharded.like(value, p))

    def masters(self, base: Any) -> masters.Masters:
        """The fp32 masters and optimizer state of the prepared run (`base`: the optimizer that
        holds the state, `inner.optimizer`)."""
        return masters.Masters(None, base)


class Sharded(Whole):
    """FSDP2: the trained parameters are DTensor shards, the frozen parts plain tensors."""

    sharder = "FSDP2 shards"

    def local(self, p: Any) -> torch.Tensor | None:
        if sharded.is_sharded(p):
            return p.detach().to_local()  # type: ignore[no-any-return]
        return None

    def full(self, p: Any) -> torch.Tensor:
        return sharded.full(p)


class Zero(Whole):
    """DeepSpeed ZeRO 0-3: `engine` gives the prepared engine (None before `prepare`), whose
    optimizer keeps the fp32 masters apart from a 16-bit module."""

    def __init__(self, engine: Callable[[], Any], stage: int) -> None:
        self.engine, self.stage = engine, stage
        self.sharder = "ZeRO-3 partitions" if stage == 3 else ""
        self._views: tuple[Any, dict[int, torch.Tensor]] = (None, {})

    def _zero0(self) -> dict[int, torch.Tensor]:
        """ZeRO-0 in 16 bits: each parameter's fp32 master by its id (`masters.zero0_views`), read
        once per engine."""
        engine = self.engine()
        if self._views[0] is not engine:
            self._views = (engine, masters.zero0_views(engine))
        return self._views[1]

    def partitioned(self, p: Any) -> bool:
        return hasattr(p, "ds_id")

    def local(self, p: Any) -> torch.Tensor | None:
        return getattr(p, "ds_tensor", None)

    def gathered(self, params: list[Any]) -> contextlib.AbstractContextManager[Any]:
        held = [p for p in params if self.partitioned(p)]
        if not held:
            return contextlib.nullcontext()
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(held, modifier_rank=None)
        return gather  # type: ignore[no-any-return]

    def share(self, whole: torch.Tensor, p: Any, rank: int) -> torch.Tensor:
        """ZeRO-3's partition: this rank's contiguous share of the flattened value, zero-padded."""
        if not self.partitioned(p):
            return super().share(whole, p, rank)
        mine = self.storage(p)
        n = mine.numel()
        flat = whole.reshape(-1)[rank * n : (rank + 1) * n]
        out = torch.zeros(n, dtype=mine.dtype, device=mine.device)
        out[: flat.numel()] = flat
        return out

    def regather(self, params: list[Any]) -> None:
        """ZeRO-3 keeps small parameters whole on every rank (and may keep others gathered): those
        are released and gathered again from the partitions just written."""
        if not any(self.partitioned(p) for p in params):
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        available = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
        if available:
            available[0].partition(available)
            available[0].all_gather(available)

    def fp32(self, p: Any) -> torch.Tensor:
        """DeepSpeed's master for a parameter it maps (ZeRO-3's partition, ZeRO-1/2's fragment);
        ZeRO-0 in 16 bits the optimizer's fp32 group; else the parameter."""
        if masters.mapped(p):
            from deepspeed.utils import safe_get_full_fp32_param

            return safe_get_full_fp32_param(p)  # type: ignore[no-any-return]
        return self._zero0().get(id(p), p)

    def set_fp32(self, p: Any, value: torch.Tensor) -> None:
        if masters.mapped(p):
            from deepspeed.utils import safe_set_full_fp32_param

            safe_set_full_fp32_param(p, value.to(p.device))
        else:
            views = self._zero0()
            if id(p) in views:
                views[id(p)].copy_(value.view_as(views[id(p)]))
        super().set_fp32(p, value)

    def masters(self, base: Any) -> masters.Masters:
        return masters.Masters(self.engine(), base)
