"""`python -m ds_trainer.tools.ops`: build DeepSpeed's ops ahead of the first run (`make ops`).

DeepSpeed compiles an op the first time a run uses it (ZeRO's Adam, CPU-offload Adam, NVMe's async_io):
measured here, the first ZeRO-2 run reached its first step after 44.8 s instead of 8.1 s. The build
lands in this Python environment's folder under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions;
see config/op_cache.py): point that at a folder every node of a cluster sees (a shared home or project
folder) so that each new node does not compile again.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from ds_trainer import console

# What the optimizer and offload groups can ask for, by DeepSpeed's builder names; every DeepSpeed process on
# the CPU accelerator also loads its communication op (ShareMemCommBuilder) when it starts.
OPS = ["FusedAdamBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
       "ShareMemCommBuilder"]
# Two halves of about equal compile time (measured on 2 cores: async_io with its pin_memory op 125 s, Lion 26; fused
# and CPU Adam 47 and 34, Adagrad 25, the comm op 25), built side by side: each op compiles one file at a time, so
# one after another they left a core idle (4 min 42 s on 2 cores, the longest part of `make setup`).
HALVES = (["AsyncIOBuilder", "CPULionBuilder"],
          ["FusedAdamBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "ShareMemCommBuilder"])


def main(argv: list[str] | None = None) -> int:
    """Build (or find built) every op this accelerator has, or the ops named; report each on one line."""
    names = list(sys.argv[1:] if argv is None else argv)
    if not names and (os.cpu_count() or 1) > 1:
        return _side_by_side()
    return _build(names or OPS)


def _side_by_side() -> int:
    """Every op, in two processes at once (`HALVES`); their lines in order, the first failure's status."""
    from ds_trainer.config import op_cache

    console.for_tool(logging.WARNING)
    print(f"building DeepSpeed ops into {op_cache.prepare()}", flush=True)
    procs = [subprocess.Popen([sys.executable, "-m", "ds_trainer.tools.ops", *half], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for half in HALVES]
    status = 0
    for proc in procs:
        out, _ = proc.communicate()
        print("".join(line for line in out.splitlines(keepends=True) if not line.startswith("building ")),
              end="", flush=True)
        status = status or proc.returncode
    return status


def _build(names: list[str]) -> int:
    from ds_trainer.config import op_cache

    console.for_tool(logging.WARNING)  # DeepSpeed's "Setting accelerator to CPU" is not news here

    where = op_cache.prepare()  # the folder runs of this environment load them from, built as they build them
    from deepspeed.accelerator import get_accelerator

    from ds_trainer.train.process import op_builds

    stop_watching = op_builds.watch()  # a build killed earlier (Ctrl-C, a lost session) left its lock: cleared

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
