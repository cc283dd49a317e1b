"""What autograd keeps for backward, measured on the CPU (the planner's activation counts are checked
against it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def saved_bytes(forward: Callable[[], Any], held: Iterable[Any]) -> int:
    """Bytes autograd saves for backward in `forward()`: each saved tensor's storage once (a view
    counts as its base), the tensors in `held` (parameters, buffers: kept anyway) left out."""
    import torch

    skip, seen, total = {id(t) for t in held}, set[int](), [0]
    keep: list[torch.Tensor] = []  # alive until the end, so no id is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(base) not in seen and id(base) not in skip:
            seen.add(id(base))
            keep.append(base)
            total[0] += base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total[0]
