"""Starting ranks: torchrun on a free port, and a one-rank process group in this process."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


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
