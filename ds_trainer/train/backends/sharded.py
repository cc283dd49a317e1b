"""FSDP2's parameters and optimizer state are DTensors: each rank holds a dim-0 shard (possibly empty) of every
tensor. The code that reads or writes whole values (EMA, portable state, LoRA file, resume) goes through these
functions, which leave plain tensors (DDP, DeepSpeed) as they are."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t` on every rank. Collective for a DTensor: every rank calls it, in the same order.

    Under FSDP2's CPU offload a shard lives on the host while its mesh is "cuda", whose NCCL group serves CUDA
    tensors only ("No backend type associated with device type cpu"): the shard moves to the mesh's device first,
    as torch's own full state dict does."""
    if not is_sharded(t):
        return t
    mesh_device = t.device_mesh.device_type  # type: ignore[attr-defined]
    if t.device.type != mesh_device:
        t = t.to(mesh_device)
    return t.full_tensor()  # type: ignore[attr-defined,no-any-return]


def like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`value` (whole, the same on every rank) laid out as `p`: this rank's shard of it for a DTensor, in `p`'s
    dtype and where `p`'s shard lives. No communication: each rank cuts its own shard.

    The shard is cut on the mesh's device, then moved beside `p`'s own: under FSDP2's CPU offload the parameter's
    shard is on the host while its mesh is "cuda", and Adam's moments written on the GPU would meet a CPU gradient
    at the first step."""
    if not is_sharded(p):
        return value.to(p.device, p.dtype).reshape(p.shape)
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = p.device_mesh  # type: ignore[attr-defined]
    shard = distribute_tensor(value.to(mesh.device_type, p.dtype).reshape(p.shape), mesh,
                              p.placements, src_data_rank=None)  # type: ignore[attr-defined]
    here = p.to_local().device  # type: ignore[attr-defined]
    if shard.to_local().device == here:
        return shard
    return DTensor.from_local(shard.to_local().to(here), mesh, p.placements,  # type: ignore[attr-defined]
                              shape=p.shape, stride=p.stride())


def reshard(module: torch.nn.Module) -> None:
    """Every FSDP2 unit of `module` back to its shards: under shard-grad-op (no reshard after forward) a forward
    leaves the unit's parameters whole, plain tensors standing in for the DTensors; whoever writes the shards must
    call this first, and again after forwards that ran on values it put there (the whole copies would outlive them).
    A no-op outside FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


@contextlib.contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """Inside, the parameters FSDP2's root unit of `module` holds (those outside every inner unit) are whole, so its
    submodules can be called on their own (a pipeline calls the UNet and the text encoders of a
    `text_encoders.Denoiser` one by one; the inner units gather their own as they run). Collective: every rank
    enters. A no-op outside FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        reshard(module)  # the root unit, and the inner ones a forward under shard-grad-op left whole


# A DTensor's layout: its mesh, placements, whole shape and stride (what cutting and joining its shards needs).
Layout = tuple[Any, Any, torch.Size, tuple[int, ...]]


def layout_of(t: Any) -> Layout:
    return (t.device_mesh, t.placements, t.shape, t.stride())


def cut(value: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's shard of a whole value laid out as `layout` (no communication: each rank cuts its own)."""
    from torch.distributed.tensor import distribute_tensor

    mesh, placements, shape, _ = layout
    return distribute_tensor(value.to(mesh.device_type, torch.float32).reshape(shape), mesh, placements,
                             src_data_rank=None).to_local()


def join(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Collective: the whole value of the shards laid out as `layout`, this rank's being `local`."""
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = layout
    return DTensor.from_local(local.to(mesh.device_type), mesh, placements, shape=shape,  # type: ignore[no-any-return]
                              stride=stride).full_tensor()
