"""Where this process sits in a run: rank and world size from torchrun, Accelerate, SLURM or submitit.

Torch-free: it only reads environment variables, so Hydra resolvers can use it before anything loads.
"""

from __future__ import annotations

import os


def rank() -> int:
    """Global rank: torchrun/Accelerate's RANK, else SLURM's or submitit-local's task id, else 0."""
    for var in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def is_main() -> bool:
    return rank() == 0


def local_rank() -> int:
    """This machine's rank: torchrun/Accelerate's LOCAL_RANK, else SLURM's local task id, else 0."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def under_torchrun() -> bool:
    """Whether torchrun's elastic agent started this process (it reports a rank's non-zero exit itself)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def one_machine() -> bool:
    """Whether every rank of the launch runs on this machine (LOCAL_WORLD_SIZE equals WORLD_SIZE, as
    torchrun and the submitit launchers set them)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world


def export_submitit_env() -> None:
    """Inside a submitit task, set RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT for torch.distributed.

    One task per GPU, started by srun: each task is one DeepSpeed rank. The master is the job's first
    node by its host name; a cluster whose host names resolve to the wrong network sets MASTER_ADDR
    (and MASTER_PORT) in the launcher's `setup` lines, and those win.
    """
    if "RANK" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    import submitit

    job = submitit.helpers.TorchDistributedEnvironment()  # reads MASTER_PORT when set
    job.master_addr = os.environ.get("MASTER_ADDR", job.master_addr)
    job.export(set_cuda_visible_devices=False, overwrite=True)
