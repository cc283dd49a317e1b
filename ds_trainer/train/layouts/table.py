"""A maker's file as a table: each of its tensors (`Part`) is one diffusers tensor renamed, or several concatenated
along the first dimension (a fused qkv), then perhaps reordered or reshaped. The one table serves the weights (a
single file in the makers' layout) and the LoRA (kohya's names, which follow the maker's modules): a LoRA on
diffusers' separate to_q/to_k/to_v is the block-diagonal LoRA of the fused qkv, exactly."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

# What a part does to the concatenated diffusers tensor.
RENAME, SWAP, TRANSPOSE, CONV = "", "swap", "transpose", "conv"


@dataclass(frozen=True)
class Part:
    key: str  # the maker's name of the tensor
    sources: tuple[str, ...]  # diffusers' names, concatenated along dim 0 in this order
    op: str = RENAME  # SWAP: the two halves exchanged (shift/scale); TRANSPOSE; CONV: a Linear weight as a 1x1 conv's

    @property
    def module(self) -> str:
        return self.key.removesuffix(".weight")


class LayoutError(ValueError):
    """diffusers tensors the table has no place for (or lacks): a model this layout does not describe."""


def apply(op: str, value: torch.Tensor) -> torch.Tensor:
    """What a part's `op` does to its (concatenated) diffusers tensor; SWAP and TRANSPOSE are their own inverses."""
    if op == SWAP:
        first, second = value.chunk(2, dim=0)
        return torch.cat([second, first], dim=0)
    if op == TRANSPOSE:
        return value.T.contiguous()
    if op == CONV:
        return value.reshape(*value.shape, 1, 1)
    return value


def weights(parts: Iterable[Part], state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """`state` (diffusers' names) under the maker's names; every tensor of `state` must find its part."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for part in parts:
        missing = [s for s in part.sources if s not in state]
        if missing:
            raise LayoutError(f"{prefix}{part.key} needs {missing[0]}, which the model does not have")
        values = [state[s] for s in part.sources]
        out[prefix + part.key] = apply(part.op, values[0] if len(values) == 1 else torch.cat(values)).contiguous()
        used.update(part.sources)
    left = sorted(set(state) - used)
    if left:
        raise LayoutError(f"{len(left)} tensors have no place in the layout (e.g. {left[0]})")
    return out


@dataclass(frozen=True)
class Lora:
    """One LoRA in the maker's module names: `down` [rank, in(, k, k)], `up` [out, rank(, 1, 1)], and `alpha`, so
    that the weight moves by alpha / rank * up @ down."""

    module: str
    down: torch.Tensor
    up: torch.Tensor
    alpha: float


def lora(parts: Iterable[Part], adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor, float]],
         rows: Mapping[str, int]) -> list[Lora]:
    """Diffusers modules' LoRA ({module: (A, B, alpha)}, A [r, in], B [out, r]) as the maker's modules' LoRA. A part
    fusing several modules gets their A stacked and their B on the block diagonal (a module not adapted gets zero
    rows: `rows` gives each diffusers weight's output size); its alpha keeps alpha / rank, the scale each module had
    (folded into B where the modules' differ)."""
    out: list[Lora] = []
    used: set[str] = set()
    for part in parts:
        mine = [(s.removesuffix(".weight"), adapters.get(s.removesuffix(".weight"))) for s in part.sources]
        trained = [(module, found) for module, found in mine if found is not None]
        if not trained:
            continue
        if part.op == CONV or any(not s.endswith(".weight") for s in part.sources):
            raise LayoutError(f"a LoRA on {trained[0][0]} has no kohya form ({part.key} is not a linear weight)")
        used.update(module for module, _ in trained)
        scale = trained[0][1][2] / trained[0][1][0].shape[0]
        if len(mine) == 1:
            down, up = trained[0][1][0], trained[0][1][1]
        else:
            rank = sum(found[0].shape[0] for _, found in trained)
            down = torch.cat([found[0] for _, found in trained])
            sizes = [rows[s] for s in part.sources]
            up = torch.zeros(sum(sizes), rank, dtype=down.dtype)
            row = col = 0
            for (_, found), size in zip(mine, sizes, strict=True):
                if found is not None:
                    r = found[0].shape[0]
                    up[row:row + size, col:col + r] = found[1] * (found[2] / r / scale)
                    col += r
                row += size
        if part.op == SWAP:
            up = apply(SWAP, up)
        elif part.op == TRANSPOSE:
            down, up = up.T.contiguous(), down.T.contiguous()
        out.append(Lora(part.module, down.contiguous(), up.contiguous(), scale * down.shape[0]))
    left = sorted(set(adapters) - used)
    if left:
        raise LayoutError(f"a LoRA on {left[0]}, which the layout has no tensor for")
    return out
