"""The libraries a training run imports, taken once before the run: without bitsandbytes unless the run uses it.

diffusers and peft import bitsandbytes whenever it is installed, for quantized layers a ds_trainer run never builds
(its base models load in the precision the `precision` group names); importing it sets torch.compile up for its
kernels, about 0.7 s of every run's start-up on the CPUs measured here. bitsandbytes is a dependency for one choice,
`optimizer=adamw8bit`: every other run imports diffusers and peft with it taken as absent, so that each answers
"not installed" to its own question, once, and the module is importable again as soon as they are in (the 8-bit
moments of a checkpoint carried into another optimizer are read with it later in the same process).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


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


def for_run(uses_bitsandbytes: bool) -> None:
    """Import the libraries whose import decides whether bitsandbytes is imported with them."""
    with contextlib.nullcontext() if uses_bitsandbytes else absent("bitsandbytes"):
        import diffusers.utils.import_utils  # noqa: F401 - diffusers asks here, once per process
        import peft  # noqa: F401 - peft asks on import (and caches the answer)
