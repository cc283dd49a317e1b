"""The ranks as a data x context mesh (`parallel.context`): context parallelism splits one sample's
sequence over `context` consecutive ranks, which then see the same data; the data streams are one
per context group. Everything that divides samples among ranks (the loader, the batch plan,
validation's pairs, the samples' prompts, the counts of samples seen) asks this record for the data
coordinates instead of the process rank and count.

The gradient: each rank of a context group back-propagates through its part of the sequence alone,
so its gradient is a part of the sample's, and the group's parts sum to it. Every backend averages
the gradients over all ranks (DDP's all-reduce, DeepSpeed's and FSDP2's reduce-scatter), which
divides that sum by the context size too: the loss is multiplied by it before backward
(`loss_scale`), so the averaged gradient is the one a run without context parallelism takes, under
every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mesh:
    """Where this rank sits: `context` ranks a sample, the data's groups."""

    context: int
    rank: int
    world: int

    @classmethod
    def of(cls, cfg: Any, accelerator: Any = None) -> Mesh:
        parallel = cfg.get("parallel")
        context = int(parallel.context) if parallel is not None else 1
        if accelerator is None:
            return cls(context, 0, context)
        return cls(context, int(accelerator.process_index), int(accelerator.num_processes))

    @property
    def data_rank(self) -> int:
        """The data stream this rank reads (its context group's)."""
        return self.rank // self.context

    @property
    def data_world(self) -> int:
        """How many data streams there are (the context groups)."""
        return max(1, self.world // self.context)

    @property
    def context_rank(self) -> int:
        """This rank's part of its group's sequence."""
        return self.rank % self.context

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (the module docstring says why)."""
        return float(self.context)


def data_world(cfg: Any, accelerator: Any = None) -> int:
    """The data streams of a run: its processes over the context size (1 process without an
    Accelerator)."""
    return Mesh.of(cfg, accelerator).data_world if accelerator is not None else 1
