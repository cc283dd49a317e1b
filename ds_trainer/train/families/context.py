"""`parallel.context`: one sample's sequence split over the ranks of a context group, through
diffusers' context-parallel plan of the trained transformer (`_cp_plan`: where its inputs are split
along the sequence and its output gathered) and its attention dispatch (Ulysses: an all-to-all
before and after attention, each rank attending over the whole sequence for its share of the heads).
Every rank of a group ends with the whole prediction and the same loss; the gradient's parts and the
data's streams are the mesh's (train/backends/mesh.py).

Applied to the built module before its backend prepares it (FSDP2 wraps it after, DeepSpeed
partitions it after) and after the adapters are injected (the plan's hooks sit on the modules that
are there then).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ds_trainer.train.backends.mesh import Mesh

log = logging.getLogger("ds_trainer")


def split(model: torch.nn.Module, mesh: Mesh, attention: str, plan: dict[str, Any] | None) -> None:
    """Split `model`'s sequence over the context groups of `mesh` (nothing for a context of 1);
    `plan`: the family's own plan where diffusers has none for the class (None: the class's)."""
    if mesh.context <= 1:
        return
    from diffusers.models._modeling_parallel import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    device = torch._C._get_accelerator().type
    ring = mesh.context if attention == "ring" else 1
    ulysses = mesh.context // ring
    grid = init_device_mesh(device, (mesh.data_world, ring, ulysses),
                            mesh_dim_names=("dp", "ring", "ulysses"))
    config = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses,
                                   mesh=grid["ring", "ulysses"])
    with _quiet(), _one_device_on_a_cpu():
        model.enable_parallelism(config=config, cp_plan=plan)  # type: ignore[operator]
    log.info("parallel.context=%d: each sample's sequence is split over %d ranks (%s attention), "
             "%d data stream(s)", mesh.context, mesh.context, attention, mesh.data_world)


@contextlib.contextmanager
def _one_device_on_a_cpu() -> Iterator[None]:
    """diffusers places a rank on device `rank % torch.accelerator.device_count()`, which is a
    division by zero on a machine without an accelerator: there, every rank's device is the CPU."""
    count = torch.accelerator.device_count
    if count() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.device_count = count  # type: ignore[assignment]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """diffusers' warning that the API is experimental, said once in our log rather than the
    terminal."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)
