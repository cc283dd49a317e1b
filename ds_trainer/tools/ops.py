"""`python -m ds_trainer.tools.ops`: build DeepSpeed's ops ahead of the first run (`make ops`).

DeepSpeed compiles an op the first time a run uses it (ZeRO's Adam, CPU-offload Adam, NVMe's async_io):
measured here, the first ZeRO-2 run reached its first step after 44.8 s instead of 8.1 s. The build
lands in this Python environment's folder under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions;
see config/op_cache.py): point that at a folder every node of a cluster sees (a shared home or project
folder) so that each new node does not compile again.
"""

from __future__ import annotations

import logging
import sys

from ds_trainer import console

# What the optimizer and offload groups can ask for, by DeepSpeed's builder names; every DeepSpeed process on
# the CPU accelerator also loads its communication op (ShareMemCommBuilder) when it starts.
OPS = ["FusedAdamBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
       "ShareMemCommBuilder"]


def main(argv: list[str] | None = None) -> int:
    """Build (or find built) every op this accelerator has; report each on one line."""
    from ds_trainer.config import op_cache

    console.for_tool(logging.WARNING)  # DeepSpeed's "Setting accelerator to CPU" is not news here

    where = op_cache.prepare()  # the folder runs of this environment load them from, built as they build them
    from deepspeed.accelerator import get_accelerator

    from ds_trainer.train.process import op_builds

    stop_watching = op_builds.watch()  # a build killed earlier (Ctrl-C, a lost session) left its lock: cleared

    names = list(sys.argv[1:] if argv is None else argv) or OPS
    print(f"building DeepSpeed ops into {where}", flush=True)
    failed = 0
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"  {name}: not available on this accelerator or machine (skipped)")
            continue
        try:
            builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - one op failing (no libaio) must not stop the others
            failed += 1
            print(f"  {name}: FAILED ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        print(f"  {name}: ready")
    stop_watching()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
