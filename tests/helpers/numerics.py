"""How two training runs that should agree are compared, on any x86 CPU.

Two runs that differ only in layout (ranks, ZeRO stage, micro-batch split, DDP or DeepSpeed, the all-reduce's
transport) add the same numbers in another order. The difference this leaves is not bounded element by element:
Adam divides each gradient by the root of its own second moment, so a parameter whose true gradient is about
zero (a bias ahead of a GroupNorm, a weight feeding a saturated unit) takes steps of about the learning rate whose
sign is decided by summation-order noise. Its value in two correct runs can then differ by a few learning rates
while everything else agrees to 1e-8. How many such elements there are, and how far they go, depends on the CPU's
kernels: measured on an AMX Xeon, two straight fp32 runs of 8 steps (ZeRO-2 on two ranks, DDP on one) differed by
up to 4e-5 in max abs difference, which failed a 2e-5 bound with nothing wrong.

The mean absolute difference over every element is the measure that holds: those elements are few, so it stays
small for two correct runs while the failures the tests guard against move it by orders of magnitude. Measured
on the portable-state chain of tests/test_portable.py (tiny UNet, fp32, weights of mean magnitude 0.032, steps at
lr up to 1e-4): correct carries between layouts differ by 1e-10 to 3e-9 here (AMD EPYC, AVX-512) and 4e-9 on an
AMX Xeon; a resume that lost the Adam state (resume_optimizer=reset four steps earlier) by 4.4e-5 (1.5e-4 on the
Xeon); a single 295k-element tensor stepped on a stale gradient (DeepSpeed's unaligned NVMe read) by ~5e-6. The
bound, 2e-7, is 70x above the largest noise and 25x below the smallest of those failures. Adam moments are
compared relative to their own mean magnitude: 3e-6 to 1.4e-4 for correct carries (the higher under bf16), 0.3 to
0.45 for a lost state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

WEIGHTS = 2e-7  # mean |a - b| over all elements, for weights that moved a few steps at lr ~1e-4


def mean_abs_difference(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """The mean of |got - expected| over every element of every tensor (the same keys and shapes)."""
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))[:5]
    total, count = 0.0, 0
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        total += float((got[key].double() - value.double()).abs().sum())
        count += value.numel()
    return total / max(count, 1)


def mean_abs(tensors: Mapping[str, torch.Tensor]) -> float:
    """The mean magnitude of the elements: the scale a relative comparison divides by."""
    total = sum(float(t.double().abs().sum()) for t in tensors.values())
    return total / max(sum(t.numel() for t in tensors.values()), 1)


def assert_same_weights(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str,
                        tolerance: float = WEIGHTS) -> None:
    """Two runs' weights agree up to summation order (see the module's docstring for the bound)."""
    difference = mean_abs_difference(got, expected)
    assert difference <= tolerance, f"{what}: weights differ by {difference:.3g} on average (allowed {tolerance:.3g})"


def assert_same_moments(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str,
                        tolerance: float = 1e-3) -> None:
    """Adam moments agree relative to their own scale (a lost or stale moment is off by ~100% of it)."""
    difference, scale = mean_abs_difference(got, expected), mean_abs(expected)
    assert difference <= tolerance * scale, (f"{what}: moments differ by {difference:.3g} on average, "
                                             f"{difference / max(scale, 1e-30):.3g} of their scale {scale:.3g}")


def assert_same_image(got: object, expected: object, what: str) -> None:
    """Two 8-bit images the same computation drew, a sampler's in the run and the exported pipeline's: equal,
    except a value that lands within rounding of a half step may round the other way (measured: Qwen-Image-Edit's
    tiny DDP sample on an AMD EPYC, 1 of 49,152 values off by 1 from the exported pipeline's, at HEAD 40dc5d0 as
    after it; equal on the machine that wrote the test). At most 1 step, in at most 1 in 10,000 values: a wrong
    weight, prompt or seed changes most pixels."""
    import numpy as np

    a, b = np.asarray(got).astype(int), np.asarray(expected).astype(int)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    off = np.abs(a - b)
    assert off.max() <= 1, (what, int(off.max()))
    assert (off > 0).mean() <= 1e-4, (what, float((off > 0).mean()))
