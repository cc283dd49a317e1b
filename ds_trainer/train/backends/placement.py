"""A parameter under any layout, as the parts of a run ask about it: its whole shape and size, this
rank's share of it, and its fp32 master read or set whole. ZeRO-3 partitions a parameter (its data
gathered away, this rank's share in `ds_tensor`, the whole shape in `ds_shape`); ZeRO-1/2 keep the
fp32 master as a fragment of a flat partition (`_hp_mapping`); ZeRO-0 in 16 bits keeps it in the
optimizer's fp32 groups; FSDP2 holds a DTensor shard (sharded.py); DDP the tensor itself. Only this
folder names those attributes (tests/test_architecture.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from ds_trainer.train.backends import sharded


def shape(p: Any) -> tuple[int, ...]:
    """The whole parameter's shape (ZeRO-3's partitioned parameter is empty here)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def numel(p: Any) -> int:
    """The whole parameter's element count."""
    return int(getattr(p, "ds_numel", p.numel()))


def partitioned(p: Any) -> bool:
    """Whether ZeRO-3 partitions it (its whole value exists only inside a gather)."""
    return hasattr(p, "ds_id")


def split(params: Iterable[Any]) -> bool:
    """Whether any of them is split over the ranks (ZeRO-3's partitions, FSDP2's shards): reading
    one whole is then collective."""
    return any(partitioned(p) or sharded.is_sharded(p) for p in params)


def local(p: Any) -> torch.Tensor | None:
    """This rank's share of a parameter that is split over the ranks (ZeRO-3's partition, FSDP2's
    shard); None for one held whole."""
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor  # type: ignore[no-any-return]
    if sharded.is_sharded(p):
        return p.detach().to_local()  # type: ignore[no-any-return]
    return None


def storage(p: Any) -> torch.Tensor:
    """Where this rank keeps the parameter's values: its share where it is split, else the tensor's
    data."""
    mine = local(p)
    return p.data if mine is None else mine  # type: ignore[no-any-return]


def gathered(params: list[Any]) -> contextlib.AbstractContextManager[Any]:
    """Collective where ZeRO-3 partitions any of them (every rank enters it with the same list):
    inside, they hold their whole values (read-only); a no-op context otherwise."""
    held = [p for p in params if partitioned(p)]
    if not held:
        return contextlib.nullcontext()
    import deepspeed

    gather = deepspeed.zero.GatheredParameters(held, modifier_rank=None)
    return gather  # type: ignore[no-any-return]


def whole_copies(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float32 copy of each parameter's whole value on every rank: gathered from ZeRO-3's
    partitions or FSDP2's shards, else the tensor's own. Collective: every rank calls it with the
    same names in the same order."""
    with gathered(list(params.values())):
        return {name: sharded.full(p).detach().to(torch.float32, copy=True)
                for name, p in params.items()}


def partition_of(whole: torch.Tensor, share: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 partition (`share`: its storage) of a whole value: its contiguous share of
    the flattened tensor, zero-padded."""
    n = share.numel()
    flat = whole.reshape(-1)[rank * n : (rank + 1) * n]
    out = torch.zeros(n, dtype=share.dtype, device=share.device)
    out[: flat.numel()] = flat
    return out


def regather(params: list[Any]) -> None:
    """After writing ZeRO-3 partitions: ZeRO-3 keeps small parameters whole on every rank (and may
    keep others gathered); those are released and gathered again from the partitions just written
    (collective). A no-op for parameters ZeRO-3 does not partition."""
    if not any(partitioned(p) for p in params):
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    available = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
    if available:
        available[0].partition(available)
        available[0].all_gather(available)


def _deepspeed_master(p: Any) -> bool:
    """Whether DeepSpeed maps its fp32 master (ZeRO-3's partition, ZeRO-1/2's fragment), which its
    `safe_get_full_fp32_param` / `safe_set_full_fp32_param` read and write."""
    return partitioned(p) or hasattr(p, "_hp_mapping")


def zero0_masters(engine: Any) -> dict[int, torch.Tensor]:
    """ZeRO-0 with bf16/fp16 (FP16_Optimizer or FP16_UnfusedOptimizer): the fp32 master of each
    16-bit parameter by its id, which `safe_get_full_fp32_param` does not know (it returns None
    there); empty elsewhere."""
    optimizer: Any = getattr(engine, "optimizer", None) if engine is not None else None
    groups16 = getattr(optimizer, "fp16_groups", None)
    if groups16 is None:
        return {}
    masters: dict[int, torch.Tensor] = {}
    if hasattr(optimizer, "fp32_groups_flat"):
        for params, flat in zip(groups16, optimizer.fp32_groups_flat, strict=True):
            offset = 0
            for p in params:
                masters[id(p)] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    elif hasattr(optimizer, "fp32_groups"):
        for params, fp32 in zip(groups16, optimizer.fp32_groups, strict=True):
            masters.update({id(p): m for p, m in zip(params, fp32, strict=True)})
    return masters


def full_fp32(p: Any, masters: dict[int, torch.Tensor]) -> torch.Tensor:
    """Collective: the fp32 master's whole value (DeepSpeed's for a parameter it maps, `masters`'
    under ZeRO-0 in 16 bits, the gathered DTensor or the tensor otherwise). Every rank calls it in
    the same order."""
    if _deepspeed_master(p):
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(p)  # type: ignore[no-any-return]
    return sharded.full(masters.get(id(p), p))


def set_full_fp32(p: Any, value: torch.Tensor, masters: dict[int, torch.Tensor]) -> None:
    """Collective: set the fp32 master and the parameter to `value` (whole, the same on every rank).
    """
    if _deepspeed_master(p):
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(p, value.to(p.device))
    elif id(p) in masters:
        masters[id(p)].copy_(value.view_as(masters[id(p)]))
    with torch.no_grad():
        if not partitioned(p):
            p.copy_(sharded.like(value, p))
