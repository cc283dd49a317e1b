"""`train.compile`: torch.compile (inductor) on the trained module, and the clock of the time it takes.

`blocks` compiles each repeated block in place (`module.compile()`: the module, its parameters and its state-dict
names stay what they were, so checkpoints, exports and the backends' hooks see the eager module); the blocks of one
class share their compiled code, so a model of 19 like blocks compiles about once per shape. `full` compiles the whole
trained module in place: longer to compile, fewer graph breaks. A compile happens at the first call of each new
shape or mode (the first step, a sample's no-grad forward, a bucket of another size), not at build time.

The clock sums the wall time of torch's compilations (dynamo's trace, the graphs' inductor compile and a backward
compiled lazily at the first backward), from torch's own compile callbacks: the step subtracts it from s/it and the
summary reports it apart (`compile_s`, `compilations`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from ds_trainer.errors import InputError

log = logging.getLogger("ds_trainer")


class _Clock:
    """The seconds spent compiling in this process so far, and how many compilations."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.count = 0
        self._since: float | None = None
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        self._installed = True

    def _start(self, _args: Any) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def _end(self, _args: Any) -> None:
        with self._lock:
            if self._since is not None:
                self.seconds += time.perf_counter() - self._since
                self.count += 1
                self._since = None


CLOCK = _Clock()


def seconds() -> float:
    """Compile time spent in this process so far (0 when nothing compiled)."""
    return CLOCK.seconds


def apply(module: torch.nn.Module, mode: str, blocks: list[str]) -> int:
    """Compile `module` as `train.compile` says (in place); returns how many modules were compiled (0: none)."""
    if mode == "none":
        return 0
    CLOCK.install()
    if mode == "full":
        module.compile()
        log.info("compile: the whole trained module (torch.compile, inductor); it compiles at its first step, and "
                 "again at each new shape; the time is reported apart from s/it")
        return 1
    names = set(blocks)
    found = [m for m in module.modules() if type(m).__name__ in names]
    if not found:
        raise InputError(f"model.compile_blocks={sorted(names)}: no module of these classes in the trained "
                         f"{type(module).__name__}, so train.compile=blocks would compile nothing. Fix: name its "
                         "repeated block classes in model.compile_blocks, or train.compile=full")
    for block in found:
        block.compile()
    kinds = sorted({type(m).__name__ for m in found})
    log.info("compile: %d blocks (%s) of the trained module (torch.compile, inductor); they compile at the first "
             "step, and again at each new shape; the time is reported apart from s/it", len(found), ", ".join(kinds))
    return len(found)
