"""Starting ranks: torchrun on a free port, and a one-rank process group in this process."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


def torchrun(ranks: int) -> list[str]:
    """`python -m torch.distributed.run` for `ranks` ranks on this machine, on a free port (not torchrun's
    default 29500, which two tests running side by side would both take)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port())]


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_rank_process_group(port: int) -> Iterator[None]:
    """A one-rank gloo process group in this process (for engines built in-process), the environment restored."""
    import deepspeed
    import torch

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train(cwd: Path, ranks: int, *args: str) -> Path:
    """One run of `ds_trainer` with `args` on `ranks` ranks from `cwd` (torchrun for more than one,
    one thread each); it must succeed; its run folder."""
    import subprocess

    from helpers.cli import run_cli, run_dirs

    one_thread = {"OMP_NUM_THREADS": "1"}
    cwd.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        result = run_cli(*args, cwd=cwd, env=one_thread, timeout=900)
    else:
        result = subprocess.run([*torchrun(ranks), "-m", "ds_trainer", *args], cwd=cwd,
                                env={**os.environ, **one_thread}, capture_output=True, text=True,
                                timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = run_dirs(cwd)
    return run_dir
