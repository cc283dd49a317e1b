"""The libraries a training run imports, taken once before the run: without bitsandbytes unless the run uses it.

diffusers and peft import bitsandbytes whenever it is installed, for quantized layers a ds_trainer run never builds
(its base models load in the precision the `precision` group names); importing it sets torch.compile up for its
kernels, about 0.7 s of every run's start-up on the CPUs measured here. bitsandbytes is a dependency for one choice,
`optimizer=adamw8bit`: every other run imports diffusers and peft with it taken as absent, so that each answers
"not installed" to its own question, once, and the module is importable again as soon as they are in (the 8-bit
moments of a checkpoint carried into another optimizer are read with it later in the same process).

A DeepSpeed run also imports DeepSpeed's Muon module here, with its torch.compile set-up deferred to the first call
(`muon_compiled_on_first_call`): about 1 s of CPU in every DeepSpeed process otherwise (measured 7.6 -> 6.7 s of
CPU, 7.3 -> 6.3 s of wall time for a one-step ZeRO-2 run, 4 pairs).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def absent(module: str) -> Iterator[None]:
    """`module` looks not installed inside the block (importlib.util.find_spec says None, `import` fails), unless
    something imported it already."""
    if module in sys.modules:
        yield
        return
    sys.modules[module] = None  # type: ignore[assignment]  # Python's own marker for "no such module here"
    try:
        yield
    finally:
        if module in sys.modules and sys.modules[module] is None:
            del sys.modules[module]


def for_run(uses_bitsandbytes: bool, deferred_muon: bool = False) -> None:
    """Import the libraries whose import decides whether bitsandbytes is imported with them; with `deferred_muon`
    (a DeepSpeed run: every ZeRO optimizer imports it), DeepSpeed's Muon module with torch.compile deferred to the
    first call."""
    with contextlib.nullcontext() if uses_bitsandbytes else absent("bitsandbytes"):
        import diffusers.utils.import_utils  # noqa: F401 - diffusers asks here, once per process
        import peft  # noqa: F401 - peft asks on import (and caches the answer)
    if deferred_muon:
        muon_compiled_on_first_call()


def compiled_on_first_call(**options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator like `torch.compile(**options)` that calls torch.compile on the function at its first call."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                import torch

                compiled.append(torch.compile(fn, **options))
            return compiled[0](*args, **kwargs)

        return call

    return decorate


def muon_compiled_on_first_call() -> None:
    """Import DeepSpeed's Muon module with its `@compiler.compile()` functions compiled at their first call.

    Every ZeRO optimizer (and ZeRO-0's bf16 one) imports it at init, to ask whether the optimizer is Muon; at import
    its three decorated functions go through torch.compile, whose set-up imports TorchInductor and functorch's
    partitioner (about 1 s of CPU in every DeepSpeed process's start-up here, for functions only Muon calls).
    torch.compile of a function compiles nothing until the function is called, so deferring the call to torch.compile
    changes nothing for a Muon run but when that set-up happens."""
    if "deepspeed.runtime.zero.muon.original_muon" in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile
    # Only while the module is imported: its decorators call `compiler.compile()` once each.
    compiler.compile = lambda: compiled_on_first_call()  # type: ignore[assignment]
    try:
        import deepspeed.runtime.zero.muon.original_muon  # noqa: F401
    finally:
        compiler.compile = eager
