"""EMA of the UNet, kept outside ZeRO (on the CPU by default), sharded across the ranks.

Each rank owns a slice of the trained parameters (balanced by size, the same on every rank) and keeps and
updates the fp32 shadow of those alone: an EMA of SDXL's UNet (10.3 GB in fp32) costs each of 8 ranks 1.3 GB
of host memory and an eighth of the per-step copies and lerps, instead of 10.3 GB and all of them on every
rank (82 GB per 8-GPU node). The values are those of an unsharded EMA: each parameter's shadow is updated by
the same lerp on the same values, only on one rank.

The whole shadow is put together only when it is needed whole, and that is collective (every rank calls it):
`state_dict()` for a checkpoint (on rank 0; `ema.pt` stays one file that loads under any number of ranks),
`full()` for sampling and the export. Under ZeRO-3 the trained parameters are empty placeholders outside a
gather, so the update reads them inside `GatheredParameters`, a chunk at a time, on every rank (collective);
each rank keeps only its own slice of what was gathered.

Under FSDP2 the parameters are DTensors, each rank holding a dim-0 shard of every one: after `prepare` the shadow is
laid out the same way (`follow_shards`), so an update is a lerp of each rank's own shards with no communication at all
(by owner it would all-gather the whole UNet every step). `full()` gathers the shards, `load_state_dict` cuts them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from ds_trainer.train.backends import sharded

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole

log = logging.getLogger("ds_trainer")

_GATHER_CHUNK = 100_000_000  # elements gathered at once under ZeRO-3


def _chunks(params: list[torch.nn.Parameter], layout: Whole) -> Iterator[list[torch.nn.Parameter]]:
    chunk: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        numel = layout.numel(p)
        if chunk and size + numel > _GATHER_CHUNK:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += numel
    if chunk:
        yield chunk


def owners(sizes: dict[str, int], world: int) -> dict[str, int]:
    """The rank that owns each name: largest first to the least loaded rank (ties: the lower rank), so the
    slices differ by less than the largest parameter. Deterministic: every rank computes the same."""
    load = [0] * world
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


def for_run(cfg: DictConfig, accelerator: Any, model: torch.nn.Module, layout: Whole) -> EMA | None:
    """The run's EMA of the trained parameters (`train.ema`), on the host or the training device as
    `train.ema_device` says, sharded over the ranks; None without one."""
    if not cfg.train.ema:
        return None
    device = "cpu" if cfg.train.ema_device == "cpu" else str(accelerator.device)
    group = (accelerator.process_index, accelerator.num_processes, accelerator.device)
    ema = EMA(model, float(cfg.train.ema_decay), layout, device, group)
    if accelerator.num_processes > 1 and accelerator.is_main_process:
        whole = sum(torch.Size(s).numel() for s in ema.shapes.values()) * 4 / 2**20
        mine = sum(v.numel() for v in ema.shadow.values()) * 4 / 2**20
        log.info("EMA (%.0f MiB in fp32) sharded over %d ranks: rank 0 keeps and updates %.0f MiB of it",
                 whole, accelerator.num_processes, mine)
    return ema


class EMA:
    """Exponential moving average of named parameters, with the usual warm-up of the decay.

    `layout`: how the backend lays the parameters out (`Backend.params`); `group`: this rank's
    place (the shadow is sharded), the world size, and where a tensor must be for the process
    group's collectives (the GPU under NCCL, the CPU under gloo)."""

    def __init__(self, model: torch.nn.Module, decay: float, layout: Whole, device: str = "cpu",
                 group: tuple[int, int, Any] = (0, 1, "cpu")) -> None:
        self.decay, self.device, self.step, self.layout = decay, device, 0, layout
        self.rank, self.world, self.comm_device = group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = {n: layout.shape(p) for n, p in named}
        sizes = {n: int(torch.Size(s).numel()) for n, s in self.shapes.items()}
        self.owner = owners(sizes, self.world)
        self.shadow: dict[str, torch.Tensor] = {}  # this rank's slice
        # FSDP2 (after `follow_shards`): each name's DTensor layout; the shadow holds this rank's shard of every name.
        self.layouts: dict[str, sharded.Layout] = {}
        self._read(model, init=True)

    def follow_shards(self, model: torch.nn.Module) -> None:
        """Collective, once after `prepare` under FSDP2: from slices by owner to this rank's shard of every name, as
        the parameters are sharded. A no-op for parameters that are not DTensors."""
        named = dict(model.named_parameters())
        if self.layouts or not any(sharded.is_sharded(named[n]) for n in self.names):
            return
        self.layouts = {n: sharded.layout_of(named[n]) for n in self.names}
        # Each tensor cut into this rank's shard as it arrives from its owner: never the whole EMA on one rank
        self.shadow = {n: self._shard(n, value) for n, value in self._each()}

    def _shard(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole value of `name` (no communication: each rank cuts its own)."""
        return sharded.cut(value, self.layouts[name]).to(self.device, torch.float32, copy=True)

    def mine(self, name: str) -> bool:
        return self.owner[name] == self.rank

    def _read(self, model: torch.nn.Module, init: bool, weight: float = 1.0) -> None:
        named = dict(model.named_parameters())
        if self.layouts:  # FSDP2: this rank's shards, read where they are
            with torch.no_grad():
                for n in self.names:
                    mine = self.layout.storage(named[n])
                    self.shadow[n].lerp_(mine.to(self.device, torch.float32), weight)
            return
        split = self.layout.split(named[n] for n in self.names)
        # Held whole, every rank has every parameter: each reads its own. Split over the ranks the gather is
        # collective: every rank takes part in every chunk (every parameter under FSDP) and keeps its own names.
        params = [named[n] for n in self.names if split or self.mine(n)]
        by_id = {id(p): n for n, p in named.items()}
        for chunk in _chunks(params, self.layout):
            with self.layout.gathered(chunk), torch.no_grad():
                for p in chunk:
                    name = by_id[id(p)]
                    whole = self.layout.full(p.detach())  # collective for an FSDP parameter
                    if not self.mine(name):
                        continue
                    value = whole.to(self.device, torch.float32)
                    if init:
                        self.shadow[name] = value.clone()
                    else:
                        self.shadow[name].lerp_(value, weight)

    def update(self, model: torch.nn.Module) -> None:
        """Collective under ZeRO-3: call on every rank after each optimizer step."""
        self.step += 1
        decay = min(self.decay, (1 + self.step) / (10 + self.step))
        self._read(model, init=False, weight=1.0 - decay)

    def full(self, dst: int | None = None, device: Any = None) -> dict[str, torch.Tensor]:
        """Collective: the whole shadow (float32), on rank `dst` (None: on every rank; an empty dict on the
        others), each tensor sent by its owner, landing on `device` (default: where the shadow lives; a save asks
        for "cpu", so that a GPU-resident EMA is not gathered whole onto one GPU). One rank: the shadow itself."""
        where = self.device if device is None else device
        if self.layouts:
            return self._gather_shards(dst, where)
        if self.world == 1:
            return self.shadow if str(where) == str(self.device) else {n: v.to(where) for n, v in self.shadow.items()}
        own = str(where) == str(self.device)
        return {name: self.shadow[name] if own and self.mine(name) else value.to(where)
                for name, value in self._each() if dst is None or self.rank == dst}

    def _each(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every name's whole value on every rank, one tensor at a time from its owner, on the process
        group's device (the shadow as it is on one rank)."""
        if self.world == 1:
            yield from self.shadow.items()
            return
        import torch.distributed as dist

        for name in self.names:
            owner = self.owner[name]
            if self.rank == owner:
                buffer = self.shadow[name].to(self.comm_device)
            else:
                buffer = torch.empty(self.shapes[name], dtype=torch.float32, device=self.comm_device)
            dist.broadcast(buffer, src=owner)
            yield name, buffer

    def _gather_shards(self, dst: int | None, where: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for n in self.names:
            value = sharded.join(self.shadow[n], self.layouts[n])
            if dst is None or self.rank == dst:
                out[n] = value.to(where)
        return out

    @contextlib.contextmanager
    def applied(self, module: torch.nn.Module) -> Iterator[None]:
        """Collective: inside, the module's trained parameters hold the EMA's values (cast to their dtype), as its
        forward reads them under every layout; afterwards their own values, exactly. For a LoRA, whose EMA holds
        the adapters alone (the frozen base stays where it is). The optimizer's fp32 masters are not touched."""
        if self.layouts:
            sharded.reshard(module)  # the DTensors back in place of whole parameters a forward may have left
        named = dict(module.named_parameters())
        params = [named[n] for n in self.names]
        whole = {} if self.layouts else self.full()
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for n, p in zip(self.names, params, strict=True):
                target = self.layout.storage(p)  # this rank's partition or shard, or the tensor
                if self.layouts:  # FSDP2: the shadow holds this rank's shards
                    value = self.shadow[n]
                else:
                    value = self.layout.share(whole[n], p, self.rank)
                saved.append((target, target.detach().clone()))
                target.copy_(value.reshape(target.shape))
            self.layout.regather(params)
        try:
            yield
        finally:
            if self.layouts:
                sharded.reshard(module)  # no whole copy of the EMA's values may outlive this
            with torch.no_grad():
                for target, value in saved:
                    target.copy_(value)
                self.layout.regather(params)

    def state_dict(self) -> dict[str, Any]:
        """Collective: what `ema.pt` holds, the whole shadow, on rank 0 (the other ranks get theirs empty)."""
        return {"step": self.step, "decay": self.decay, "shadow": self.full(dst=0, device="cpu")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From a whole shadow (`ema.pt`, written under any number of ranks): this rank keeps its slice."""
        self.step = int(state["step"])
        if self.layouts:
            self.shadow = {k: self._shard(k, v) for k, v in state["shadow"].items()}
            return
        self.shadow = {k: v.to(self.device, torch.float32, copy=True) for k, v in state["shadow"].items()
                       if self.mine(k)}
