"""The planner's quantized frozen base (`quantize=int8|nf4|fp8`): what bitsandbytes or torchao holds for each linear
layer.

nf4 (`Linear4bit`, blocks of 64, the blocks' scales quantized again in blocks of 256): half a byte a weight, a uint8
scale a block, a float32 scale per 256 blocks, the two code books (16 and 256 float32) and an offset. int8
(`Linear8bitLt`) and fp8 (torchao's Float8Tensor, e4m3): a byte a weight and a float32 scale a row. Measured equal on
the tiny models (tests/test_quantize.py: the run's resident bytes against these).
"""

from __future__ import annotations

import math
from typing import Any


def linear_layers(module: Any) -> list[tuple[int, int]]:
    """(weights, rows) of each layer `quantize=` replaces (train/adapters/quantize.py's `linears`), in module order."""
    from ds_trainer.train.adapters import quantize

    return [(m.in_features * m.out_features, m.out_features) for _, m in quantize.linears(module)]


def layer_bytes(kind: str, weights: int, rows: int) -> int:
    """One quantized linear layer's weight, its scales and code books, in bytes."""
    if kind in ("int8", "fp8"):  # a byte a weight and an fp32 scale a row (bitsandbytes' SCB, torchao's scale)
        return weights + 4 * rows
    blocks = math.ceil(weights / 64)
    return math.ceil(weights / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * (16 + 256) + 4


def saved(kind: str, layers: list[tuple[int, int]], dtype_bytes: int, ranks: int = 1) -> int:
    """What quantizing `layers` takes off their weights held at `dtype_bytes` a weight (0 for quantize=none), per
    rank. `ranks` > 1: ZeRO-3, which partitions nf4's packed weights (held in 16-bit tensors: the same bytes) over
    the ranks and leaves their scales and code books whole on each."""
    if kind == "none":
        return 0
    if ranks == 1:
        return sum(dtype_bytes * weights - layer_bytes(kind, weights, rows) for weights, rows in layers)
    return packed_saved(layers, dtype_bytes) // ranks - scale_bytes(kind, layers)


def packed_saved(layers: list[tuple[int, int]], dtype_bytes: int) -> int:
    """What nf4's packed weights (half a byte a weight) take off `layers` held at `dtype_bytes` a weight."""
    return sum(dtype_bytes * weights - math.ceil(weights / 2) for weights, _ in layers)


def scale_bytes(kind: str, layers: list[tuple[int, int]]) -> int:
    """The scales and code books beside nf4's packed weights of `layers` (ZeRO-3 leaves them whole on every rank)."""
    return sum(layer_bytes(kind, weights, rows) - math.ceil(weights / 2) for weights, rows in layers)
