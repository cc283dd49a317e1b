"""Before the process group: every rank reaches the master address and sees the same run directory.

On several nodes the two classic failures hang until the scheduler's time limit: a node that cannot
reach MASTER_ADDR (torch waits out its 30-minute process-group timeout) and a run directory on a disk
that only one node sees (each node writes its own checkpoints, and the resume finds half of them).
This check runs first, over a TCPStore of its own on MASTER_PORT + 1 with a bounded timeout
(`DS_TRAINER_RENDEZVOUS_TIMEOUT_S`, default 300 s), and fails with the node and address named.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ds_trainer.config import distributed
from ds_trainer.errors import NodesError, TrainingError

log = logging.getLogger("ds_trainer")

MARKER = ".rendezvous"
DEFAULT_TIMEOUT_S = 300.0


def node_name() -> str:
    """This process's node: Slurm's name for it, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def timeout_s() -> float:
    return float(os.environ.get("DS_TRAINER_RENDEZVOUS_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def check(cfg: DictConfig, run_dir: Path) -> list[str]:
    """The node of each rank, once all ranks have met and agree on `run_dir`; raises TrainingError (after
    printing it, and recording it in summary.json where rank 0 can) when they cannot: NodesError."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if distributed.one_machine():  # nothing to check
        return [node_name()] * world
    try:
        return _meet(run_dir, world, rank)
    except TrainingError as exc:
        _fail(cfg, run_dir, world, rank, str(exc))
        raise NodesError(str(exc)) from None


def _meet(run_dir: Path, world: int, rank: int) -> list[str]:
    from torch.distributed import TCPStore

    addr, port, limit = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, timeout_s()
    me = node_name()
    where = f"node {me} (rank {rank})"
    try:
        store = TCPStore(addr, port, world, rank == 0, timeout=timedelta(seconds=limit), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - DistNetworkError, RuntimeError, socket errors: all "cannot reach"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainingError(f"{where} cannot reach the master address {addr}:{port} within {limit:.0f}s "
                            f"({reason}). MASTER_ADDR must be an address of the first node that every node can "
                            f"reach, and ports {port - 1}-{port} open between nodes") from None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        (run_dir / MARKER).write_text(token)
        store.set("token", token)
    store.set(f"node/{rank}", me)
    store.set(f"dir/{rank}", str(run_dir))
    token = _get(store, "token", where, addr, port)
    marker = run_dir / MARKER
    store.set(f"sees/{rank}", "1" if _sees(marker, token) else "0")
    if rank == 0:
        verdict = _judge(store, world, run_dir, limit)
        store.set("verdict", json.dumps(verdict))
        try:  # the store lives in this process: keep it until every rank has read the verdict
            store.wait([f"read/{r}" for r in range(1, world)], timedelta(seconds=limit))
        except Exception:  # noqa: BLE001 - a rank gone by now fails on its own
            pass
        marker.unlink(missing_ok=True)
    else:
        verdict = json.loads(_get(store, "verdict", where, addr, port))
        store.set(f"read/{rank}", "1")
    if verdict["error"]:
        raise TrainingError(verdict["error"])
    log.info("all %d ranks met at %s:%d on nodes %s and see %s", world, addr, port, ", ".join(verdict["nodes"]),
             run_dir)
    nodes: list[str] = verdict["nodes"]
    return nodes


def _sees(marker: Path, token: str, wait_s: float = 10.0) -> bool:
    """Whether `marker` holds `token`; a network file system may show a new file a few seconds late."""
    deadline = time.time() + wait_s
    while True:
        try:
            if marker.read_text() == token:
                return True
        except OSError:
            pass
        if time.time() > deadline:
            return False
        time.sleep(0.5)


def _get(store: Any, key: str, where: str, addr: str, port: int) -> str:
    try:
        return bytes(store.get(key)).decode()
    except Exception as exc:  # noqa: BLE001 - the store's timeout or the master going away
        raise TrainingError(f"{where} reached the master address {addr}:{port} but rank 0 did not answer within "
                            f"{timeout_s():.0f}s ({str(exc).strip().splitlines()[0] if str(exc).strip() else exc}); "
                            "see rank 0's error") from None


def _judge(store: Any, world: int, run_dir: Path, limit: float) -> dict[str, Any]:
    """Rank 0: which ranks came, on which nodes, and whether they all see the run directory."""
    keys = [f"sees/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=limit))
    except Exception:  # noqa: BLE001 - the store's timeout: name who is missing
        missing = [r for r in range(world) if not store.check([f"sees/{r}"])]
        addr = f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
        return {"nodes": [], "error": f"rank(s) {', '.join(map(str, missing))} of {world} did not reach the master "
                                      f"address {addr} (node {node_name()}, rank 0) within {limit:.0f}s: a node that "
                                      "cannot reach it, or one that never started; see their logs"}
    nodes = [bytes(store.get(f"node/{r}")).decode() for r in range(world)]
    blind = [r for r in range(world) if bytes(store.get(f"sees/{r}")).decode() != "1"]
    dirs = [bytes(store.get(f"dir/{r}")).decode() for r in range(world)]
    elsewhere = [f"rank {r} on node {nodes[r]} uses {dirs[r]}" for r in blind if dirs[r] != str(run_dir)]
    if elsewhere:  # torchrun on several machines: each names its run directory from its own clock
        return {"nodes": nodes, "error": f"the ranks do not use one run directory: rank 0 on node {nodes[0]} uses "
                                         f"{run_dir}, {', '.join(elsewhere)}. Give every node the same one: "
                                         "hydra.run.dir=<a path on a shared file system>"}
    if blind:
        who = ", ".join(f"rank {r} on node {nodes[r]}" for r in blind)
        return {"nodes": nodes, "error": f"the run directory {run_dir} is not shared between the nodes: rank 0 on "
                                         f"node {nodes[0]} wrote it, {who} does not see it. Put paths.outputs on a "
                                         "file system every node mounts at the same path (NFS, Lustre, ...)"}
    return {"nodes": nodes, "error": None}


def _fail(cfg: DictConfig, run_dir: Path, world: int, rank: int, message: str) -> None:
    print(f"ds_trainer: {message}", file=sys.stderr, flush=True)
    log.error("%s", message)
    if rank == 0:
        from ds_trainer.train.observe import metrics

        metrics.write_summary(run_dir, metrics.summarize(cfg, [], "error", message, world))


# How a collective fails when another rank died (kill -9, the out-of-memory killer, a node gone): gloo
# and NCCL. The run itself is fine; the launcher submits the job again (status `lost`).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited or there was a network error", "Socket Timeout")


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank went away."""
    return isinstance(exc, RuntimeError | OSError) and any(s in str(exc) for s in _PEER_LOST)


def lost_message(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"another rank went away ({node_name()} saw: {first[:300]}); its node's log says why. The "
            "ds_submitit launchers submit the job again; elsewhere resume=latest continues from the latest checkpoint")
