"""ZeRO-3's NVMe optimizer swap: a fix for DeepSpeed 0.19's gradient read, and subgroup-wise state access.

The gradient read. Under `offload_optimizer.device: nvme` DeepSpeed writes each fp32 gradient of 1 MiB or
more to its own swap file after backward, and before the optimizer step reads it back straight into its
slice of the subgroup's flat gradient buffer (`PartitionedOptimizerSwapper._swap_in_pinned_gradients`).
The async_io op opens the file with O_DIRECT, which needs a buffer address aligned to 512 bytes; a slice
that starts anywhere else is not read at all, yet the op reports the read done. The optimizer then steps
that parameter with whatever the buffer held before: measured here (ext4, DeepSpeed 0.19.8), the fp32
weights of the subgroup, so the largest parameter of the tiny UNet trained on a wrong gradient from step
1 while every other layout agreed with each other. `align_gradient_reads` reads such slices through an
aligned buffer and copies them into place.

Subgroup-wise access. DeepSpeed's per-parameter `safe_get/set_full_*` swap the parameter's whole subgroup
(the fp32 master and both Adam moments) in and out on every call: three times per parameter, so a
checkpoint of the tiny UNet's portable state took 31 s instead of 0.3 s, and SDXL's (subgroups of 1e9
elements) would take days. `subgroups` swaps each subgroup in once and hands out every parameter's slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

O_DIRECT_ALIGNMENT = 512  # bytes: what the async_io op's O_DIRECT reads need of the buffer address


def align_gradient_reads() -> None:
    """Make DeepSpeed's swapped-gradient read correct for slices at unaligned addresses (idempotent)."""
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
    from deepspeed.runtime.swap_tensor.utils import swap_in_tensors

    if getattr(PartitionedOptimizerSwapper, "_ds_trainer_aligned_reads", False):
        return

    def _swap_in_pinned_gradients(self: Any, aio_handle: Any, parameter: Any, gradient_tensor: Any) -> None:
        info = self.swap_params_info[OptimizerSwapper.parameter_id(parameter)]
        parts = [(gradient_tensor.narrow(0, g.offset, g.length), g.path) for g in info.swapped_gradients.values()]
        aligned = [(view, path) for view, path in parts if view.data_ptr() % O_DIRECT_ALIGNMENT == 0]
        unaligned = [(view, path) for view, path in parts if view.data_ptr() % O_DIRECT_ALIGNMENT != 0]
        if aligned:
            swap_in_tensors(aio_handle, [v for v, _ in aligned], [p for _, p in aligned])
            assert aio_handle.wait() == len(aligned)
        for view, path in unaligned:
            scratch = _scratch(self, aio_handle, view.numel(), view.dtype)
            swap_in_tensors(aio_handle, [scratch], [path])
            assert aio_handle.wait() == 1
            view.copy_(scratch)

    PartitionedOptimizerSwapper._swap_in_pinned_gradients = _swap_in_pinned_gradients
    PartitionedOptimizerSwapper._ds_trainer_aligned_reads = True


def _scratch(swapper: Any, aio_handle: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-aligned pinned buffer of at least `numel` elements, kept on the swapper for the next read."""
    held = getattr(swapper, "_ds_trainer_scratch", None)
    if held is None or held.numel() < numel or held.dtype != dtype:
        held = aio_handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=dtype))
        swapper._ds_trainer_scratch = held
    return held.narrow(0, 0, numel)  # type: ignore[no-any-return]


def swapping(zero: Any) -> bool:
    """Whether this ZeRO-3 optimizer keeps its optimizer state on NVMe."""
    return bool(getattr(zero, "swap_optimizer", False))


def subgroups(zero: Any, write: bool) -> Iterator[tuple[int, Any]]:
    """Each subgroup of a swapping ZeRO-3 optimizer, swapped in for the body and out after it (written back
    when `write`, else only released): yields (index, the subgroup's fp32 flat tensor)."""
    for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
        swapped = zero._swappable_optimizer_subgroup(i)
        if swapped:
            zero._optimizer_states_and_gradient_swap_in(i)
        try:
            yield i, flat
        finally:
            if swapped and write:
                zero._optimizer_states_and_gradient_swap_out(i)
            elif swapped:
                zero._release_swap_buffers(i)


def partition(zero: Any, base: Any, p: Any, kind: str) -> torch.Tensor:
    """This rank's slice of parameter p's fp32 master (`fp32`) or Adam moment, in its swapped-in subgroup."""
    group, offset, numel = zero.grad_position[zero.get_param_id(p)]
    flat = zero.fp32_partitioned_groups_flat[group]
    source = flat if kind == "fp32" else base.state[flat][kind]
    return source.narrow(0, offset, numel)  # type: ignore[no-any-return]


def params_of(zero: Any, group: int) -> list[Any]:
    return list(zero.fp16_groups[group])


def gather(zero: Any, p: Any, part: torch.Tensor) -> torch.Tensor:
    """The full tensor of p from every rank's slice (collective)."""
    return zero._fp32_state_allgather(p, part).reshape(list(p.ds_shape))  # type: ignore[no-any-return]


def scatter(zero: Any, p: Any, part: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's slice of the full tensor into its place."""
    rank = zero._get_param_partition_rank(p)
    part.data.copy_(full.flatten().narrow(0, part.numel() * rank, part.numel()).to(part.device, part.dtype))
